"""Log-probabilities and entropy from logits, chunked over tokens, in float32.

``selective_log_softmax`` (log π of the sampled tokens) and ``entropy_from_logits`` read logits
[..., T, V] of any float dtype and return float32 [..., T]. Neither holds a second [..., T, V]
float32 array, forward or backward: the float32 upcast lives one chunk of tokens at a time, and
custom VJPs keep only (logits, tokens, logsumexp) as residuals (docs/performance/memory.md).
"""

from __future__ import annotations

import functools
import math

import chex
import jax
import jax.numpy as jnp

from ppojax.infra.sharding import compile_platform, shard_rows

Array = jax.Array

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
  return compile_platform() == "cpu"


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
  so rows sharded over a mesh stay sharded. The barrier keeps the float32 upcast of each chunk
  inside the loop (XLA would otherwise hoist it and convert the whole input up front); see
  ``_bf16_as_bits`` for bf16 on CPU.
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
