"""Attention arithmetic: which keys each query may see, and softmax(q·kᵀ/√D)·v over them
(grouped-query, the KV cache's key layout, a prefix shared by every row). ``transformer.Attention``
projects the heads and calls these.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

Array = jax.Array


def attend(q: Array, k: Array, v: Array, allowed: Array, keys_transposed: bool = False,
           shared: tuple[Array, Array] | None = None) -> Array:
  """softmax(q·kᵀ/√D masked by ``allowed`` [B, T, S])·v, grouped-query: q [B,T,H,D], keys k
  [B,H_kv,S,D] (or [B,H_kv,D,S] with ``keys_transposed``: the KV cache's layout), values v
  [B,H_kv,S,D], with H a multiple of H_kv. Scores and softmax in float32.

  ``shared``: keys [H_kv,D,C] and values [H_kv,C,D] that every row and query also sees (a
  shared prefix); the softmax then runs over the C + S scores [q·k_sharedᵀ | q·kᵀ].

  The G = H/H_kv query heads of a group and the T positions are folded into one axis, so both
  products are batched matmuls over (B, H_kv); at T = 1 (decode) every transpose here is a free
  reshape. Without a cache, keys stay [S, D]: the backward's dq = dscores·k is then a plain
  product too.
  """
  b, t, h, d = q.shape
  hk = v.shape[1]
  g = h // hk
  q = q.reshape(b, t, hk, g, d).transpose(0, 2, 3, 1, 4).reshape(b, hk, g * t, d)
  scores = jnp.einsum("bkqd,bkds->bkqs" if keys_transposed else "bkqd,bksd->bkqs", q, k,
                      preferred_element_type=jnp.float32)
  if shared is not None:  # rows folded into the matmul's M: [H_kv, B·G·T, D]·[H_kv, D, C]
    rows = q.transpose(1, 0, 2, 3).reshape(hk, b * g * t, d)
    shared_scores = jnp.einsum("kqd,kdc->kqc", rows, shared[0].astype(q.dtype),
                               preferred_element_type=jnp.float32)
    shared_scores = shared_scores.reshape(hk, b, g * t, -1).transpose(1, 0, 2, 3)
    scores = jnp.concatenate([shared_scores, scores], axis=-1)
    allowed = jnp.concatenate(
        [jnp.ones(allowed.shape[:-1] + (shared[0].shape[-1],), jnp.bool_), allowed], axis=-1)
  scores = scores.reshape(b, hk, g, t, -1)
  scores = jnp.where(allowed[:, None, None], scores / math.sqrt(d), jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(b, hk, g * t, -1)
  size = 0 if shared is None else shared[1].shape[1]  # the shared scores come first
  out = jnp.einsum("bkqs,bksd->bkqd", probs[..., size:], v, preferred_element_type=jnp.float32)
  if shared is not None:  # batch-leading operands: XLA:CPU has no bf16 → f32 dot otherwise
    rows = probs[..., :size].transpose(1, 0, 2, 3).reshape(hk, b * g * t, size)
    shared_out = jnp.einsum("kqc,kcd->kqd", rows, shared[1].astype(v.dtype),
                            preferred_element_type=jnp.float32)
    out += shared_out.reshape(hk, b, g * t, d).transpose(1, 0, 2, 3)
  out = out.astype(v.dtype).reshape(b, hk, g, t, d)
  return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)


def allowed_keys(q_slots: Array, kv_slots: Array, window, kv_mask: Array) -> Array:
  """Bool [B, T, S]: query slot q_slots[t] may see key slot kv_slots[s]: causal over the slots,
  within the sliding ``window`` (0: no window), and a real token (``kv_mask`` [B, S])."""
  allowed = kv_slots[None, :] <= q_slots[:, None]  # causal, over cache slots
  allowed &= (window == 0) | (kv_slots[None, :] > q_slots[:, None] - window)  # sliding window
  return allowed[None] & kv_mask[:, None, :].astype(jnp.bool_)


def cached_prefix(cache, layer, window) -> tuple[Array, Array] | None:
  """The keys [H_kv, D, C] and values [H_kv, C, D] of the cache's shared prefix at ``layer``
  (``with_shared_prefix``), or None without one; it needs unrolled layers and no window."""
  if cache is None or cache.prefix_k is None:
    return None
  if not isinstance(layer, int):
    raise ValueError("a shared prefix needs unrolled layers (scan_layers=False)")
  if window:
    raise ValueError("a shared prefix cannot be used with a sliding attention window: "
                     "prepend it to every prompt instead")
  return cache.prefix_k[layer], cache.prefix_v[layer]


def check_prefix(prefix, cache, windows) -> None:
  """A cache-free forward pass's ``prefix``: one row [C], no cache, no sliding window."""
  if prefix.ndim != 1:
    raise ValueError(f"prefix must be one row of token ids [C], got shape {prefix.shape}")
  if cache is not None:
    raise ValueError("prefix is for forward passes without a cache; a generation shares a "
                     "prefix through its cache (with_shared_prefix)")
  if any(windows):
    raise ValueError("a shared prefix cannot be used with a sliding attention window: prepend "
                     "it to every row instead")
