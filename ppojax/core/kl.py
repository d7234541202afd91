"""Per-token KL estimators and KL-coefficient controllers.

Estimators take the log-probs of the *sampled* tokens under the policy (``logp``) and the
reference (``ref_logp``) and return a per-token estimate of KL(π ‖ π_ref). With Δ = logp − ref_logp
and the tokens sampled from π (Schulman, "Approximating KL divergence", 2020):

  k1 = Δ                    unbiased, high variance, can be negative
  k2 = ½·Δ²                 biased, low variance, ≥ 0          (trl's "mse")
  k3 = (e^{−Δ} − 1) + Δ     unbiased, low variance, ≥ 0
  abs = |Δ|                                                   (trl's "abs")
  clamp = max(Δ, 0)         one-sided: only penalises raising the probability (AlpacaFarm)

Controllers follow optax's shape: a ``KLController`` is a pair of pure functions
``init() -> state`` and ``update(state, kl, n_steps) -> state``; ``state.beta`` is the coefficient.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import chex
import jax
import jax.numpy as jnp

Array = jax.Array


def kl_k1(logp: Array, ref_logp: Array) -> Array:
  """k1 = log π(a) − log π_ref(a)."""
  chex.assert_equal_shape([logp, ref_logp])
  return jnp.subtract(logp, ref_logp)


def kl_k2(logp: Array, ref_logp: Array) -> Array:
  """k2 = ½·(log π(a) − log π_ref(a))²."""
  return 0.5 * jnp.square(kl_k1(logp, ref_logp))


def kl_k3(logp: Array, ref_logp: Array) -> Array:
  """k3 = (r − 1) − log r with r = π_ref(a)/π(a), i.e. e^{−Δ} − 1 + Δ."""
  delta = kl_k1(logp, ref_logp)
  return jnp.expm1(-delta) + delta


def kl_abs(logp: Array, ref_logp: Array) -> Array:
  """|log π(a) − log π_ref(a)|."""
  return jnp.abs(kl_k1(logp, ref_logp))


def kl_clamp(logp: Array, ref_logp: Array) -> Array:
  """max(log π(a) − log π_ref(a), 0) (AlpacaFarm's clamped KL)."""
  return jnp.maximum(kl_k1(logp, ref_logp), 0.0)


KL_ESTIMATORS: dict[str, Callable[[Array, Array], Array]] = {
    "k1": kl_k1,
    "kl": kl_k1,
    "k2": kl_k2,
    "mse": kl_k2,
    "k3": kl_k3,
    "abs": kl_abs,
    "clamp": kl_clamp,
}


def per_token_kl(logp: Array, ref_logp: Array,
                 estimator: str | Callable[[Array, Array], Array] = "k1") -> Array:
  """Per-token KL estimate: ``estimator`` is one of ``KL_ESTIMATORS`` by name (k1|kl, k2|mse,
  k3, abs, clamp) or such a function itself (``algorithms.Algorithm.kl``)."""
  if callable(estimator):
    return estimator(logp, ref_logp)
  try:
    fn = KL_ESTIMATORS[estimator]
  except KeyError:
    raise ValueError(
        f"unknown KL estimator {estimator!r}; choose one of {sorted(KL_ESTIMATORS)}") from None
  return fn(logp, ref_logp)


# ---------------------------------------------------------------------------------------------
# Controllers
# ---------------------------------------------------------------------------------------------


class KLControllerState(NamedTuple):
  beta: Array  # float32 scalar: the current KL coefficient


class KLController(NamedTuple):
  init: Callable[[], KLControllerState]
  update: Callable[[KLControllerState, Array, Array | int], KLControllerState]


def fixed_kl_controller(beta: float) -> KLController:
  """β stays constant."""

  def init():
    return KLControllerState(beta=jnp.asarray(beta, jnp.float32))

  def update(state, kl, n_steps):
    del kl, n_steps
    return state

  return KLController(init, update)


def adaptive_kl_controller(init_beta: float, target: float, horizon: float) -> KLController:
  """Proportional controller of Ziegler et al. (2019), "Fine-tuning LMs from human preferences".

    e = clip(KL / target − 1, −0.2, 0.2),    β ← β·(1 + e·n_steps / horizon)

  ``kl`` is the observed KL of the batch (per sequence, summed over tokens, as trl) and
  ``n_steps`` the number of samples (episodes) it was measured on. The factor is floored at ½:
  the published rule turns β ≤ 0 once n_steps ≥ 5·horizon (and a negative β would *reward*
  divergence); the floor only acts when n_steps > 2.5·horizon.
  """
  if target <= 0 or horizon <= 0:
    raise ValueError(f"adaptive KL needs target > 0 and horizon > 0, got {target=}, {horizon=}")

  def init():
    return KLControllerState(beta=jnp.asarray(init_beta, jnp.float32))

  def update(state, kl, n_steps):
    error = jnp.clip(jnp.asarray(kl, jnp.float32) / target - 1.0, -0.2, 0.2)
    factor = jnp.maximum(1.0 + error * n_steps / horizon, 0.5)
    return KLControllerState(beta=state.beta * factor)

  return KLController(init, update)
