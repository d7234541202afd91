"""One token per row from next-token logits [B, V]: temperature, top-k / top-p / min-p
truncation, greedy argmax or an inverse-CDF draw, and the drawn tokens' log-probs
(``sampling.generate``'s every step).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ppojax.infra.sharding import compile_platform

Array = jax.Array
SamplingConfig = Any  # rollout.sampling.SamplingConfig (not imported: sampling imports this)


# top-p looks for its cut among the most likely tokens first (``top_threshold``)
TOP_P_CANDIDATES = 256


def truncate_logits(z: Array, config: SamplingConfig) -> Array:
  """Temperature-scaled logits [B, V] with the tokens that top-k / top-p / min-p exclude set to
  −inf (applied in that order, as Hugging Face's logits warpers), the whole vocabulary sorted
  for top-p: the reference ``sample_token``'s thresholds are tested against."""
  neg_inf = jnp.finfo(z.dtype).min
  if config.top_k:
    kth = jax.lax.top_k(z, min(config.top_k, z.shape[-1]))[0][:, -1:]
    z = jnp.where(z < kth, neg_inf, z)
  if config.top_p < 1:
    z = jnp.where(z < sorted_top_p(z, config.top_p), neg_inf, z)
  if config.min_p > 0:
    probs = jax.nn.softmax(z, axis=-1)
    z = jnp.where(probs < config.min_p * jnp.max(probs, axis=-1, keepdims=True), neg_inf, z)
  return z


def sorted_top_p(z: Array, top_p: float) -> Array:
  """Top-p's cut τ [B, 1] by a sort of the whole vocabulary: the smallest z kept, where sorted
  token i is kept while the mass strictly above it is < p (the most likely always)."""
  sorted_z = jnp.sort(z, axis=-1)[:, ::-1]
  probs = jax.nn.softmax(sorted_z, axis=-1)
  keep = jnp.cumsum(probs, axis=-1) - probs < top_p
  return jnp.min(jnp.where(keep, sorted_z, jnp.inf), axis=-1, keepdims=True)


def top_threshold(z: Array, z_max: Array, config: SamplingConfig) -> Array:
  """One cut τ [B, 1] for top-k and top-p together (tokens with z ≥ τ are kept), without a sort
  of the vocabulary: the k-th largest z, then top-p's cut over the top-k distribution found
  among its ``TOP_P_CANDIDATES`` most likely tokens — exact wherever their mass reaches p, which
  decides the cut; where a row's does not, the batch takes ``sorted_top_p`` (a ``lax.cond``: the
  sort runs only then). Ties at τ are kept, as by ``truncate_logits``."""
  vocab = z.shape[-1]
  k = min(config.top_k, vocab)
  n = min(vocab, max(k, TOP_P_CANDIDATES if config.top_p < 1 else 0))
  top = jax.lax.top_k(z, n)[0]  # [B, n], descending
  tau = top[:, k - 1:k] if k else jnp.full(z_max.shape, -jnp.inf, z.dtype)
  if config.top_p < 1:
    total = jnp.sum(jnp.where(z >= tau, jnp.exp(z - z_max), 0.0), axis=-1, keepdims=True)
    probs = jnp.where(top >= tau, jnp.exp(top - z_max), 0.0) / total
    mass = jnp.cumsum(probs, axis=-1)
    cut = jnp.min(jnp.where(mass - probs < config.top_p, top, jnp.inf), axis=-1, keepdims=True)
    exact = jnp.all(mass[:, -1] >= config.top_p)
    cut = jax.lax.cond(exact, lambda: cut, lambda: sorted_top_p(
        jnp.where(z >= tau, z, jnp.finfo(z.dtype).min), config.top_p))
    tau = jnp.maximum(tau, cut)
  return tau


def sample_token(logits: Array, key: Array, config: SamplingConfig, banned: Array | None = None):
  """One token per row from next-token logits [B, V]: (tokens, logprobs, sampling_logprobs).

  ``banned`` [V] or [B, V] excludes tokens from sampling (stop ids before ``min_new_tokens``);
  like the truncation it changes ``sampling_logprobs`` only, never ``logprobs``.

  log π(i) = z_i − m − log Σ_j exp(z_j − m) with m = max z is evaluated for the chosen tokens
  only. Top-k and top-p are one cut on z (``top_threshold``), min-p keeps exp(z − m) ≥ min_p
  (p_i ≥ min_p · p_max), so the sampled distribution's weights are w = exp(z − m) where kept,
  else 0: their sum is the truncated normaliser, their CDF the draw (``_weights``).
  """
  z = logits.astype(jnp.float32) / config.temperature
  z_max, _, lse = _normaliser(z)
  zt, zt_max = z, z_max
  if banned is not None:
    zt = jnp.where(banned, jnp.finfo(z.dtype).min, z)
    zt_max = jnp.max(zt, axis=-1, keepdims=True)
  if config.top_k or config.top_p < 1:
    zt = jnp.where(zt >= top_threshold(zt, zt_max, config), zt, jnp.finfo(z.dtype).min)
  if config.min_p > 0:
    zt = jnp.where(jnp.exp(zt - zt_max) >= config.min_p, zt, jnp.finfo(z.dtype).min)
  values, weight, fill = _weights(zt, zt_max)  # the maximum is never cut: zt_max stays
  lse_t = zt_max + jnp.log(jnp.sum(weight(values), axis=-1, keepdims=True))
  if config.greedy:
    tokens = first_argmax(zt, zt_max)
  else:
    tokens = _inverse_cdf(values, _uniform(key, zt.shape[0]), weight, fill)
  pick = lambda x: jnp.take_along_axis(x, tokens[:, None], axis=-1)[:, 0]  # noqa: E731
  return tokens, pick(z) - lse[:, 0], pick(z) - lse_t[:, 0]


def _weights(zt: Array, zt_max: Array):
  """(values, weight, fill): the draw's weights w = weight(values) = exp(zt − zt_max), elementwise
  (weight(fill) = 0). Compiled for a GPU or TPU, the values are zt and no pass writes w out:
  each reduction (the sums, the CDF's block totals) computes it as it reads, and the chosen
  block's again from its zt, so the logits are a step's one vocabulary-sized array
  (``benchmarks/decode_hlo.py``). XLA:CPU, whose exp costs more than the pass, gets w written
  once (values = w; ``benchmarks/draw.py``)."""
  if compile_platform(zt) == "cpu":
    return jnp.exp(zt - zt_max), lambda w: w, 0.0
  def weight(x):
    return jnp.exp(x - zt_max.reshape(zt_max.shape[:1] + (1,) * (x.ndim - 1)))
  return zt, weight, jnp.finfo(zt.dtype).min


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


def cdf_block(vocab: int) -> int:
  """The inverse CDF's block: the largest divisor of ``vocab`` up to 256 where it is at least 64
  (Qwen's 151936 = 1187 · 128), so the blocks are a reshape of the weights; else 256, the
  vocabulary padded to a multiple of it (a copy of [B, V] per draw)."""
  size = max(d for d in range(1, _CDF_BLOCK + 1) if vocab % d == 0)
  return size if size >= 64 else _CDF_BLOCK


def _uniform(key: Array, rows: int) -> Array:
  """u ~ U[tiny, 1) [rows, 1]: one uniform per row instead of the Gumbel-max trick's one per
  vocabulary entry (whose random bits cost more than the rest of a decode step)."""
  return jax.random.uniform(key, (rows, 1), minval=jnp.finfo(jnp.float32).tiny, maxval=1.0)


def _inverse_cdf_sample(key: Array, weights: Array) -> Array:
  """Token i with probability w_i / Σw for weights [B, V] ≥ 0 with a positive sum:
  ``inverse_cdf`` at u ~ U[tiny, 1)."""
  return inverse_cdf(weights, _uniform(key, weights.shape[0]))


def inverse_cdf(weights: Array, u: Array) -> Array:
  """The first token i whose CDF_i ≥ u·Σw, for weights [B, V] ≥ 0 with a positive sum and
  u [B, 1] in (0, 1]; always a token of positive weight, whatever the rounding.

  The CDF is two-level: cumulative sums of block totals (``cdf_block``: up to 256 tokens) pick
  the block (the first whose block CDF reaches the target, so its total is positive), a
  cumulative sum inside that block picks the token (a full-length ``cumsum`` is slow on CPU).
  The two levels round differently, so the offset in the block is clipped to the block's first
  and last positive weights: a rounding at either edge would otherwise land on a zero-weight
  token.
  """
  return _inverse_cdf(weights, u, lambda w: w, 0.0)


def _inverse_cdf(values: Array, u: Array, weight, fill) -> Array:
  """``inverse_cdf`` of the weights w = weight(values) (elementwise; weight(fill) = 0), computed
  where they are read: inside the block totals' reduction, and for the chosen block's tokens."""
  batch, vocab = values.shape
  size = cdf_block(vocab)
  blocks = -(-vocab // size)
  v = values if blocks * size == vocab else jnp.pad(
      values, ((0, 0), (0, blocks * size - vocab)), constant_values=fill)
  block_cdf = jnp.cumsum(jnp.sum(weight(v.reshape(batch, blocks, size)), axis=-1), axis=-1)
  target = u * block_cdf[:, -1:]  # in [0, Σw] (0 only by underflow)
  # leading blocks of total 0 are skipped even at target 0
  block = jnp.sum((block_cdf < target) | (block_cdf <= 0), axis=-1)  # [B]
  block = jnp.minimum(block, blocks - 1)
  below = jnp.where(block > 0, jnp.take_along_axis(
      block_cdf, jnp.maximum(block - 1, 0)[:, None], axis=-1)[:, 0], 0.0)
  tokens = block[:, None] * size + jnp.arange(size, dtype=jnp.int32)  # [B, size]
  inner = jnp.where(tokens < vocab, weight(jnp.take_along_axis(
      values, jnp.minimum(tokens, vocab - 1), axis=-1)), 0.0)  # the block's weights
  offset = jnp.sum(jnp.cumsum(inner, axis=-1) < (target - below[:, None]), axis=-1)
  index = jnp.arange(size, dtype=jnp.int32)
  first = jnp.min(jnp.where(inner > 0, index, size - 1), axis=-1)
  last = jnp.max(jnp.where(inner > 0, index, 0), axis=-1)
  return (block * size + jnp.clip(offset, first, last)).astype(jnp.int32)
