"""Attention arithmetic: which keys each query may see, and softmax(q·kᵀ/√D)·v over them
(grouped-query, the KV cache's key layout, a prefix shared by every row), by one of two paths:
``attend`` (einsums; every case) or ``jax.nn.dot_product_attention`` (``attend_fused``: cuDNN's
fused flash attention on GPU; several query rows, no shared prefix). ``attention_path`` picks
one from ``ModelConfig.attention``; ``transformer.Attention`` projects the heads and calls
``attention``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ppojax.infra.sharding import compile_platform
from ppojax.models import decode_kernel
from ppojax.models.config import DECODE_CHOICES

Array = jax.Array
FUSED_DTYPES = ("bfloat16", "float16")  # the dtypes cuDNN's fused attention takes
FUSED_MAX_HEAD_DIM = 128  # and head dims: a multiple of 8, at most this


def attention_path(choice: str, dtype, head_dim: int, platform: str | None = None) -> str:
  """The attention path of a model with ``ModelConfig.attention`` = ``choice`` on ``platform``
  ("cpu", "cuda" ("gpu"), "rocm", "tpu"; None: ``accelerator_platform()``, this process's
  default backend): "einsum" (``attend``), "xla"
  or "cudnn" (``jax.nn.dot_product_attention``'s implementations). "auto": "cudnn" on an
  NVIDIA GPU for a bfloat16/float16 compute dtype and a head dim that is a multiple of 8 up to
  ``FUSED_MAX_HEAD_DIM``, "einsum" otherwise."""
  platform = accelerator_platform() if platform is None else platform
  fits = jnp.dtype(dtype).name in FUSED_DTYPES and head_dim % 8 == 0 \
      and head_dim <= FUSED_MAX_HEAD_DIM
  on_gpu = platform in ("gpu", "cuda")
  if choice == "auto":
    return "cudnn" if on_gpu and fits else "einsum"
  if choice == "cudnn" and not (on_gpu and fits):
    raise ValueError(
        f"attention='cudnn' needs an NVIDIA GPU (platform is {platform!r}), compute dtype "
        f"bfloat16 or float16 (got {jnp.dtype(dtype).name}) and a head_dim that is a multiple "
        f"of 8 up to {FUSED_MAX_HEAD_DIM} (got {head_dim}): use attention='auto'")
  if choice not in ("einsum", "xla", "cudnn"):
    raise ValueError(f"attention={choice!r}: choose auto, einsum, xla or cudnn")
  return choice


def attention(path: str, q: Array, k: Array, v: Array, slots: tuple[Array, Array], window,
              kv_mask: Array, keys_transposed: bool = False,
              shared: tuple[Array, Array] | None = None, positions: Array | None = None,
              scale_base: float | None = None, softcap: float = 0.0, prefix_window=None,
              aligned: bool | None = None) -> Array:
  """Attention of q [B, T, H, D] at query slots ``slots[0]`` [T] over keys and values at slots
  ``slots[1]`` [S] (k, v, ``keys_transposed``, ``shared``, ``scale_base``, ``softcap``: as
  ``attend``), causal, within ``window``, over real tokens (``kv_mask`` [B, S]) → [B, T, H, D]
  in q's dtype. A ``shared`` prefix's C keys sit at positions 0 … C − 1: a query at
  ``positions`` [B, T] sees those within its window (``prefix_window``, default ``window``: a
  static 0 where no layer slides skips the rule). ``path`` (``attention_path``)
  "xla"/"cudnn" takes ``attend_fused`` where it applies (``fused_applies``), ``attend``
  otherwise. ``aligned``: query t sits at key slot t (a pass without a cache, or a prefill from
  slot 0; default: keys not ``keys_transposed``, i.e. not read from the einsum path's cache)."""
  q_slots, kv_slots = slots
  k, v = k.astype(q.dtype), v.astype(q.dtype)
  scores = dict(scale_base=scale_base, softcap=softcap)
  if not fused_applies(path, q.shape[1], kv_slots.shape[0], shared is not None, softcap):
    allowed = allowed_keys(q_slots, kv_slots, window, kv_mask)
    prefix_window = window if prefix_window is None else prefix_window
    if shared is not None and not (isinstance(prefix_window, int) and prefix_window == 0):
      prefix_positions = jnp.arange(shared[0].shape[-1])  # the window over the prefix's keys
      shared_allowed = (prefix_window == 0) | (
          prefix_positions[None, None, :] > positions[:, :, None] - prefix_window)
      shared = (*shared, shared_allowed)
    return attend(q, k, v, allowed, keys_transposed, shared, **scores)
  allowed = allowed_keys(q_slots, kv_slots, window, kv_mask, see_self=True)
  k = k.transpose(0, 3, 1, 2) if keys_transposed else k.transpose(0, 2, 1, 3)
  aligned = not keys_transposed if aligned is None else aligned
  return attend_fused(q, k, v.transpose(0, 2, 1, 3), allowed, path,
                      aligned=aligned, window=window, scale_base=scale_base)


def decode_path(choice: str, dtype, head_dim: int, platform: str | None = None) -> str:
  """The attention of a decode step (one query per row over the cache) for
  ``ModelConfig.decode_attention`` = ``choice``: "pallas" (``decode_kernel``; off a GPU it runs
  in Pallas's interpreter, for tests) or "einsum" (``attend``). "auto": "pallas" on one NVIDIA
  GPU (not under a mesh of several devices: the kernel is not partitioned) where
  ``decode_kernel.applies``, "einsum" elsewhere. The cache's keys are stored as the path reads
  them (``cache.keys_transposed``)."""
  if choice not in DECODE_CHOICES:
    raise ValueError(f"decode_attention={choice!r}: choose auto, einsum or pallas")
  if choice != "auto":
    return choice
  platform = accelerator_platform() if platform is None else platform
  mesh = jax.sharding.get_abstract_mesh()
  one_device = mesh.empty or mesh.size == 1
  fits = decode_kernel.applies(dtype, head_dim)
  return "pallas" if platform == "cuda" and one_device and fits else "einsum"


def fused_applies(path: str, t: int, s: int, shared: bool, softcap: float = 0.0) -> bool:
  """Whether ``path`` takes ``attend_fused`` for T queries over S keys: "xla"/"cudnn", T > 1
  (a decode step keeps ``attend``), no shared prefix (two key sets), no score soft-cap;
  "cudnn" with a mask also needs T and S even (its backward's condition)."""
  if path == "einsum" or t == 1 or shared or softcap:
    return False
  return path != "cudnn" or (t % 2 == 0 and s % 2 == 0)


def accelerator_platform() -> str:
  """The platform compiled for (``sharding.compile_platform``), a GPU named "cuda" or "rocm"
  (cuDNN is NVIDIA's only)."""
  backend = compile_platform()
  if backend != "gpu":
    return backend
  version = str(getattr(jax.devices()[0].client, "platform_version", ""))
  return "rocm" if "rocm" in version.lower() else "cuda"


def attend_fused(q: Array, k: Array, v: Array, allowed: Array, implementation: str,
                 aligned: bool, window=0, scale_base: float | None = None) -> Array:
  """softmax(q·kᵀ/√D masked by ``allowed`` [B, T, S])·v by ``jax.nn.dot_product_attention``
  (D: ``scale_base`` where given)
  (``implementation`` "xla" or "cudnn"), q [B, T, H, D], k and v [B, S, H_kv, D] → [B, T, H, D].

  ``aligned``: query t sits at key slot t, so ``allowed`` is causal and within ``window`` (a
  Python int there enables the implementation's causal and sliding-window forms; a traced one
  stays in the mask). ``allowed`` should let every query see at least one key (``allowed_keys``'
  ``see_self``): a row with none would depend on the implementation's masked-score constant."""
  static_window = isinstance(window, int) and window > 0
  return jax.nn.dot_product_attention(
      q, k, v, mask=allowed[:, None], is_causal=aligned,
      local_window_size=(window - 1, 0) if aligned and static_window else None,
      scale=None if scale_base is None else 1.0 / math.sqrt(scale_base),
      implementation=implementation)


def attend(q: Array, k: Array, v: Array, allowed: Array, keys_transposed: bool = False,
           shared: tuple[Array, ...] | None = None, scale_base: float | None = None,
           softcap: float = 0.0) -> Array:
  """softmax(s masked by ``allowed`` [B, T, S])·v with scores s = q·kᵀ/√D (D: ``scale_base``
  where given: Gemma's query_pre_attn_scalar), soft-capped to c·tanh(s/c) for ``softcap`` c > 0
  (Gemma 2), grouped-query: q [B,T,H,D], keys k [B,H_kv,S,D] (or [B,H_kv,D,S] with
  ``keys_transposed``: the KV cache's layout), values v [B,H_kv,S,D], with H a multiple of
  H_kv. Scores and softmax in float32.

  ``shared``: keys [H_kv,D,C] and values [H_kv,C,D] that every row and query also sees (a
  shared prefix), and optionally which of them each query may see, [B, T, C] (a sliding
  window; all of them without it); the softmax then runs over the C + S scores
  [q·k_sharedᵀ | q·kᵀ].

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
    shared_allowed = jnp.broadcast_to(
        shared[2] if len(shared) > 2 else True, allowed.shape[:-1] + (shared[0].shape[-1],))
    allowed = jnp.concatenate([shared_allowed, allowed], axis=-1)
  scores = scores.reshape(b, hk, g, t, -1) / math.sqrt(d if scale_base is None else scale_base)
  if softcap:
    scores = softcap * jnp.tanh(scores / softcap)
  scores = jnp.where(allowed[:, None, None], scores, jnp.finfo(jnp.float32).min)
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


def allowed_keys(q_slots: Array, kv_slots: Array, window, kv_mask: Array,
                 see_self: bool = False) -> Array:
  """Bool [B, T, S]: query slot q_slots[t] may see key slot kv_slots[s]: causal over the slots,
  within the sliding ``window`` (0: no window), and a real token (``kv_mask`` [B, S] ≠ 0) — or,
  with ``see_self``, its own slot even where that is padding (a left-padded row's padding then
  sees itself, not nothing; a real token's own slot is real, so its row is unchanged).

  An integer ``kv_mask`` holds segment ids (packed rows, ``models.packing``; a cache-free pass,
  where query t sits at slot t): 0 is padding, and a query sees only keys of its own segment.
  A 0/1 mask is one segment: the same as a bool mask."""
  allowed = kv_slots[None, :] <= q_slots[:, None]  # causal, over cache slots
  allowed &= (window == 0) | (kv_slots[None, :] > q_slots[:, None] - window)  # sliding window
  allowed = allowed[None] & (kv_mask[:, None, :] != 0)
  if jnp.issubdtype(kv_mask.dtype, jnp.integer):  # segment ids: within the query's segment
    allowed &= kv_mask[:, None, :] == jnp.take(kv_mask, q_slots, axis=1)[:, :, None]
  if see_self:
    allowed |= (kv_slots[None, :] == q_slots[:, None])[None]
  return allowed


def check_prefix(prefix, cache) -> None:
  """A cache-free forward pass's ``prefix``: one row [C], no cache."""
  if prefix.ndim != 1:
    raise ValueError(f"prefix must be one row of token ids [C], got shape {prefix.shape}")
  if cache is not None:
    raise ValueError("prefix is for forward passes without a cache; a generation shares a "
                     "prefix through its cache (with_shared_prefix)")
