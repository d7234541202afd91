"""Hugging Face tensor names and shapes ↔ ppojax backbone params, per family (Llama, GPT-2).

The backbone is everything but the heads: embeddings, the layers (stacked [L, ...]) and the final
norm. ``hf.params_from_hf`` / ``hf.params_to_hf`` add the heads, the checks and the dtypes.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ppojax.models.config import ModelConfig

Take = Callable[[str, tuple[int, ...]], np.ndarray]  # a tensor by name, its shape checked
Stack = Callable[..., np.ndarray]  # (name format, shape, transpose=False) → [L, ...]

LLAMA_LAYER = {  # ours → HF (under model.layers.{i}.); Linear weights are transposed
    ("attn", "q"): "self_attn.q_proj", ("attn", "k"): "self_attn.k_proj",
    ("attn", "v"): "self_attn.v_proj", ("attn", "o"): "self_attn.o_proj",
    ("mlp", "gate"): "mlp.gate_proj", ("mlp", "up"): "mlp.up_proj",
    ("mlp", "down"): "mlp.down_proj",
}
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


def llama_from_hf(cfg: ModelConfig, take: Take, stack: Stack) -> dict:
  """A Llama-family backbone from names relative to 'model.'; [out, in] weights transposed."""
  d, i_size = cfg.hidden_size, cfg.intermediate_size
  q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  layers: dict[str, dict] = {"attn": {}, "mlp": {}}
  backbone = {"embed": {"embedding": take("embed_tokens.weight", (cfg.vocab_size, d))}}
  out_dims = {"q": q_out, "k": kv_out, "v": kv_out, "o": d, "gate": i_size, "up": i_size,
              "down": d}
  in_dims = {"o": q_out, "down": i_size}
  for (group, ours), theirs in LLAMA_LAYER.items():
    shape = (out_dims[ours], in_dims.get(ours, d))
    layers[group][ours] = {"kernel": stack(f"layers.{{}}.{theirs}.weight", shape, True)}
    if cfg.qkv_bias and ours in "qkv":
      layers[group][ours]["bias"] = stack(f"layers.{{}}.{theirs}.bias", (out_dims[ours],))
  layers["attn_norm"] = {"scale": stack("layers.{}.input_layernorm.weight", (d,))}
  layers["mlp_norm"] = {"scale": stack("layers.{}.post_attention_layernorm.weight", (d,))}
  backbone["final_norm"] = {"scale": take("norm.weight", (d,))}
  backbone["layers"] = layers
  return backbone


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
  """A Llama-family backbone ``m`` (float32 NumPy, stacked layers) as full Hugging Face names."""
  layers, sd = m["layers"], {}
  sd["model.embed_tokens.weight"] = m["embed"]["embedding"]
  for i in range(cfg.num_layers):
    h = f"model.layers.{i}."
    for (group, ours), theirs in LLAMA_LAYER.items():
      sd[h + theirs + ".weight"] = layers[group][ours]["kernel"][i].T
      if "bias" in layers[group][ours]:
        sd[h + theirs + ".bias"] = layers[group][ours]["bias"][i]
    sd[h + "input_layernorm.weight"] = layers["attn_norm"]["scale"][i]
    sd[h + "post_attention_layernorm.weight"] = layers["mlp_norm"]["scale"][i]
  sd["model.norm.weight"] = m["final_norm"]["scale"]
  return sd
