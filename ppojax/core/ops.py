"""Array primitives shared by every part of the PPO step: masked statistics and aggregations,
response masks from stop tokens (log-probs and entropy from logits: ``core/logprobs.py``).

Conventions (see DESIGN.md):
  * arrays are shaped ``[batch, time]``;
  * a ``mask`` is boolean or {0, 1}; masked-out positions contribute *nothing*: values there are
    never read arithmetically (``jnp.where``, not ``x * mask``), so even NaN/Inf padding is inert;
  * response masks come from the position of the first stop token, never from ``token != pad_id``.
"""

from __future__ import annotations

from typing import Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

# ---------------------------------------------------------------------------------------------
# Masked statistics
# ---------------------------------------------------------------------------------------------


def _as_bool(mask: Array) -> Array:
  return mask if mask.dtype == jnp.bool_ else mask != 0


def masked_sum(x: Array, mask: Array, axis=None) -> Array:
  """Σ_i x_i·m_i, with masked-out entries never read (NaN-safe)."""
  chex.assert_equal_shape([x, mask])
  return jnp.sum(jnp.where(_as_bool(mask), x, 0), axis=axis)


def masked_count(mask: Array, axis=None) -> Array:
  """Number of unmasked entries, as float32."""
  return jnp.sum(_as_bool(mask), axis=axis, dtype=jnp.float32)


def masked_mean(x: Array, mask: Array, axis=None) -> Array:
  """mean_m(x) = Σ x·m / Σ m.

  An empty mask gives 0 (not NaN), so an all-padding row cannot poison a batch statistic.
  """
  count = masked_count(mask, axis)
  return masked_sum(x, mask, axis) / jnp.maximum(count, 1.0)


def masked_var(x: Array, mask: Array, unbiased: bool = True) -> Array:
  """Variance over the unmasked entries (all axes).

  var = mean_m((x − mean_m(x))²) · n/(n−1) if ``unbiased`` (Bessel's correction, as trl's
  ``masked_var``), with n = Σ m. For n ≤ 1 the correction factor is taken as 1 (trl raises; we
  cannot raise under ``jit``).
  """
  x = jnp.where(_as_bool(mask), x, 0)  # masked entries must not reach any gradient path either
  mean = masked_mean(x, mask)
  var = masked_mean(jnp.square(x - mean), mask)
  if unbiased:
    n = masked_count(mask)
    var = var * jnp.where(n > 1, n / jnp.maximum(n - 1, 1.0), 1.0)
  return var


def masked_whiten(x: Array, mask: Array, shift_mean: bool = True, eps: float = 1e-8) -> Array:
  """(x − μ)/√(σ² + eps) over the mask, with μ, σ² = ``masked_mean``, unbiased ``masked_var``.

  With ``shift_mean=False`` the mean is added back: x ↦ (x − μ)/σ + μ (trl's reward whitening).
  Masked-out positions of the result are 0.
  """
  x = jnp.where(_as_bool(mask), x, 0)
  mean = masked_mean(x, mask)
  var = masked_var(x, mask, unbiased=True)
  white = (x - mean) * jax.lax.rsqrt(var + eps)
  if not shift_mean:
    white = white + mean
  return jnp.where(_as_bool(mask), white, 0)


AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "seq_mean")
SEQ_AGGREGATIONS = ("seq_mean_token_mean", "seq_mean_token_sum_norm", "seq_mean")


def aggregate(x: Array, mask: Array, mode: str = "token_mean", max_len: float | None = None
              ) -> Array:
  """Reduce per-token values ``x`` [B, T] over ``mask`` to a scalar; with B' the non-empty rows:

  * ``token_mean``: Σ_{b,t} x·m / Σ_{b,t} m — every token weighs the same (trl's PPO; DAPO,
    Yu et al. 2025, "token-level policy gradient loss").
  * ``seq_mean_token_mean`` (alias ``seq_mean``): (1/|B'|)·Σ_{b∈B'} (Σ_t x·m / Σ_t m) — every
    sequence weighs the same, whatever its length (GRPO's original, Shao et al. 2024).
  * ``seq_mean_token_sum_norm``: (1/|B'|)·Σ_{b∈B'} (Σ_t x·m) / C with the constant C =
    ``max_len`` (Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-like training": no
    1/|o_i|, so long and short responses are not weighted apart). C must stay the same all
    training long (the maximum response length), so it is passed explicitly, never taken from T.

  An empty mask gives 0. ``max_len`` is read by ``seq_mean_token_sum_norm`` only.
  """
  chex.assert_rank(x, 2)
  chex.assert_equal_shape([x, mask])
  if mode == "token_mean":
    return masked_mean(x, mask)
  if mode in SEQ_AGGREGATIONS:
    row_nonempty = jnp.any(_as_bool(mask), axis=1)
    if mode == "seq_mean_token_sum_norm":
      _check_max_len(max_len)
      per_row = masked_sum(x, mask, axis=1) / max_len
    else:
      per_row = masked_mean(x, mask, axis=1)
    return masked_mean(per_row, row_nonempty)
  raise ValueError(f"unknown aggregation {mode!r}; choose one of {AGGREGATIONS}")


def _check_max_len(max_len) -> None:
  if max_len is None:
    raise ValueError(
        "aggregation 'seq_mean_token_sum_norm' divides each sequence's token sum by a constant: "
        "pass max_len (the maximum response length, e.g. sampling.max_new_tokens)")
  if isinstance(max_len, (int, float, np.integer, np.floating)) and not max_len > 0:
    raise ValueError(f"max_len={max_len!r} must be > 0 (the maximum response length)")


def aggregation_count(mask: Array, mode: str = "token_mean") -> Array:
  """The units ``aggregate`` averages over: tokens Σ m (``token_mean``) or non-empty rows |B'|
  (the sequence modes), as float32. For a split of the rows into parts k,

      aggregate(x, m, mode) = Σ_k  count(m_k)/count(m) · aggregate(x_k, m_k, mode)

  (count(m) > 0): the weight of a micro-batch's loss in gradient accumulation."""
  if mode == "token_mean":
    return masked_count(mask)
  if mode in SEQ_AGGREGATIONS:
    return masked_count(jnp.any(_as_bool(mask), axis=-1))
  raise ValueError(f"unknown aggregation {mode!r}; choose one of {AGGREGATIONS}")


# ---------------------------------------------------------------------------------------------
# Response masks from stop tokens
# ---------------------------------------------------------------------------------------------


def is_stop_token(tokens: Array, stop_ids: Sequence[int] | Array) -> Array:
  """Boolean [B, T]: whether each token is one of ``stop_ids``."""
  stop_ids = jnp.asarray(stop_ids, dtype=tokens.dtype).reshape(-1)
  return jnp.any(tokens[..., None] == stop_ids, axis=-1)


def response_mask(tokens: Array, stop_ids: Sequence[int] | Array) -> Array:
  """Mask of the response: every position up to **and including** the first stop token.

  m_t = 1 iff no stop token occurs at positions < t. Everything after the first stop is padding,
  whatever its id — so pad_id == eos_id is safe: the EOS that ends the response is an action and
  stays inside the mask, the identical pad ids after it do not. A row without any stop token is
  all response (it hit the length limit).

  Args:
    tokens: [B, T] sampled response tokens.
    stop_ids: one or more stop token ids (EOS, end-of-turn, ...).

  Returns:
    bool [B, T].
  """
  chex.assert_rank(tokens, 2)
  stop = is_stop_token(tokens, stop_ids).astype(jnp.int32)
  stops_before = jnp.cumsum(stop, axis=1) - stop  # exclusive cumulative count
  return stops_before == 0


def has_stop_token(tokens: Array, stop_ids: Sequence[int] | Array) -> Array:
  """Boolean [B]: whether the response contains a stop token (False = cut off by the limit)."""
  chex.assert_rank(tokens, 2)
  return jnp.any(is_stop_token(tokens, stop_ids), axis=1)


def truncate_after_stop(tokens: Array, stop_ids: Sequence[int] | Array, pad_id: int) -> Array:
  """Replace every token after the first stop token with ``pad_id`` (the stop token stays)."""
  return jnp.where(response_mask(tokens, stop_ids), tokens, jnp.asarray(pad_id, tokens.dtype))


def last_index(mask: Array) -> Array:
  """Int32 [B]: the last position where ``mask`` is set (−1 for an empty row)."""
  chex.assert_rank(mask, 2)
  pos = jnp.arange(mask.shape[1], dtype=jnp.int32)
  return jnp.max(jnp.where(_as_bool(mask), pos, -1), axis=1)


def last_token_mask(mask: Array) -> Array:
  """Boolean [B, T], True only at the last position of each row's mask (the episode's end)."""
  pos = jnp.arange(mask.shape[1], dtype=jnp.int32)
  return pos[None, :] == last_index(mask)[:, None]


def gather_last(x: Array, mask: Array) -> Array:
  """x[b, last_index(mask)[b]] for each row: e.g. a reward model's score at the last response
  token. [B, T] → [B]; 0 for an empty row."""
  chex.assert_equal_shape([x, mask])
  idx = last_index(mask)
  picked = jnp.take_along_axis(x, jnp.maximum(idx, 0)[:, None], axis=1)[:, 0]
  return jnp.where(idx >= 0, picked, 0)
