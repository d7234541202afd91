"""The policy term of the loss, per token: which importance ratio is clipped, and how.

Each surrogate maps (log-ratio Δ_t = log π_θ(y_t) − log π_old(y_t), advantages A_t, mask, ε_low,
ε_high) to ``Terms``: per-token losses ℓ_t (the loss is agg(ℓ_t), ``ops.aggregate``), where the
clip is active, and the ratio used. ``SURROGATES`` names them for ``rl.loss_mode``:

| mode         | ratio                                         | ℓ_t                              |
|--------------|-----------------------------------------------|----------------------------------|
| `clip`       | ρ_t = e^{Δ_t}                                 | max(−A·ρ_t, −A·clip(ρ_t))        |
| `gspo`       | s_i = e^{mean_t Δ_t}, the sequence's          | max(−A·s_i, −A·clip(s_i))        |
| `gspo_token` | s_{i,t} = e^{Δ_t − sg(Δ_t) + sg(mean_t Δ_t)} | max(−A·s_{i,t}, −A·clip(s_{i,t})) |
| `cispo`      | w_t = sg(clip(ρ_t))                           | −w_t·A·Δ_t                       |

clip(x) = clip(x, 1 − ε_low, 1 + ε_high); sg: stop-gradient; mean_t over the sequence's mask.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import chex
import jax
import jax.numpy as jnp

Array = jax.Array


class Terms(NamedTuple):
  per_token: Array  # [B, T] loss terms ℓ_t (0 off the mask)
  clipped: Array  # [B, T] bool: the clip decides the term (its gradient is 0 or capped there)
  ratio: Array  # [B, T] the ratio the surrogate clips (ρ_t, or the sequence's s_i)


def clipped_term(adv: Array, ratio: Array, eps_low: float, eps_high: float
                 ) -> tuple[Array, Array]:
  """PPO's pessimistic term max(−A·x, −A·clip(x, 1 − ε_low, 1 + ε_high)) and where the clipped
  one is the larger (then ∂/∂x = 0)."""
  unclipped = -adv * ratio
  clipped = -adv * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
  return jnp.maximum(unclipped, clipped), clipped > unclipped


def token_clip(log_ratio: Array, adv: Array, mask: Array, eps_low: float, eps_high: float
               ) -> Terms:
  """PPO (Schulman et al. 2017): each token's ratio ρ_t = e^{Δ_t} clipped on its own."""
  ratio = jnp.exp(log_ratio)
  per_token, clipped = clipped_term(adv, ratio, eps_low, eps_high)
  return Terms(jnp.where(mask, per_token, 0.0), clipped & mask, ratio)


def sequence_log_ratio(log_ratio: Array, mask: Array) -> Array:
  """The length-normalised sequence log-ratio [B]: (1/|y_i|)·Σ_t m_t·Δ_t = log of the geometric
  mean of the token ratios (0 for an empty row)."""
  chex.assert_equal_shape([log_ratio, mask])
  lengths = jnp.maximum(jnp.sum(mask, axis=1), 1).astype(jnp.float32)
  return jnp.sum(jnp.where(mask, log_ratio, 0.0), axis=1) / lengths


def gspo(log_ratio: Array, adv: Array, mask: Array, eps_low: float, eps_high: float) -> Terms:
  """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): one ratio per sequence,
  s_i = (π_θ(y_i)/π_old(y_i))^{1/|y_i|}, clipped per sequence; ℓ_t is the sequence's term on
  every one of its tokens, so agg = seq_mean_token_mean gives the paper's
  mean_i max(−A_i·s_i, −A_i·clip(s_i)), with ∂s_i/∂ log π_θ(y_t) = s_i/|y_i|. The ε are the
  sequence ratio's (the paper: 3e-4 / 4e-4)."""
  s = jnp.exp(sequence_log_ratio(log_ratio, mask))[:, None] * jnp.ones_like(log_ratio)
  per_token, clipped = clipped_term(adv, s, eps_low, eps_high)
  return Terms(jnp.where(mask, per_token, 0.0), clipped & mask, s)


def gspo_token(log_ratio: Array, adv: Array, mask: Array, eps_low: float, eps_high: float
               ) -> Terms:
  """GSPO-token (same paper, eq. 13; verl's ``gspo``): s_{i,t} = sg(s_i)·π_θ(y_t)/sg(π_θ(y_t)),
  equal in value to s_i but with each token's own gradient, so a per-token advantage A_{i,t}
  can be used; with A constant over the sequence and agg = seq_mean_token_mean, the gradient
  equals ``gspo``'s."""
  seq = jax.lax.stop_gradient(sequence_log_ratio(log_ratio, mask))[:, None]
  s = jnp.exp(log_ratio - jax.lax.stop_gradient(log_ratio) + seq)
  per_token, clipped = clipped_term(adv, s, eps_low, eps_high)
  return Terms(jnp.where(mask, per_token, 0.0), clipped & mask, s)


def cispo(log_ratio: Array, adv: Array, mask: Array, eps_low: float, eps_high: float) -> Terms:
  """CISPO (MiniMax-M1, 2025): a REINFORCE term weighted by the clipped, constant ratio,
  ℓ_t = −sg(clip(ρ_t, 1 − ε_low, 1 + ε_high))·A_t·Δ_t, so no token loses its gradient to the
  clip (PPO's zeroes it), only its weight is capped. ∂ℓ_t/∂ log π_θ(y_t) = −w_t·A_t, as with
  trl's −w·A·log π (the value differs by the constant w·A·log π_old: 0 at ρ = 1 here)."""
  ratio = jnp.exp(log_ratio)
  weight = jax.lax.stop_gradient(jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high))
  clipped = (ratio < 1.0 - eps_low) | (ratio > 1.0 + eps_high)
  return Terms(jnp.where(mask, -weight * adv * log_ratio, 0.0), clipped & mask, ratio)


SURROGATES: dict[str, Callable[..., Terms]] = {
    "clip": token_clip, "gspo": gspo, "gspo_token": gspo_token, "cispo": cispo}


def surrogate(name: str) -> Callable[..., Terms]:
  """``SURROGATES[name]``; a ValueError naming the choices for any other."""
  try:
    return SURROGATES[name]
  except KeyError:
    raise ValueError(f"rl.loss_mode={name!r}: choose one of {', '.join(SURROGATES)}") from None
