"""Rotary position embeddings in the rotate-half layout, as Hugging Face's Llama: the
frequencies (default, "linear" and "llama3" scaling), the cos/sin tables a forward pass
computes once and hands to every layer, and their application to queries and keys.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from ppojax.models.config import ModelConfig

Array = jax.Array


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> np.ndarray:
  """θ_i = base^(−2i/D), rescaled for "linear" (θ/f) or "llama3" (per-wavelength) scaling;
  ``local``: the sliding-window layers' own base and scaling (``cfg.local_rope_theta``)."""
  d = cfg.head_dim
  theta, scaling = ((cfg.local_rope_theta, cfg.local_rope_scaling) if local
                    else (cfg.rope_theta, cfg.rope_scaling))
  inv = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
  params = dict(scaling or ())
  rope_type = params.get("rope_type", "default")
  if rope_type == "linear":
    inv = inv / params["factor"]
  elif rope_type == "llama3":
    factor, lo, hi = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old_len / lo, inv / factor, inv)  # long waves: slowed by factor
    smooth = (old_len / wavelen - lo) / (hi - lo)
    medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    inv = np.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
  return inv.astype(np.float32)


ROPE_TABLE_MAX = 1 << 20  # entries of one cos or sin table (4 MB in float32)


def rope_table(positions: Array, inv_freq: np.ndarray, size: int | None = None
               ) -> tuple[Array, Array]:
  """cos(pθ) and sin(pθ) [B, T, 1, D] in float32 for positions [B, T], θ repeated over both
  halves of the head (rotate-half layout). Computed once per forward pass and passed to every
  layer: with scanned layers a loop invariant, not work in every layer's body, forward and
  backward.

  ``size``: a static bound on the positions (0 ≤ p < size, as in a KV cache of ``size`` slots).
  The values then come from a [size, D] table made in NumPy (angles pθ rounded to float32 as
  below, cosine and sine in float64, then rounded) and are gathered by position. Computed in
  the graph instead, XLA:CPU fuses cos and sin into every consumer and evaluates them again per
  head in each layer's q and k fusions (unrolled layers: about a tenth of a batch-64 prefill);
  a gather fuses as one indexed load. A position outside the table reads NaN, never a clamped row.
  Tables of more than ``ROPE_TABLE_MAX`` entries (very long caches) are not embedded in the
  program: those are computed.
  """
  if size is None or size * inv_freq.size * 2 > ROPE_TABLE_MAX:
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    return jnp.cos(angles), jnp.sin(angles)
  angles = np.arange(size, dtype=np.float32)[:, None] * inv_freq  # float32 products, as above
  angles = np.concatenate([angles, angles], axis=-1).astype(np.float64)
  gather = lambda table: jnp.take(  # noqa: E731
      jnp.asarray(table.astype(np.float32)), positions, axis=0, mode="fill",
      fill_value=np.nan)[:, :, None, :]
  return gather(np.cos(angles)), gather(np.sin(angles))


def model_rope(cfg: ModelConfig, positions: Array, size: int | None = None):
  """``rope_table`` for this model's frequencies: (cos, sin); None for learned positions
  (GPT-2). Where layers differ in their RoPE (``cfg.rope_per_layer``: Gemma 3's local and
  global bases, SmolLM3's layers without RoPE), a pair of tables, (the model's, the sliding
  layers'), either None where no layer uses it; ``layer_rope`` picks a layer's."""
  if cfg.positions != "rope":
    return None
  if not cfg.rope_per_layer:
    return rope_table(positions, rope_inv_freq(cfg), size)
  used = set(cfg.layer_ropes)
  return tuple(rope_table(positions, rope_inv_freq(cfg, local=kind == 1), size)
               if kind in used else None for kind in (0, 1))


def stack_ropes(cfg: ModelConfig, ropes) -> tuple[tuple[Array, Array], Array]:
  """For a layer scan: ``model_rope``'s tables stacked [K, B, T, 1, D] (an identity table,
  cos 1 and sin 0, for layers without RoPE) and each layer's index into them [L]."""
  tables = [r for r in ropes if r is not None]
  kinds = [k for k, r in zip((0, 1), ropes) if r is not None]
  if -1 in cfg.layer_ropes:
    tables.append((jnp.ones_like(tables[0][0]), jnp.zeros_like(tables[0][1]))
                  if tables else None)
    kinds.append(-1)
  if tables[-1] is None:  # no layer has RoPE: the identity table of any shape broadcasts
    tables[-1] = (jnp.ones((1, 1, 1, 1), jnp.float32), jnp.zeros((1, 1, 1, 1), jnp.float32))
  stacked = tuple(jnp.stack([t[i] for t in tables]) for i in (0, 1))
  return stacked, jnp.asarray([kinds.index(k) for k in cfg.layer_ropes], jnp.int32)


def layer_rope(cfg: ModelConfig, ropes, layer: int):
  """Layer ``layer``'s (cos, sin) from ``model_rope``'s tables, or None (no RoPE)."""
  if not cfg.rope_per_layer or ropes is None:
    return ropes
  kind = cfg.layer_ropes[layer]
  return None if kind < 0 else ropes[kind]


def apply_rope(x: Array, rope: tuple[Array, Array]) -> Array:
  """x·cos(pθ) + rotate_half(x)·sin(pθ) on [B, T, H, D], with ``rope`` from ``rope_table``;
  in float32, returned in x's dtype."""
  cos, sin = rope
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return (x * cos + rotated * sin).astype(x.dtype)
