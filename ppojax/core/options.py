"""The ranges of the loss options, in one place: the losses check Python numbers against them
(``losses``), and the config's checks (``run/checks.py``) the rl options of the same names, so
both give one message word for word."""

from __future__ import annotations

import numpy as np

# option: (test, what the value must be and why)
OPTION_RANGES = {
    "clip_eps": (lambda v: 0 < v < 1,
                 "must be in (0, 1): the policy ratio is clipped to [1 − ε, 1 + ε] (0.2 is usual)"),
    "clip_eps_low": (lambda v: 0 < v < 1,
                     "must be in (0, 1): the ratio is clipped below at 1 − clip_eps_low (only "
                     "rl.loss_mode='cispo' goes without a floor, at a value >= 1)"),
    # CISPO's weight sg(clip(ρ, 1 − ε_low, 1 + ε_high)) may go without a floor: ε_low >= 1
    "clip_eps_low_cispo": (lambda v: v > 0,
                           "must be > 0 with rl.loss_mode='cispo' (>= 1: no lower bound on the "
                           "weight, as verl's CISPO example's clip_ratio_low=10)"),
    "clip_eps_high": (lambda v: v > 0, "must be > 0 (0.28 in DAPO's clip-higher)"),
    "dual_clip": (lambda v: v > 1,
                  "must be > 1 (dual-clip PPO, Ye et al. 2020; 3 is usual) or None to turn it "
                  "off: with c <= 1 the cap −c·A undercuts the clipped loss and silently zeroes "
                  "the gradient of every token with a negative advantage"),
    "value_clip": (lambda v: v > 0,
                   "must be > 0 (0.2 is usual), or None for an unclipped value loss"),
    "vf_coef": (lambda v: v >= 0, "must be >= 0 (the value loss's weight; 0.1 is trl's)"),
    "ent_coef": (lambda v: v >= 0, "must be >= 0 (the entropy bonus's weight; 0: none): a "
                 "negative one penalises entropy"),
    "kl_coef": (lambda v: v >= 0, "must be >= 0 (β of the KL penalty; 0: none): a negative one "
                "rewards drifting from the reference policy"),
}


def check_option(name: str, value, option: str | None = None) -> None:
  """Raise ValueError where ``value`` is a Python (or NumPy) number outside the range of
  ``OPTION_RANGES[option or name]``; arrays and tracers pass unchecked (under jit a check would
  need the value)."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(
      value, (int, float, np.integer, np.floating)):
    return
  ok, requirement = OPTION_RANGES[option or name]
  if not ok(value):
    raise ValueError(f"{name}={value!r} {requirement}")


def clip_floor_option(loss_mode: str) -> str:
  """The range ``clip_eps_low`` is checked against under ``loss_mode``: (0, 1) where the
  surrogate clips the ratio PPO's way (a floor at or below 0 would turn the clip off for
  negative advantages), any positive value for CISPO (>= 1: no floor)."""
  return "clip_eps_low_cispo" if loss_mode == "cispo" else "clip_eps_low"
