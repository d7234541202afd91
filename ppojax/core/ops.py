"""Array primitives shared by every part of the PPO step.

Conventions (see DESIGN.md):
  * arrays are shaped ``[batch, time]`` (plus ``vocab`` for logits);
  * a ``mask`` is boolean or {0, 1}; masked-out positions contribute *nothing*: values there are
    never read arithmetically (``jnp.where``, not ``x * mask``), so even NaN/Inf padding is inert;
  * response masks come from the position of the first stop token, never from ``token != pad_id``.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np

from ppojax.infra.sharding import shard_rows

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
# Log-probabilities and entropy from logits, chunked over tokens
# ---------------------------------------------------------------------------------------------

DEFAULT_CHUNK = 1024  # tokens per chunk: [chunk, V] float32 is 192 MiB for V = 49152


def _chunk_size(n: int, target: int) -> int:
  """Largest divisor of ``n`` that is ≤ ``target`` (so chunking needs no padding copy)."""
  target = max(1, min(n, target))
  for c in range(target, 0, -1):
    if n % c == 0:
      return c
  return 1


def _rows(lead: tuple[int, ...]) -> tuple[int, int]:
  """[..., T] as [R, T]: the leading axes merged into rows (a row-major reshape: free)."""
  return (math.prod(lead[:-1]), lead[-1]) if lead else (1, 1)


def _bf16_as_bits() -> bool:
  # XLA's CPU backend has no native bf16 loops: it rewrites a bf16 loop carry to f32 and upcasts
  # the whole input before the loop. Carrying the uint16 bit pattern instead costs one bf16-sized
  # copy there, never an f32 one. Other backends handle bf16 natively and need no trick. The
  # platform is the mesh's the step is traced under (a TPU topology compiled on a CPU host:
  # ``ppojax.run.aot``), else the default backend's.
  mesh = jax.sharding.get_abstract_mesh()
  device = None if mesh.empty else getattr(mesh, "abstract_device", None)
  platform = getattr(device, "platform", None) or jax.default_backend()
  return platform == "cpu"


def _to_bits(a: Array) -> Array:
  if a.dtype == jnp.bfloat16 and _bf16_as_bits():
    return jax.lax.bitcast_convert_type(a, jnp.uint16)
  return a


def _from_bits(a: Array, dtype) -> Array:
  if dtype == jnp.bfloat16 and a.dtype == jnp.uint16:
    return jax.lax.bitcast_convert_type(a, jnp.bfloat16)
  return a


def _map_chunks(fn, arrays, chunk: int):
  """Apply ``fn`` to consecutive time-chunks of ``arrays`` (each [R, T, ...]: R rows of T
  tokens), about ``chunk`` tokens (all rows together) at a time.

  Each step slices [R, c, ...] out of the inputs and writes ``fn``'s outputs into buffers of the
  full size (``dynamic_update_slice`` in a ``fori_loop``: in place), so no input is copied and
  only one chunk's float32 temporaries are alive at a time. The rows stay whole in every chunk,
  so rows sharded over a mesh stay sharded (chunking the flattened rows·tokens axis instead made
  XLA gather the whole batch's logits on every device). The barrier keeps the float32 upcast of
  each chunk inside the loop (XLA would otherwise hoist it and convert the whole input up front:
  the very copy chunking exists to avoid); see ``_bf16_as_bits`` for bf16 on CPU.
  """
  rows, t = arrays[0].shape[:2]
  c = _chunk_size(t, max(1, chunk // max(rows, 1)))
  if c == t:
    return fn(*arrays)
  dtypes = [a.dtype for a in arrays]
  bits = [_to_bits(a) for a in arrays]

  def one(start, xs):
    xs = jax.lax.optimization_barrier(xs)
    return fn(*[_from_bits(x, d) for x, d in zip(xs, dtypes)])

  def sliced(start, arrays):
    return [jax.lax.dynamic_slice_in_dim(a, start, c, axis=1) for a in arrays]

  shapes = jax.eval_shape(lambda: one(0, sliced(0, bits)))
  leaves, tree = jax.tree.flatten(shapes)
  outs = [shard_rows(jnp.zeros((rows, t) + o.shape[2:], _to_bits(jnp.zeros((), o.dtype)).dtype))
          for o in leaves]

  def body(i, outs):
    start = i * c
    new = jax.tree.leaves(one(start, sliced(start, bits)))
    return [jax.lax.dynamic_update_slice_in_dim(o, _to_bits(n), start, axis=1)
            for o, n in zip(outs, new)]

  outs = jax.lax.fori_loop(0, t // c, body, outs)
  return jax.tree.unflatten(tree, [_from_bits(o, s.dtype) for o, s in zip(outs, leaves)])


def _scaled(logits: Array, temperature) -> Array:
  return logits.astype(jnp.float32) / temperature


def _log_softmax(z: Array, lse: Array) -> Array:
  return z - lse[..., None]


def _temperature_cotangent(d_z: Array, logp: Array, temperature: Array) -> Array:
  """∂/∂T per row, given ∂/∂z for z = logits/T: −Σ_v ∂z_v·z_v/T.

  Σ_v ∂z_v = 0 for both kernels, so z may be replaced by the better-conditioned log p = z − lse.
  Entries with p = 0 (logits of −inf, e.g. from top-k masking) contribute 0, not NaN.
  """
  return -jnp.sum(jnp.where(d_z != 0, d_z * logp, 0.0), axis=-1) / temperature


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _token_logprobs(logits: Array, tokens: Array, temperature: Array, chunk: int):
  out, _ = _token_logprobs_fwd(logits, tokens, temperature, chunk)
  return out


def _token_logprobs_fwd(logits, tokens, temperature, chunk):
  def fn(z, tok):
    z = _scaled(z, temperature)
    lse = jax.nn.logsumexp(z, axis=-1)
    picked = jnp.take_along_axis(z, tok[..., None], axis=-1)[..., 0]
    return picked - lse, lse

  logp, lse = _map_chunks(fn, [logits, tokens], chunk)
  return logp, (logits, tokens, temperature, lse)


def _token_logprobs_bwd(chunk, res, g):
  logits, tokens, temperature, lse = res

  def fn(z, tok, lse_c, g_c):
    logp = _log_softmax(_scaled(z, temperature), lse_c)
    onehot = jax.nn.one_hot(tok, z.shape[-1], dtype=jnp.float32)
    d_z = g_c[..., None] * (onehot - jnp.exp(logp))  # ∂ log p_tok / ∂z = onehot − p
    d_t = _temperature_cotangent(d_z, logp, temperature)
    return (d_z / temperature).astype(logits.dtype), d_t  # ∂/∂logits = ∂/∂z / T

  d_logits, d_t = _map_chunks(fn, [logits, tokens, lse, g], chunk)
  return d_logits, None, jnp.sum(d_t).astype(temperature.dtype)


_token_logprobs.defvjp(_token_logprobs_fwd, _token_logprobs_bwd)


@functools.partial(jax.jit, static_argnames=("chunk_size",))
def selective_log_softmax(
    logits: Array,
    tokens: Array,
    temperature: float | Array = 1.0,
    chunk_size: int = DEFAULT_CHUNK,
) -> Array:
  """log π(token) = z_token − logsumexp(z), with z = logits / temperature, in float32.

  Args:
    logits: [..., T, V], any float dtype (bf16 is upcast chunk by chunk).
    tokens: [..., T] integer ids.
    temperature: the sampling temperature; the log-probs used in the PPO ratio must come from the
      same temperature-scaled distribution that sampled the tokens.
    chunk_size: tokens (flattened batch×time positions) per chunk.

  Returns:
    float32 [..., T].

  Memory: no second [..., T, V] float32 array exists, forward or backward: the float32 copy lives
  one chunk at a time, and a custom VJP keeps only (logits, tokens, lse) as residuals and writes
  the gradient ∂/∂z = (onehot − softmax)/temperature chunk by chunk in the logits' dtype.
  """
  chex.assert_equal_shape_prefix([logits, tokens], tokens.ndim)
  chex.assert_rank(logits, tokens.ndim + 1)
  lead, vocab = tokens.shape, logits.shape[-1]
  temperature = jnp.asarray(temperature, jnp.float32)
  rows = _rows(lead)
  out = _token_logprobs(logits.reshape(rows + (vocab,)), tokens.reshape(rows), temperature,
                        chunk_size)
  return out.reshape(lead)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _entropy(logits: Array, temperature: Array, chunk: int):
  out, _ = _entropy_fwd(logits, temperature, chunk)
  return out


def _entropy_fwd(logits, temperature, chunk):
  def fn(z):
    z = _scaled(z, temperature)
    lse = jax.nn.logsumexp(z, axis=-1)
    logp = _log_softmax(z, lse)
    p = jnp.exp(logp)
    # −Σ p·log p rather than lse − Σ p·z: the latter cancels catastrophically for large logits.
    ent = -jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=-1)
    return ent, lse

  ent, lse = _map_chunks(fn, [logits], chunk)
  return ent, (logits, temperature, lse, ent)


def _entropy_bwd(chunk, res, g):
  logits, temperature, lse, ent = res

  def fn(z, lse_c, ent_c, g_c):
    logp = _log_softmax(_scaled(z, temperature), lse_c)
    p = jnp.exp(logp)
    # ∂H/∂z_i = −p_i (z_i − E_p[z]) = −p_i (log p_i + H)
    d_z = jnp.where(p > 0, -g_c[..., None] * p * (logp + ent_c[..., None]), 0.0)
    d_t = _temperature_cotangent(d_z, logp, temperature)
    return (d_z / temperature).astype(logits.dtype), d_t

  d_logits, d_t = _map_chunks(fn, [logits, lse, ent, g], chunk)
  return d_logits, jnp.sum(d_t).astype(temperature.dtype)


_entropy.defvjp(_entropy_fwd, _entropy_bwd)


@functools.partial(jax.jit, static_argnames=("chunk_size",))
def entropy_from_logits(
    logits: Array, temperature: float | Array = 1.0, chunk_size: int = DEFAULT_CHUNK
) -> Array:
  """H(π) = −Σ_v π_v·log π_v, π = softmax(logits / temperature), in float32.

  Same memory behaviour as ``selective_log_softmax``: [..., T, V] in, float32 [..., T] out.
  Vocabulary entries with logit −inf (masked out) contribute 0.
  """
  lead, vocab = logits.shape[:-1], logits.shape[-1]
  temperature = jnp.asarray(temperature, jnp.float32)
  return _entropy(logits.reshape(_rows(lead) + (vocab,)), temperature, chunk_size).reshape(lead)


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
