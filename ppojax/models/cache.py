"""The KV cache of ``models.transformer``: its layout, a zeroed one, a prefix shared by every row,
position ids of left-padded rows, and the in-place write of a layer's new keys and values.

Keys are stored transposed ([.., D, S]) and values [.., S, D], so that both attention products
of a decode step are plain matmuls; see ``KVCache``. The fused decode kernel
(``decode_kernel``) reads keys [.., S, D] as values: ``keys_transposed`` says which.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ppojax.infra.sharding import shard_rows
from ppojax.models import decode_kernel
from ppojax.models.attention import decode_path
from ppojax.models.config import ModelConfig

Array = jax.Array


class KVCache(NamedTuple):
  """Keys and values, laid out so that both attention products are plain matmuls: keys
  transposed, [L, B, H_kv, D, S], values [L, B, H_kv, S, D] (scanned layers), or tuples of L
  [B, H_kv, D, S] / [B, H_kv, S, D] arrays (unrolled layers, ``scan_layers=False``: each layer
  updates and reads its own buffer, with no slice copied out of a stacked one). With keys stored
  [.., S, D], q·kᵀ contracted both operands' minor axis: XLA:CPU ran that decode product at a
  fifth of the speed of probs·v over the same bytes.

  ``prefix_k`` / ``prefix_v`` (``with_shared_prefix``): the keys and values of C tokens that
  precede every row, one copy for the whole batch, in the layout of ``k`` / ``v``: [L, H_kv, D,
  C] / [L, H_kv, C, D], or tuples of L [H_kv, D, C] / [H_kv, C, D]. Every query attends to all of
  them before its row's slots; their scores are one [B·G·T, D]·[D, C] matmul per KV head instead
  of B matrix-vector products.

  Where a decode step takes the fused kernel (``keys_transposed`` False), keys are stored as the
  values are, [.., S, D] (and the prefix's [.., C, D]): the kernel reads a block of slots' keys
  as one contiguous tile."""

  k: Array | tuple[Array, ...]  # [(L,) B, H_kv, D, S]
  v: Array | tuple[Array, ...]  # [(L,) B, H_kv, S, D]
  prefix_k: Array | tuple[Array, ...] | None = None  # [(L,) H_kv, D, C]
  prefix_v: Array | tuple[Array, ...] | None = None  # [(L,) H_kv, C, D]


def keys_transposed(cfg: ModelConfig) -> bool:
  """Whether the cache stores keys [.., D, S] (the einsum decode step's layout) rather than
  [.., S, D] (the fused kernel's: ``attention.decode_path`` "pallas"), decided at trace time."""
  return decode_path(cfg.decode_attention, cfg.compute_dtype, cfg.head_dim) != "pallas"


def cache_length(cfg: ModelConfig, slots: int) -> int:
  """The slots a cache for ``slots`` tokens gets: as many, or for the fused decode kernel
  (``keys_transposed`` False) rounded up to its ``decode_kernel.SLOT_MULTIPLE`` (the extra slots
  stay empty and masked)."""
  step = 1 if keys_transposed(cfg) else decode_kernel.SLOT_MULTIPLE
  return -(-slots // step) * step


def init_cache(cfg: ModelConfig, batch: int, max_length: int, dtype=None) -> KVCache:
  """A zeroed cache for ``max_length`` slots (prompt + response) per row, laid out for
  ``cfg.scan_layers`` and ``keys_transposed`` (see ``KVCache``)."""
  v_shape = (batch, cfg.num_kv_heads, max_length, cfg.head_dim)
  k_shape = (batch, cfg.num_kv_heads, cfg.head_dim, max_length) if keys_transposed(cfg) \
      else v_shape
  dtype = dtype or cfg.compute_dtype
  # rows over the batch axes, KV heads over "tensor" (traced under a mesh)
  zeros = lambda shape, lead=0: shard_rows(  # noqa: E731
      jnp.zeros(shape, dtype), tensor_dim=lead + 1, row_dim=lead)
  if cfg.scan_layers:
    stacked = lambda shape: zeros((cfg.num_layers,) + shape, lead=1)  # noqa: E731
    return KVCache(stacked(k_shape), stacked(v_shape))
  per_layer = lambda shape: tuple(zeros(shape) for _ in range(cfg.num_layers))  # noqa: E731
  return KVCache(per_layer(k_shape), per_layer(v_shape))


def with_shared_prefix(cache: KVCache, prefix_cache: KVCache) -> KVCache:
  """``cache`` extended by the keys and values of a prefix shared by all of its rows:
  ``prefix_cache`` (the same layer layout) holds them for one row (its C slots all real tokens,
  positions 0 … C − 1, e.g. a prefill of the prefix alone). The rows' own tokens then take
  positions C, C + 1, …, and their slots are numbered from 0 as without a prefix."""
  unrolled = isinstance(cache.k, tuple)
  if unrolled != isinstance(prefix_cache.k, tuple):
    raise ValueError("cache and prefix_cache must have the same layer layout (both stacked, "
                     "scan_layers=True, or both unrolled)")
  rows = prefix_cache.k[0].shape[0] if unrolled else prefix_cache.k.shape[1]
  if rows != 1:
    raise ValueError(f"prefix_cache must hold one row, got {rows}")
  if unrolled:
    return cache._replace(prefix_k=tuple(k[0] for k in prefix_cache.k),
                          prefix_v=tuple(v[0] for v in prefix_cache.v))
  return cache._replace(prefix_k=prefix_cache.k[:, 0], prefix_v=prefix_cache.v[:, 0])


def layer_prefix(cache: KVCache | None, layer, transposed: bool = True
                 ) -> tuple[Array, Array] | None:
  """The shared prefix's keys [H_kv, D, C] and values [H_kv, C, D] at ``layer`` (a Python int
  for unrolled layers, traced in a layer scan), or None without one; ``transposed``: whether
  the cache stores keys [.., D, C] (``keys_transposed``; else they are transposed here)."""
  if cache is None or cache.prefix_k is None:
    return None
  if isinstance(cache.prefix_k, tuple):
    k, v = cache.prefix_k[layer], cache.prefix_v[layer]
  else:
    k, v = (jax.lax.dynamic_index_in_dim(c, layer, 0, keepdims=False)
            for c in (cache.prefix_k, cache.prefix_v))
  return (k if transposed else k.swapaxes(-1, -2)), v


def repeat_rows(cache: KVCache, n: int) -> KVCache:
  """``cache`` with each row's keys and values repeated n times, [B·n, ...] (row i's copies at
  i·n … i·n + n − 1), rows over the mesh's batch axes and KV heads over "tensor"; the shared
  prefix is one copy for all rows and stays as it is."""
  lead = 0 if isinstance(cache.k, tuple) else 1  # the layer axis of stacked buffers

  def repeat(x):
    return shard_rows(jnp.repeat(x, n, axis=lead), tensor_dim=lead + 1, row_dim=lead)
  return cache._replace(k=jax.tree.map(repeat, cache.k), v=jax.tree.map(repeat, cache.v))


def positions_from_mask(mask: Array) -> Array:
  """Position ids of left-padded rows: p_t = (Σ_{s ≤ t} m_s) − 1, clipped at 0."""
  return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)



def update_cache(cache: KVCache, layer, cache_index, k_t: Array, v: Array,
                 transposed: bool = True):
  """Write this layer's new keys k_t [B, H_kv, D, T] (``transposed``, else [B, H_kv, T, D]) and
  values v [B, H_kv, T, D] at slot ``cache_index``; return the updated cache and the layer's
  full keys and values."""
  v_start = (0, 0, cache_index, 0)
  k_start = (0, 0, 0, cache_index) if transposed else v_start
  if isinstance(cache.k, tuple):  # per-layer buffers; ``layer`` is a Python int here
    def write(buffers, new, start):
      buffers = list(buffers)
      buffers[layer] = jax.lax.dynamic_update_slice(
          buffers[layer], new.astype(buffers[layer].dtype), start)
      return tuple(buffers)
    cache = cache._replace(k=write(cache.k, k_t, k_start), v=write(cache.v, v, v_start))
    return cache, cache.k[layer], cache.v[layer]
  cache = cache._replace(**{
      name: jax.lax.dynamic_update_slice(c, new[None].astype(c.dtype), (layer,) + start)
      for name, c, new, start in zip(("k", "v"), cache[:2], (k_t, v), (k_start, v_start))})
  k_t, v = (jax.lax.dynamic_index_in_dim(c, layer, 0, keepdims=False) for c in cache[:2])
  return cache, k_t, v


def fills_from_start(cache_index) -> bool:
  """Whether ``cache_index`` is statically 0 (a Python int: unrolled layers): the new tokens
  then attend only to each other, so a prefill reads none of the cache's other slots (with
  45-token prompts and 64 new tokens it read 108 slots for 45 keys)."""
  return isinstance(cache_index, int) and cache_index == 0
