"""Parameter layouts of the same transformer: layers stacked for ``nn.scan`` or one subtree per
layer, q/k/v and gate/up separate or joined, kernels [in, out] or [out, in]. Each map changes
how the parameters are stored, never the function they compute (``ModelConfig.scan_layers``,
``fused_projections``, ``transposed_kernels``); ``sampling.decode_layout`` chains them. And
where each parameter lives on a mesh: ``partition_rules``.
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


# ---------------------------------------------------------------------------------------------
# Partition rules over the mesh axes ("data", "fsdp", "tensor")
# ---------------------------------------------------------------------------------------------


def partition_rules() -> tuple[tuple[str, tuple], ...]:
  """(regex over the '/'-joined parameter path, PartitionSpec entries), first match wins.

  Megatron-style tensor parallelism: q/k/v, gate/up and fc split their output features over
  "tensor", o/down/proj their input features; the other matrix dimension is sharded over
  "fsdp" (ZeRO-3 style). Stacked layer parameters (``scan_layers``) carry the layer axis first,
  never sharded. Vectors (norms, most biases) are replicated. ``ppojax.infra.sharding`` applies
  these, replicating any dimension that the mesh axis does not divide.
  """
  per_layer = (
      (r"attn/(q|k|v|qkv)/kernel$", ("fsdp", "tensor")),
      (r"attn/(q|k|v|qkv)/bias$", ("tensor",)),
      (r"attn/o/kernel$", ("tensor", "fsdp")),
      (r"mlp/(gate|up|gate_up|fc)/kernel$", ("fsdp", "tensor")),
      (r"mlp/fc/bias$", ("tensor",)),
      (r"mlp/(down|proj)/kernel$", ("tensor", "fsdp")),
  )
  return (
      (r"embed/embedding$", ("tensor", "fsdp")),
      (r"wpe/embedding$", (None, "fsdp")),
      *((r"layers/" + pattern, (None,) + spec) for pattern, spec in per_layer),
      *((r"layers_\d+/" + pattern, spec) for pattern, spec in per_layer),
      (r"lm_head/kernel$", ("fsdp", "tensor")),
      (r"score/kernel$", ("fsdp", None)),
      (r".*", ()),  # everything else (norms, remaining biases): replicated
  )
