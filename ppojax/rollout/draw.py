"""One token per row from next-token logits [B, V]: temperature, top-k / top-p / min-p
truncation, greedy argmax or an inverse-CDF draw, and the drawn tokens' log-probs
(``sampling.generate``'s every step).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array
SamplingConfig = Any  # rollout.sampling.SamplingConfig (not imported: sampling imports this)


def truncate_logits(z: Array, config: SamplingConfig) -> Array:
  """Temperature-scaled logits [B, V] with the tokens that top-k / top-p / min-p exclude set to
  −inf (applied in that order, as Hugging Face's logits warpers)."""
  neg_inf = jnp.finfo(z.dtype).min
  if config.top_k:
    kth = jax.lax.top_k(z, min(config.top_k, z.shape[-1]))[0][:, -1:]
    z = jnp.where(z < kth, neg_inf, z)
  if config.top_p < 1:
    sorted_z = jnp.sort(z, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(sorted_z, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted token
    keep = before < config.top_p  # always keeps the most likely token
    threshold = jnp.min(jnp.where(keep, sorted_z, jnp.inf), axis=-1, keepdims=True)
    z = jnp.where(z < threshold, neg_inf, z)
  if config.min_p > 0:
    probs = jax.nn.softmax(z, axis=-1)
    z = jnp.where(probs < config.min_p * jnp.max(probs, axis=-1, keepdims=True), neg_inf, z)
  return z


def sample_token(logits: Array, key: Array, config: SamplingConfig, banned: Array | None = None):
  """One token per row from next-token logits [B, V]: (tokens, logprobs, sampling_logprobs).

  ``banned`` [V] or [B, V] excludes tokens from sampling (stop ids before ``min_new_tokens``);
  like the truncation it changes ``sampling_logprobs`` only, never ``logprobs``.

  log π(i) = z_i − m − log Σ_j exp(z_j − m) with m = max z is evaluated for the chosen tokens
  only: one exp pass per distribution over [B, V], its weights reused for the draw.
  """
  z = logits.astype(jnp.float32) / config.temperature
  z_max, weights, lse = _normaliser(z)
  zt, zt_max, weights_t, lse_t = z, z_max, weights, lse
  if config.truncates or banned is not None:
    zt = z if banned is None else jnp.where(banned, jnp.finfo(z.dtype).min, z)
    zt = truncate_logits(zt, config) if config.truncates else zt
    zt_max, weights_t, lse_t = _normaliser(zt)
  if config.greedy:
    tokens = first_argmax(zt, zt_max)
  else:
    tokens = _inverse_cdf_sample(key, weights_t)
  pick = lambda x: jnp.take_along_axis(x, tokens[:, None], axis=-1)[:, 0]  # noqa: E731
  return tokens, pick(z - lse), pick(zt - lse_t)


def _normaliser(z: Array) -> tuple[Array, Array, Array]:
  """m = max_i z_i [B, 1], the unnormalised probabilities w = exp(z − m) [B, V] and
  logsumexp(z) = m + log Σ w [B, 1]."""
  z_max = jnp.max(z, axis=-1, keepdims=True)
  weights = jnp.exp(z - z_max)
  return z_max, weights, z_max + jnp.log(jnp.sum(weights, axis=-1, keepdims=True))


def first_argmax(z: Array, z_max: Array) -> Array:
  """argmax over the last axis (the first index on ties), given z_max = max(z, -1, keepdims).

  A where + min reduction: XLA:CPU lowers ``jnp.argmax``'s variadic reduce to a slow loop."""
  vocab = z.shape[-1]
  index = jnp.where(z == z_max, jnp.arange(vocab, dtype=jnp.int32), vocab)
  return jnp.minimum(jnp.min(index, axis=-1), vocab - 1).astype(jnp.int32)


_CDF_BLOCK = 256


def _inverse_cdf_sample(key: Array, weights: Array) -> Array:
  """Token i with probability w_i / Σw for weights [B, V] ≥ 0 with a positive sum:
  ``inverse_cdf`` at u ~ U[tiny, 1), one uniform per row instead of the Gumbel-max trick's one
  per vocabulary entry (whose random bits cost more than the rest of a decode step)."""
  u = jax.random.uniform(key, (weights.shape[0], 1), minval=jnp.finfo(jnp.float32).tiny,
                         maxval=1.0)
  return inverse_cdf(weights, u)


def inverse_cdf(weights: Array, u: Array) -> Array:
  """The first token i whose CDF_i ≥ u·Σw, for weights [B, V] ≥ 0 with a positive sum and
  u [B, 1] in (0, 1]; always a token of positive weight, whatever the rounding.

  The CDF is two-level: cumulative sums of 256-token block totals pick the block (the first
  whose block CDF reaches the target, so its total is positive), a cumulative sum inside that
  block picks the token (a full-length ``cumsum`` is slow on CPU). The two levels round
  differently, so the offset in the block is clipped to the block's first and last positive
  weights: a rounding at either edge would otherwise land on a zero-weight token.
  """
  batch, vocab = weights.shape
  blocks = -(-vocab // _CDF_BLOCK)
  w = jnp.pad(weights, ((0, 0), (0, blocks * _CDF_BLOCK - vocab))).reshape(
      batch, blocks, _CDF_BLOCK)
  block_cdf = jnp.cumsum(jnp.sum(w, axis=-1), axis=-1)  # [B, blocks]
  target = u * block_cdf[:, -1:]  # in [0, Σw] (0 only by underflow)
  # leading blocks of total 0 are skipped even at target 0
  block = jnp.sum((block_cdf < target) | (block_cdf <= 0), axis=-1)  # [B]
  block = jnp.minimum(block, blocks - 1)
  below = jnp.where(block > 0, jnp.take_along_axis(
      block_cdf, jnp.maximum(block - 1, 0)[:, None], axis=-1)[:, 0], 0.0)
  inner = jnp.take_along_axis(w, block[:, None, None], axis=1)[:, 0]  # [B, 256]
  offset = jnp.sum(jnp.cumsum(inner, axis=-1) < (target - below[:, None]), axis=-1)
  index = jnp.arange(_CDF_BLOCK, dtype=jnp.int32)
  first = jnp.min(jnp.where(inner > 0, index, _CDF_BLOCK - 1), axis=-1)
  last = jnp.max(jnp.where(inner > 0, index, 0), axis=-1)
  return (block * _CDF_BLOCK + jnp.clip(offset, first, last)).astype(jnp.int32)
