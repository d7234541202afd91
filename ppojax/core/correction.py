"""Rollout correction: the responses were sampled by an engine whose probabilities π_s differ from
the learner's π_old at the same parameters (bfloat16 decode vs float32 forward, another kernel,
another framework), so the policy gradient is off-policy by the ratio

    ρ_t = π_old(y_t) / π_s(y_t) = exp(Δ_t),   Δ_t = old_logp_t − sampler_logp_t.

Two remedies, each at the token or the sequence level (verl's rollout correction, OpenRLHF's
TIS / icepop): reweight the policy term by a truncated ratio (``is_weight``: constant weights
[B, T]), or reject (mask out of the loss) what the engines disagree on too much
(``rejection_mask``). Both are constants: no gradient flows through them.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from ppojax.core import ops, surrogates

Array = jax.Array

IS_LEVELS = ("token", "sequence")  # rl.tis_level
REJECT_LEVELS = ("token", "sequence", "geometric")  # rl.reject ("": off)


def _log_ratio(old_logp: Array, sampler_logp: Array, mask: Array) -> tuple[Array, Array]:
  chex.assert_equal_shape([old_logp, sampler_logp, mask])
  mask = mask.astype(jnp.bool_)
  delta = jnp.where(mask, old_logp.astype(jnp.float32) - sampler_logp.astype(jnp.float32), 0.0)
  return jax.lax.stop_gradient(delta), mask


def sequence_log_ratio(delta: Array, mask: Array, geometric: bool = False) -> Array:
  """log of the sequence's ratio [B]: Σ_t Δ_t (the product of its token ratios), or with
  ``geometric`` the mean over its tokens (the product's |y|-th root, GSPO's sequence ratio:
  ``surrogates.sequence_log_ratio``; 0 for an empty row)."""
  if geometric:
    return surrogates.sequence_log_ratio(delta, mask)
  return jnp.sum(jnp.where(mask, delta, 0.0), axis=1)


def _level_log_ratio(delta: Array, mask: Array, level: str) -> Array:
  """log ρ per token [B, T] at ``level``: each token's own ("token"), or its row's product
  ("sequence") or the product's |y|-th root ("geometric") on each of the row's tokens."""
  if level == "token":
    return delta
  return sequence_log_ratio(delta, mask, level == "geometric")[:, None] * jnp.ones_like(delta)


def is_weight(old_logp: Array, sampler_logp: Array, mask: Array, cap: float,
              level: str = "token") -> tuple[Array, dict[str, Array]]:
  """Truncated importance sampling (TIS; Yao et al. 2025, "Your efficient RL framework secretly
  brings you off-policy RL training"): each token's policy term is weighted by

      token:     w_t = min(ρ_t, C)
      sequence:  w_t = min(Π_t ρ_t, C) = min(exp(Σ_t Δ_t), C)   (the same for all of y's tokens)

  (constant; 0 off the mask). The cap C bounds the variance; C = ∞ is plain importance
  sampling, and w ≡ 1 where the two engines agree. The sequence weight is unbiased for a
  sequence-level objective and has the larger variance (a product of T ratios).

  Returns:
    w [B, T] and metrics: ``mismatch`` = mean |Δ_t| (nats per token), ``is_weight`` = mean w
    over tokens, ``is_truncated`` = the fraction of tokens whose weight the cap set.
  """
  if level not in IS_LEVELS:
    raise ValueError(f"rl.tis_level={level!r}: choose one of {', '.join(IS_LEVELS)}")
  delta, mask = _log_ratio(old_logp, sampler_logp, mask)
  ratio = jnp.exp(_level_log_ratio(delta, mask, level))
  w = jnp.where(mask, jnp.minimum(ratio, cap), 0.0)
  metrics = {
      "mismatch": ops.masked_mean(jnp.abs(delta), mask),
      "is_weight": ops.masked_mean(w, mask),
      "is_truncated": ops.masked_mean((ratio > cap).astype(jnp.float32), mask),
  }
  return jax.lax.stop_gradient(w), jax.lax.stop_gradient(metrics)


def rejection_mask(old_logp: Array, sampler_logp: Array, mask: Array, low: float, high: float,
                   level: str = "token") -> tuple[Array, dict[str, Array]]:
  """The tokens kept in the loss [B, T] where the engines agree within [low, high]:

      token:      keep_t = low ≤ ρ_t ≤ high                  (icepop: each token alone)
      sequence:   keep_t = low ≤ Π_t ρ_t ≤ high              (the whole response or none)
      geometric:  keep_t = low ≤ (Π_t ρ_t)^{1/|y|} ≤ high     (the same, length-normalised)

  Returns:
    keep [B, T] bool (False off the mask) and metrics: ``rejected_tokens``, the fraction of
    response tokens masked; ``rejected_sequences``, of responses with any token masked.
  """
  if level not in REJECT_LEVELS:
    raise ValueError(f"rl.reject={level!r}: choose one of {', '.join(REJECT_LEVELS)} (or '')")
  delta, mask = _log_ratio(old_logp, sampler_logp, mask)
  log_ratio = _level_log_ratio(delta, mask, level)
  inside = (log_ratio >= jnp.log(low)) & (log_ratio <= jnp.log(high))
  keep = mask & inside
  rejected = mask & ~inside
  rows = jnp.any(mask, axis=1)
  metrics = {
      "rejected_tokens": ops.masked_mean(rejected.astype(jnp.float32), mask),
      "rejected_sequences": ops.masked_mean(jnp.any(rejected, axis=1).astype(jnp.float32),
                                            rows),
  }
  return keep, jax.lax.stop_gradient(metrics)
