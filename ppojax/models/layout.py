"""Parameter layouts of the same transformer: layers stacked for ``nn.scan`` or one subtree per
layer, q/k/v and gate/up separate or joined, kernels [in, out] or [out, in]. Each map changes
how the parameters are stored, never the function they compute (``ModelConfig.scan_layers``,
``fused_projections``, ``transposed_kernels``); ``sampling.decode_layout`` chains them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

def stack_layers(params: dict) -> dict:
  """The inverse of ``unstack_layers``."""
  model = dict(params["model"])
  names = sorted((k for k in model if k.startswith("layers_")), key=lambda k: int(k[7:]))
  model["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs), *[model.pop(k) for k in names])
  return {**params, "model": model}


def unstack_layers(params: dict) -> dict:
  """Stacked (``scan_layers=True``) params → one subtree per layer (``scan_layers=False``).

  Unrolled layers read their weights in place; a scan slices each layer's weights out of the
  stacked arrays, which XLA materialises as a copy of every weight on every call — the dominant
  cost of a small-batch decode step on CPU.
  """
  model = dict(params["model"])
  stacked = model.pop("layers")
  n = jax.tree.leaves(stacked)[0].shape[0]
  for i in range(n):
    model[f"layers_{i}"] = jax.tree.map(lambda x, i=i: x[i], stacked)
  return {**params, "model": model}


_FUSED = (("attn", ("q", "k", "v"), "qkv"), ("mlp", ("gate", "up"), "gate_up"))


def fuse_projections(params: dict) -> dict:
  """Params for ``fused_projections=True``: each layer's q, k, v kernels (and biases) joined
  column-wise into ``qkv``, gate and up into ``gate_up`` (stacked or unrolled layers alike:
  the join is on the last axis). A decode step then runs 2 matmuls where it ran 5, with wider
  outputs that use the cores better at small batch."""
  def fuse_layer(layer: dict) -> dict:
    layer = dict(layer)
    for block, parts, fused in _FUSED:
      sub = dict(layer.get(block, {}))
      if not all(p in sub for p in parts):
        continue  # GPT-2's MLP (fc/proj) has nothing to join
      pieces = [sub.pop(p) for p in parts]
      sub[fused] = {leaf: jnp.concatenate([piece[leaf] for piece in pieces], axis=-1)
                    for leaf in pieces[0]}
      layer[block] = sub
    return layer

  model = {name: fuse_layer(sub) if name == "layers" or name.startswith("layers_") else sub
           for name, sub in params["model"].items()}
  return {**params, "model": model}


def transpose_kernels(params: dict) -> dict:
  """Params for ``transposed_kernels=True`` (and back: the map is its own inverse): every
  ``Linear`` kernel's two matrix axes swapped, [in, out] ↔ [out, in] (the layer axis of stacked
  params stays first). The embedding tables and a value model's ``score`` head are unchanged."""
  def swap(path, leaf):
    names = [getattr(k, "key", None) for k in path]
    if names[-1] == "kernel" and "score" not in names:
      return jnp.swapaxes(leaf, -1, -2)
    return leaf
  return jax.tree_util.tree_map_with_path(swap, params)
