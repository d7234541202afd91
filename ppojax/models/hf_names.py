"""Hugging Face tensor names and shapes ↔ ppojax backbone params: GPT-2's, and every Llama-like
family's from its row's name map (``families.Family.names``: our path under a layer → the
Hugging Face name under ``model.layers.{i}.``).

The backbone is everything but the heads: embeddings, the layers (stacked [L, ...]) and the final
norm. ``hf.params_from_hf`` / ``hf.params_to_hf`` add the heads, the checks and the dtypes.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ppojax.models.config import ModelConfig

Take = Callable[[str, tuple[int, ...]], np.ndarray]  # a tensor by name, its shape checked
Stack = Callable[..., np.ndarray]  # (name format, shape, transpose=False) → [L, ...]

GPT2_LAYER = {("attn", "o"): "attn.c_proj", ("mlp", "fc"): "mlp.c_fc",
              ("mlp", "proj"): "mlp.c_proj"}  # Conv1D weights are already [in, out]


def gpt2_from_hf(cfg: ModelConfig, take: Take, stack: Stack) -> dict:
  """GPT-2's backbone from names relative to 'transformer.'; c_attn is split into q, k, v."""
  d, i_size = cfg.hidden_size, cfg.intermediate_size
  layers: dict[str, dict] = {"attn": {}, "mlp": {}}
  backbone = {"embed": {"embedding": take("wte.weight", (cfg.vocab_size, d))},
              "wpe": {"embedding": take("wpe.weight", (cfg.max_position_embeddings, d))}}
  qkv_w = stack("h.{}.attn.c_attn.weight", (d, 3 * d))
  qkv_b = stack("h.{}.attn.c_attn.bias", (3 * d,))
  for j, name in enumerate("qkv"):
    layers["attn"][name] = {"kernel": qkv_w[:, :, j * d:(j + 1) * d],
                            "bias": qkv_b[:, j * d:(j + 1) * d]}
  sizes = {("attn", "o"): (d, d), ("mlp", "fc"): (d, i_size), ("mlp", "proj"): (i_size, d)}
  for (group, ours), theirs in GPT2_LAYER.items():
    out_dim = sizes[(group, ours)][1]
    layers[group][ours] = {"kernel": stack(f"h.{{}}.{theirs}.weight", sizes[(group, ours)]),
                           "bias": stack(f"h.{{}}.{theirs}.bias", (out_dim,))}
  for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
    layers[ours] = {"scale": stack(f"h.{{}}.{theirs}.weight", (d,)),
                    "bias": stack(f"h.{{}}.{theirs}.bias", (d,))}
  backbone["final_norm"] = {"scale": take("ln_f.weight", (d,)),
                            "bias": take("ln_f.bias", (d,))}
  backbone["layers"] = layers
  return backbone


def layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """Our shape of each tensor a Llama-like layer holds, by its path in the family's name map
  ([in, out] for matrices; the Hugging Face tensor is the transpose)."""
  d, i_size, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
  q_out, kv_out = cfg.num_heads * hd, cfg.num_kv_heads * hd
  head = cfg.qk_norm == "head"
  shapes = {"attn/q": (d, q_out), "attn/k": (d, kv_out), "attn/v": (d, kv_out),
            "attn/o": (q_out, d), "mlp/gate": (d, i_size), "mlp/up": (d, i_size),
            "mlp/down": (i_size, d), "attn/q_norm": (hd if head else q_out,),
            "attn/k_norm": (hd if head else kv_out,)}
  return {path: shapes.get(path, (d,)) for path in cfg.family.names}


def _leaves(cfg: ModelConfig, path: str) -> list[tuple[str, str, bool]]:
  """(our leaf, Hugging Face suffix, transposed) of one layer path: a norm's "scale"; a
  projection's "kernel" (transposed) and, for q/k/v with ``qkv_bias``, its "bias"."""
  if path.split("/")[-1].endswith("norm"):
    return [("scale", "weight", False)]
  leaves = [("kernel", "weight", True)]
  if cfg.qkv_bias and path in ("attn/q", "attn/k", "attn/v"):
    leaves.append(("bias", "bias", False))
  return leaves


def _subtree(tree: dict, path: str) -> dict:
  for key in path.split("/"):
    tree = tree.setdefault(key, {})
  return tree


def llama_from_hf(cfg: ModelConfig, take: Take, stack: Stack) -> dict:
  """A Llama-like backbone from names relative to 'model.' (the family's name map); [out, in]
  weights transposed."""
  d = cfg.hidden_size
  layers: dict[str, dict] = {}
  for path, shape in layer_shapes(cfg).items():
    theirs = cfg.family.names[path]
    for leaf, suffix, transposed in _leaves(cfg, path):
      their_shape = shape[::-1] if transposed else shape[-1:]
      _subtree(layers, path)[leaf] = stack(f"layers.{{}}.{theirs}.{suffix}", their_shape,
                                           transposed)
  return {"embed": {"embedding": take("embed_tokens.weight", (cfg.vocab_size, d))},
          "layers": layers, "final_norm": {"scale": take("norm.weight", (d,))}}


def gpt2_to_hf(cfg: ModelConfig, m: dict) -> dict[str, np.ndarray]:
  """GPT-2's backbone ``m`` (float32 NumPy, stacked layers) as full Hugging Face names."""
  pre, layers, sd = "transformer.", m["layers"], {}
  sd[pre + "wte.weight"] = m["embed"]["embedding"]
  sd[pre + "wpe.weight"] = m["wpe"]["embedding"]
  for i in range(cfg.num_layers):
    h = f"{pre}h.{i}."
    attn = layers["attn"]
    sd[h + "attn.c_attn.weight"] = np.concatenate([attn[n]["kernel"][i] for n in "qkv"], 1)
    sd[h + "attn.c_attn.bias"] = np.concatenate([attn[n]["bias"][i] for n in "qkv"])
    for (group, ours), theirs in GPT2_LAYER.items():
      sd[h + theirs + ".weight"] = layers[group][ours]["kernel"][i]
      sd[h + theirs + ".bias"] = layers[group][ours]["bias"][i]
    for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
      sd[h + theirs + ".weight"] = layers[ours]["scale"][i]
      sd[h + theirs + ".bias"] = layers[ours]["bias"][i]
  sd[pre + "ln_f.weight"] = m["final_norm"]["scale"]
  sd[pre + "ln_f.bias"] = m["final_norm"]["bias"]
  return sd


def llama_to_hf(cfg: ModelConfig, m: dict) -> dict[str, np.ndarray]:
  """A Llama-like backbone ``m`` (float32 NumPy, stacked layers) as full Hugging Face names."""
  sd = {"model.embed_tokens.weight": m["embed"]["embedding"]}
  for path, theirs in cfg.family.names.items():
    tree = m["layers"]
    for key in path.split("/"):
      tree = tree[key]
    for leaf, suffix, transposed in _leaves(cfg, path):
      for i in range(cfg.num_layers):
        value = tree[leaf][i]
        sd[f"model.layers.{i}.{theirs}.{suffix}"] = value.T if transposed else value
  sd["model.norm.weight"] = m["final_norm"]["scale"]
  return sd
