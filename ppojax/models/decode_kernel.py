"""A decode step's attention as one fused kernel (Pallas, Triton on NVIDIA GPUs): each query's
scores, softmax and probabilities·values in registers, over the blocks of slots that hold the
row's visible tokens only, with no [B, H, S] score or probability array written to memory.

The einsum path (``attention.attend``) writes the float32 scores of every slot, masks, takes
their softmax and writes the probabilities before the second product: at Qwen2.5-0.5B's decode
shape (256 rows, 639 slots) XLA:GPU wrote 220 MB of scores and 110 MB of probabilities per
step, and read every slot although a row's tokens fill 384 of them on average.

Layout: keys and values [B, H_kv, S, D] (``ModelConfig.decode_attention`` "pallas" stores the
cache's keys so, ``cache.keys_transposed``). Each program takes one row, one KV head and one
split of the slots; its G = H/H_kv query heads are one [G, D] block (padded to 16 rows, the
smallest Triton product), kept in registers while it walks its blocks of ``block_k`` slots with
the online softmax:

    m' = max(m, max_j s_j),  l' = e^(m − m')·l + Σ_j p_j,  o' = e^(m − m')·o + Σ_j p_j·v_j,
    s_j = q·k_jᵀ/√D' (c·tanh(s/c) with a soft-cap c), p_j = e^(s_j − m') where slot j is
    visible, 0 elsewhere

then the splits are joined: m* = max_i m_i, out = Σ_i e^(m_i − m*)·o_i / Σ_i e^(m_i − m*)·l_i.
A program reads only the blocks between the row's first and last visible slot (left padding
and the slots not yet written are skipped whole); holes inside (a multi-turn row's unused turn
slots) are masked by ``visible``. A row that sees no slot gets zeros (the einsum path: the mean
of all values; either is garbage, and such rows are padding).

Written by hand: Pallas's own ``ops.gpu.decode_attention.gqa`` takes the cache [B, S, H_kv, D]
and transposes it to this layout on every call (a copy of the whole cache per layer per step),
and takes one [start, end) range per row (no holes, no sliding window, no soft-cap).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

Array = jax.Array
MIN_ROWS = 16  # Triton's smallest product: the [G, D] query block is padded to it
SLOT_MULTIPLE = 16  # the smallest block of slots: a cache's length must be a multiple of it
TARGET_PROGRAMS = 264  # B·H_kv·splits to aim for: two per SM of an H100 (132 SMs)
_NEG = float(jnp.finfo(jnp.float32).min)


def blocking(batch: int, kv_heads: int, slots: int, max_block: int = 128) -> tuple[int, int]:
  """(block_k, splits): the largest power of two ≤ ``max_block`` (and ≥ 16) dividing ``slots``,
  and how many splits of the slots each (row, KV head) gets: the fewest that give
  ``TARGET_PROGRAMS`` programs, among those dividing the number of blocks. Raises ValueError
  when ``slots`` is not a multiple of 16."""
  block = next((b for b in (128, 64, 32, 16) if b <= max_block and slots % b == 0), None)
  if block is None:
    raise ValueError(f"the fused decode attention needs a cache length that is a multiple of 16, "
                     f"got {slots}: use decode_attention='einsum'")
  blocks = slots // block
  want = -(-TARGET_PROGRAMS // (batch * kv_heads))
  splits = next((n for n in range(min(want, blocks), blocks + 1) if blocks % n == 0), blocks)
  return block, splits


def applies(dtype, head_dim: int) -> bool:
  """Whether the kernel takes a model: a 16-bit compute dtype (Triton's bf16/fp16 products;
  float32 would run as TF32 there) and a power-of-two head dim of at least 16 (a Triton block
  dimension). Its cache's length must be a multiple of ``SLOT_MULTIPLE``
  (``cache.cache_length``)."""
  return (jnp.dtype(dtype).name in ("bfloat16", "float16") and head_dim >= 16
          and head_dim & (head_dim - 1) == 0)


def decode_attention(q: Array, k: Array, v: Array, visible: Array, scale_base: float | None = None,
                     softcap: float = 0.0, interpret: bool = False) -> Array:
  """softmax(q·kᵀ/√D' over the ``visible`` slots)·v for one query per row: q [B, H, D], keys
  and values [B, H_kv, S, D], ``visible`` [B, S] (bool: the causal, window and padding masks
  joined) → [B, H, D] in q's dtype. D' is ``scale_base`` where given, else D; ``softcap`` c > 0
  caps scores to c·tanh(s/c). ``interpret``: Pallas's interpreter (any back end; tests)."""
  b, h, d = q.shape
  _, hk, s, _ = k.shape
  block_k, splits = blocking(b, hk, s)
  g = h // hk
  lo = jnp.argmax(visible, axis=-1).astype(jnp.int32)  # the first visible slot
  hi = (s - jnp.argmax(visible[:, ::-1], axis=-1)).astype(jnp.int32)  # the last one + 1
  hi = jnp.where(visible.any(axis=-1), hi, 0)  # none visible: no block read
  one = functools.partial(_one_head, scale=1.0 / math.sqrt(d if scale_base is None else scale_base),
                          softcap=softcap, block_k=block_k, splits=splits, interpret=interpret)
  per_head = jax.vmap(one, in_axes=(0, 0, 0, None, None, None))  # over KV heads
  o, l, m = jax.vmap(per_head)(q.reshape(b, hk, g, d), k, v, visible.astype(jnp.int32), lo, hi)
  return _join(o, l, m).reshape(b, h, d).astype(q.dtype)


def _join(o: Array, l: Array, m: Array) -> Array:
  """The splits' partial results o [.., n, G, D], l and m [.., n, G] joined: Σ e^(m_i − m*)·o_i
  / Σ e^(m_i − m*)·l_i, zeros where no slot was seen (l = 0)."""
  weight = jnp.exp(m - m.max(axis=-2, keepdims=True))
  total = (weight * l).sum(axis=-2)
  out = (weight[..., None] * o).sum(axis=-3)
  return jnp.where(total[..., None] > 0, out / jnp.where(total > 0, total, 1.0)[..., None], 0.0)


def _pallas():
  """Pallas and its Triton ops, imported where a kernel is traced (a quarter of a second that
  every other program would pay at start-up)."""
  from jax.experimental import pallas as pl  # pylint: disable=import-outside-toplevel
  from jax.experimental.pallas import triton as plgpu  # pylint: disable=import-outside-toplevel
  return pl, plgpu


def _one_head(q, k, v, visible, lo, hi, *, scale, softcap, block_k, splits, interpret):
  """One row's one KV head: q [G, D], k and v [S, D], visible [S], the visible range [lo, hi)
  → per split: o [n, G, D] (unnormalised), l and m [n, G], float32."""
  pl, plgpu = _pallas()
  g, d = q.shape
  split = k.shape[0] // splits
  rows = max(MIN_ROWS, 1 << (g - 1).bit_length())
  kernel = functools.partial(_kernel, scale=scale, softcap=softcap, block_k=block_k,
                             groups=g, rows=rows)
  scalar = pl.BlockSpec((), lambda j: ())
  return pl.pallas_call(
      kernel, grid=(splits,),
      in_specs=[pl.BlockSpec((rows, d), lambda j: (0, 0)),
                pl.BlockSpec((None, split, d), lambda j: (j, 0, 0)),
                pl.BlockSpec((None, split, d), lambda j: (j, 0, 0)),
                pl.BlockSpec((None, split), lambda j: (j, 0)), scalar, scalar],
      out_specs=[pl.BlockSpec((None, rows, d), lambda j: (j, 0, 0)),
                 pl.BlockSpec((None, rows), lambda j: (j, 0)),
                 pl.BlockSpec((None, rows), lambda j: (j, 0))],
      out_shape=[jax.ShapeDtypeStruct((splits, g, d), jnp.float32),
                 jax.ShapeDtypeStruct((splits, g), jnp.float32),
                 jax.ShapeDtypeStruct((splits, g), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret, name="ppojax_decode_attention",
  )(q, k.reshape(splits, split, d), v.reshape(splits, split, d),
    visible.reshape(splits, split), lo, hi)


def _kernel(q_ref, k_ref, v_ref, visible_ref, lo_ref, hi_ref, o_ref, l_ref, m_ref, *, scale,
            softcap, block_k, groups, rows):
  """One split's online softmax over its blocks that overlap [lo, hi) (module docstring)."""
  pl, plgpu = _pallas()
  split = k_ref.shape[0]
  start = pl.program_id(0) * split
  head_ok = jnp.arange(rows) < groups
  q = plgpu.load(q_ref.at[pl.ds(0, rows), :], mask=head_ok[:, None], other=0.0)
  first = jnp.maximum(lo_ref[()] - start, 0) // block_k
  last = pl.cdiv(jnp.clip(hi_ref[()] - start, 0, split), block_k)

  def block(i, carry):
    o, l, m = carry
    slots = pl.ds(i * block_k, block_k)
    scores = plgpu.dot(q, k_ref[slots, :].T).astype(jnp.float32) * scale  # [rows, block_k]
    if softcap:
      scores = softcap * jnp.tanh(scores / softcap)
    seen = (visible_ref[slots] != 0)[None, :]
    scores = jnp.where(seen, scores, _NEG)
    m_new = jnp.maximum(m, scores.max(axis=-1))
    p = jnp.where(seen, jnp.exp(scores - m_new[:, None]), 0.0)
    correction = jnp.exp(m - m_new)
    v = v_ref[slots, :]
    o = correction[:, None] * o + plgpu.dot(p.astype(v.dtype), v).astype(jnp.float32)
    return o, correction * l + p.sum(axis=-1), m_new

  init = (jnp.zeros((rows, q.shape[-1]), jnp.float32), jnp.zeros((rows,), jnp.float32),
          jnp.full((rows,), _NEG, jnp.float32))
  o, l, m = jax.lax.fori_loop(first, last, block, init)
  plgpu.store(o_ref.at[pl.ds(0, rows), :], o, mask=head_ok[:, None])
  plgpu.store(l_ref.at[pl.ds(0, rows)], l, mask=head_ok)
  plgpu.store(m_ref.at[pl.ds(0, rows)], m, mask=head_ok)
