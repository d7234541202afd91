"""Model families as data: what each transformers ``model_type``'s layers are made of, and the
names its checkpoints give their tensors.

The families ppojax reads differ from Llama in per-layer choices, not in kind. A ``Family`` row
holds the choices a ``config.json`` does not spell out (where the norms sit, whether their scale
is w or 1 + w, q/k norms, the MLP's activation, the embedding scale) and the row's tensor-name
map; ``ModelConfig.from_hf`` reads the rest (sizes, RoPE bases per layer type, ``layer_types``,
sliding window, soft-caps, the attention scale, layers without RoPE) from the checkpoint's own
``config.json``. One layer implementation (``models.transformer.Block``) follows the resulting
description; no code asks which family it runs. Adding a family of this kind is one row here:

    "qwen3": Family("Qwen3ForCausalLM", qk_norm="head", names=_LINEAR | _PRE_NORMS | _QK_NORMS),

Mixture-of-experts and hybrid linear-attention models are not of this kind; their configs stop
``from_hf`` with an error naming the supported families (``unsupported_reason``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

# Our parameter path under one layer (``layers/...``) → the Hugging Face name under
# ``model.layers.{i}.`` (+ ".weight"; [out, in] matrices, transposed on the way in and out)
_LINEAR = {
    "attn/q": "self_attn.q_proj", "attn/k": "self_attn.k_proj", "attn/v": "self_attn.v_proj",
    "attn/o": "self_attn.o_proj", "mlp/gate": "mlp.gate_proj", "mlp/up": "mlp.up_proj",
    "mlp/down": "mlp.down_proj",
}
# where the norms sit: before each sublayer (Llama), after it (OLMo 2), or both (Gemma 2/3)
_PRE_NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
_POST_NORMS = {"attn_post_norm": "post_attention_layernorm",
               "mlp_post_norm": "post_feedforward_layernorm"}
_BOTH_NORMS = {"attn_norm": "input_layernorm", "attn_post_norm": "post_attention_layernorm",
               "mlp_norm": "pre_feedforward_layernorm",
               "mlp_post_norm": "post_feedforward_layernorm"}
_QK_NORMS = {"attn/q_norm": "self_attn.q_norm", "attn/k_norm": "self_attn.k_norm"}

NORM_PLACES = {"pre": ("attn_norm", "mlp_norm"), "post": ("attn_post_norm", "mlp_post_norm"),
               "both": ("attn_norm", "attn_post_norm", "mlp_norm", "mlp_post_norm")}
MLP_ACTIVATIONS = {"swiglu": ("silu", "swish"),  # gated MLPs: hidden_act values they accept
                   "geglu": ("gelu_pytorch_tanh", "gelu_tanh")}
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclasses.dataclass(frozen=True)
class Family:
  """One row: the layer description of a ``model_type`` that its ``config.json`` leaves
  implicit, and its tensor names (``names``: ours → Hugging Face, per layer)."""

  architecture: str  # transformers' causal-LM class (export)
  value_architecture: str  # its *ForSequenceClassification class (a value / reward model)
  names: dict[str, str] = dataclasses.field(default_factory=dict)
  norm: str = "rms"  # "rms" (RMSNorm) or "layer" (LayerNorm with a bias: GPT-2)
  norm_offset: float = 0.0  # RMSNorm's scale is w + offset (Gemma: 1 + w, w initialised at 0)
  sublayer_norms: str = "pre"  # NORM_PLACES: "pre", "post" or "both"
  qk_norm: str = ""  # "" none, "head" (RMSNorm over each head's D), "proj" (over all H·D)
  mlp: str = "swiglu"  # "swiglu" silu(gate)·up, "geglu" gelu_tanh(gate)·up, "gelu" fc→proj
  positions: str = "rope"  # "rope" (per layer: see ModelConfig) or "learned" (GPT-2)
  embed_scale: bool = False  # embeddings × √hidden_size (Gemma)
  # config.json's query_pre_attn_scalar, attn_ and final_logit_softcapping are read (Gemma)
  gemma_fields: bool = False
  qkv_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
  local_rope: bool = False  # rope_parameters may differ per layer type (keyed by it)
  layer_types: bool = True  # config.json's ``layer_types`` picks full / sliding layers


_LLAMA_NAMES = _LINEAR | _PRE_NORMS
FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaForCausalLM", "LlamaForSequenceClassification", _LLAMA_NAMES,
                    layer_types=False),
    "mistral": Family("MistralForCausalLM", "MistralForSequenceClassification", _LLAMA_NAMES,
                      layer_types=False),
    "qwen2": Family("Qwen2ForCausalLM", "Qwen2ForSequenceClassification", _LLAMA_NAMES,
                    qkv_bias=True),
    "qwen3": Family("Qwen3ForCausalLM", "Qwen3ForSequenceClassification",
                    _LLAMA_NAMES | _QK_NORMS, qk_norm="head"),
    "smollm3": Family("SmolLM3ForCausalLM", "SmolLM3ForSequenceClassification", _LLAMA_NAMES),
    "gemma2": Family("Gemma2ForCausalLM", "Gemma2ForSequenceClassification",
                     _LINEAR | _BOTH_NORMS, norm_offset=1.0, sublayer_norms="both",
                     mlp="geglu", embed_scale=True, gemma_fields=True),
    "gemma3_text": Family("Gemma3ForCausalLM", "Gemma3TextForSequenceClassification",
                          _LINEAR | _BOTH_NORMS | _QK_NORMS, norm_offset=1.0,
                          sublayer_norms="both", qk_norm="head", mlp="geglu", embed_scale=True,
                          gemma_fields=True, local_rope=True),
    "olmo2": Family("Olmo2ForCausalLM", "Olmo2ForSequenceClassification",
                    _LINEAR | _POST_NORMS | _QK_NORMS, sublayer_norms="post", qk_norm="proj",
                    layer_types=False),
    "olmo3": Family("Olmo3ForCausalLM", "Olmo3ForSequenceClassification",
                    _LINEAR | _POST_NORMS | _QK_NORMS, sublayer_norms="post", qk_norm="proj",
                    local_rope=True),
    "gpt2": Family("GPT2LMHeadModel", "GPT2ForSequenceClassification", norm="layer",
                   mlp="gelu", positions="learned", layer_types=False),
}
SUPPORTED = tuple(FAMILIES)
_SUPPORTED_TEXT = ", ".join(SUPPORTED)
# keys whose presence marks a mixture-of-experts config (out of scope: one dense MLP per layer)
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size",
            "num_experts_per_tok", "enable_moe_block")


def family(model_type: str) -> Family:
  if model_type not in FAMILIES:
    raise ValueError(f"model_type {model_type!r} is not supported; ppojax supports "
                     f"{_SUPPORTED_TEXT}")
  return FAMILIES[model_type]


def unsupported_reason(hf: dict[str, Any]) -> str | None:
  """Why a ``config.json`` dict describes a model ppojax cannot build (one line naming the field
  and the supported families), or None. Checked before any weight is read."""
  model_type = hf.get("model_type")
  supported = f"ppojax supports the dense families {_SUPPORTED_TEXT}"
  if model_type == "gemma3":  # the multimodal wrapper (Gemma 3 4B and larger)
    return (f"model_type 'gemma3' is Gemma 3's multimodal checkpoint; its text model (the "
            f"config's text_config, model_type 'gemma3_text') is supported; {supported}")
  if model_type not in FAMILIES:
    return f"model_type {model_type!r} is not supported; {supported}"
  if moe := [k for k in MOE_KEYS if hf.get(k)]:
    return (f"config field {moe[0]!r} marks a mixture-of-experts model, which is not "
            f"supported; {supported}")
  types = hf.get("layer_types") or []
  if bad := sorted({t for t in types if t not in LAYER_TYPES}):
    return (f"config field layer_types holds {bad[0]!r}, which ppojax does not implement "
            f"(it implements {', '.join(LAYER_TYPES)}); {supported}")
  if types and len(types) != hf.get("num_hidden_layers"):
    return (f"config field layer_types has {len(types)} entries for "
            f"num_hidden_layers={hf.get('num_hidden_layers')}")
  return None


def hidden_act(hf: dict[str, Any]) -> str:
  """The MLP activation a Llama-like config names (``hidden_activation`` in Gemma's)."""
  return hf.get("hidden_activation") or hf.get("hidden_act") or "silu"


def rope_parameters(hf: dict[str, Any], layer_type: str) -> dict[str, Any]:
  """The RoPE parameters of one layer type (transformers 5 keys them by layer type where they
  differ; 4.x spells a flat ``rope_scaling`` / ``rope_theta`` and Gemma 3's
  ``rope_local_base_freq``), with ``rope_type`` and ``rope_theta`` always present."""
  if layer_type == "sliding_attention" and "rope_local_base_freq" in hf:  # Gemma 3, 4.x
    return {"rope_type": "default", "rope_theta": hf["rope_local_base_freq"]}
  params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  if isinstance(params.get(layer_type), dict):
    params = params[layer_type]
  params = dict(params)
  if "type" in params:  # transformers 4.x spelling
    params.setdefault("rope_type", params.pop("type"))
  params.setdefault("rope_type", "default")
  params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
  return params


def layer_types(hf: dict[str, Any], model_type: str) -> list[str]:
  """Full or sliding attention per layer: ``layer_types`` where the family reads it, else
  every layer sliding when a window is set (Mistral) or full (others); transformers 4.x
  Qwen2/Qwen3 configs without ``layer_types`` slide from ``max_window_layers`` on."""
  n = hf["num_hidden_layers"]
  window = hf.get("sliding_window")
  if model_type in ("qwen2", "qwen3", "smollm3") and not hf.get("use_sliding_window"):
    return ["full_attention"] * n
  if FAMILIES[model_type].layer_types and hf.get("layer_types"):
    return list(hf["layer_types"])
  if model_type in ("qwen2", "qwen3") and window:
    first = hf.get("max_window_layers", 0)
    return ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
  if model_type == "mistral" and window:
    return ["sliding_attention"] * n
  if model_type == "gemma2":  # transformers 4.x: even layers slide
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
  if model_type == "gemma3_text":  # transformers 4.x: every pattern-th layer is full
    pattern = hf.get("sliding_window_pattern", 6)
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(n)]
  return ["full_attention"] * n


def embed_scale(hidden_size: int) -> float:
  """Gemma's embedding scale √d."""
  return math.sqrt(hidden_size)
