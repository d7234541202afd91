"""An RL algorithm as one record of pure functions and flags, built once from the config.

    algorithm = algorithms.from_config(config)    # the only place that reads its name
    adv, ret = algorithm.estimate(inputs, params)  # the step calls it, never asks which it is

| algorithm    | estimator    | KL goes into | aggregation             | KL estimator | loss mode |
|--------------|--------------|--------------|-------------------------|--------------|-----------|
| ppo          | gae          | reward       | token_mean              | k1           | clip      |
| grpo         | grpo         | loss         | seq_mean_token_mean     | k3           | clip      |
| dr_grpo      | dr_grpo      | loss         | seq_mean_token_sum_norm | k3           | clip      |
| rloo         | rloo         | reward       | token_mean              | k1           | clip      |
| reinforce_pp | reinforce_pp | reward       | token_mean              | k2           | clip      |
| gspo         | grpo         | loss         | seq_mean_token_mean     | k3           | gspo      |
| cispo        | grpo         | loss         | token_mean              | k3           | cispo     |

Each of the five ``rl.*`` fields of the same names left at "" takes the algorithm's value; a value
set in the config wins (``--config.algorithm=grpo --config.rl.aggregation=token_mean``).
KL in the reward: r_t = −β·KL_t (+ the score on the last token); KL in the loss: the rewards are
the scores alone and the loss adds β·agg(KL_t) (``losses.kl_loss``). The loss mode is the
policy term's surrogate (``surrogates.SURROGATES``): PPO's token clip, GSPO's sequence ratio or
CISPO's clipped-weight REINFORCE term. Adding an estimator is one function and one
``advantages.ESTIMATORS`` entry; adding an algorithm is one ``ALGORITHMS`` row.
"""

from __future__ import annotations

import copy
from typing import Callable, NamedTuple

import jax
import ml_collections

from ppojax.core import advantages, kl, surrogates

Array = jax.Array


class Defaults(NamedTuple):
  """An algorithm's values for the ``rl`` fields of the same names (all strings)."""

  estimator: str  # advantages.ESTIMATORS
  kl_in: str  # "reward" or "loss"
  aggregation: str  # ops.AGGREGATIONS
  kl_estimator: str  # kl.KL_ESTIMATORS
  loss_mode: str = "clip"  # surrogates.SURROGATES


ALGORITHMS: dict[str, Defaults] = {
    "ppo": Defaults("gae", "reward", "token_mean", "k1"),
    "grpo": Defaults("grpo", "loss", "seq_mean_token_mean", "k3"),
    "dr_grpo": Defaults("dr_grpo", "loss", "seq_mean_token_sum_norm", "k3"),
    "rloo": Defaults("rloo", "reward", "token_mean", "k1"),
    "reinforce_pp": Defaults("reinforce_pp", "reward", "token_mean", "k2"),
    "gspo": Defaults("grpo", "loss", "seq_mean_token_mean", "k3", "gspo"),
    "cispo": Defaults("grpo", "loss", "token_mean", "k3", "cispo"),
}
KL_PLACEMENTS = ("reward", "loss")


class Algorithm(NamedTuple):
  """What the step needs to know of its algorithm: functions to call and flags to read.

  ``estimate(inputs, params) → (advantages [N, T], returns [N, T] or None)``
  (``advantages.AdvantageInputs``/``AdvantageParams``); ``kl(logp, ref_logp) → KL_t``;
  ``kl_in_loss``: β·KL is a loss term (else shaped into the token rewards); ``aggregation``: the
  loss's mode (``ops.aggregate``); ``needs_critic``: the estimator reads V(s_t) and returns the
  critic's target (no critic exists otherwise); ``needs_groups``: it compares a prompt's n
  samples (n ≥ 2)."""

  estimate: Callable[[advantages.AdvantageInputs, advantages.AdvantageParams],
                     tuple[Array, Array | None]]
  kl: Callable[[Array, Array], Array]
  kl_in_loss: bool
  aggregation: str
  surrogate: Callable[..., surrogates.Terms]
  needs_critic: bool
  needs_groups: bool


def defaults(name: str) -> Defaults:
  """The ``ALGORITHMS`` row ``name``; a clear ``ValueError`` for any other."""
  try:
    return ALGORITHMS[name]
  except KeyError:
    raise ValueError(f"unknown algorithm {name!r}; choose one of {', '.join(ALGORITHMS)}"
                     ) from None


def resolve(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A copy of ``config`` whose ``rl`` fields named in ``Defaults`` that are "" hold
  ``config.algorithm``'s values (fields already set are kept). Idempotent."""
  config = copy.deepcopy(config)
  for field, value in defaults(config.get("algorithm", "ppo"))._asdict().items():
    if config.rl.get(field, "") == "":
      config.rl[field] = value
  return config


def make(estimator: str, kl_in: str, aggregation: str, kl_estimator: str,
         loss_mode: str = "clip") -> Algorithm:
  """The record from its five choices (names as in ``Defaults``); ``ValueError`` names a bad
  one."""
  est = advantages.estimator(estimator)
  if kl_in not in KL_PLACEMENTS:
    raise ValueError(f"kl_in={kl_in!r}: choose one of {', '.join(KL_PLACEMENTS)}")
  if kl_estimator not in kl.KL_ESTIMATORS:
    raise ValueError(f"unknown KL estimator {kl_estimator!r}; choose one of "
                     f"{sorted(kl.KL_ESTIMATORS)}")
  return Algorithm(estimate=est.fn, kl=kl.KL_ESTIMATORS[kl_estimator],
                   kl_in_loss=kl_in == "loss", aggregation=aggregation,
                   surrogate=surrogates.surrogate(loss_mode), needs_critic=est.needs_critic,
                   needs_groups=est.needs_groups)


def from_config(config: ml_collections.ConfigDict) -> Algorithm:
  """The run's algorithm: ``config.algorithm``'s defaults, overridden by the ``rl`` fields set."""
  rl = resolve(config).rl
  return make(rl.estimator, rl.kl_in, rl.aggregation, rl.kl_estimator, rl.loss_mode)
