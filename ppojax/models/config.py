"""Model configuration: one frozen dataclass for every supported architecture.

Built from a Hugging Face ``config.json`` dict (``from_hf``) and written back (``to_hf``) on export.
Supported: Llama 2/3 (incl. "llama3" and "linear" RoPE scaling), Mistral, Qwen2, SmolLM2 (Llama
architecture), GPT-2.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

LLAMA_LIKE = ("llama", "mistral", "qwen2")
SUPPORTED = LLAMA_LIKE + ("gpt2",)
# ModelConfig.remat_policy → what ``jax.checkpoint`` saves of each layer's forward pass
# ("weight_matmul": the name ``transformer.Linear`` gives its products, which jax's dot
# policies cannot see inside their custom VJP)
_POLICIES = jax.checkpoint_policies
REMAT_POLICIES = {
    "nothing": _POLICIES.nothing_saveable,  # the layer input only: recompute all
    "dots": _POLICIES.save_from_both_policies(  # every matmul: weights' and attention's
        _POLICIES.dots_saveable, _POLICIES.save_only_these_names("weight_matmul")),
    "dots_no_batch": _POLICIES.save_only_these_names("weight_matmul"),  # the weights' matmuls
}
ATTENTION_CHOICES = ("auto", "einsum", "xla", "cudnn")  # ModelConfig.attention
_HF_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM", "gpt2": "GPT2LMHeadModel"}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture and numerics of a decoder-only transformer (hashable: usable as a jit static)."""

  model_type: str  # one of SUPPORTED
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  max_position_embeddings: int
  norm_eps: float
  tie_word_embeddings: bool
  rope_theta: float = 10000.0
  rope_scaling: tuple[tuple[str, Any], ...] | None = None  # sorted items of HF rope_parameters
  qkv_bias: bool = False  # Qwen2, GPT-2
  out_bias: bool = False  # GPT-2 (attention output and MLP biases)
  layer_windows: tuple[int, ...] | None = None  # sliding-window size per layer (0 = full)
  bos_token_id: int | None = None
  eos_token_id: int | tuple[int, ...] | None = None
  pad_token_id: int | None = None
  # Numerics (not part of the checkpoint):
  dtype: str = "float32"  # compute dtype: "bfloat16" on accelerators
  param_dtype: str = "float32"
  remat: bool = False  # rematerialise each layer's activations in the backward pass
  # what remat keeps from the forward pass (``REMAT_POLICIES``): "nothing" (recompute the
  # whole layer), "dots" (keep every matmul output), "dots_no_batch" (keep the weight matmuls'
  # outputs, recompute attention scores)
  remat_policy: str = "nothing"
  # attention over several query rows (``attention.attention_path``): "auto" (cuDNN's fused
  # attention on GPU in bf16/fp16, else "einsum"), "einsum", "xla" or "cudnn" (jax.nn's API)
  attention: str = "auto"
  scan_layers: bool = True  # stacked layer params in one nn.scan; False: layers_0 … layers_{L−1}
  # q/k/v as one ``qkv`` matmul and gate/up as one ``gate_up`` (``fuse_projections`` converts
  # the parameters); the decode layout of ``sampling.generate``, never a checkpoint's
  fused_projections: bool = False
  # every Linear kernel stored [out, in] (PyTorch's layout; ``transpose_kernels`` converts the
  # parameters): the decode layout of ``sampling.generate`` on CPU, never a checkpoint's
  transposed_kernels: bool = False
  # LoRA (``ppojax.models.lora``): each Linear named in ``lora_targets`` ("q", "k", "v", "o",
  # "gate", "up", "down"; GPT-2's "fc", "proj") adds (α/r)·(x·A)·B, A [in, r] ("lora_a") and
  # B [r, out] ("lora_b") held in float32 beside its frozen kernel; rank 0: none (the base model)
  lora_rank: int = 0
  lora_alpha: float = 16.0
  lora_targets: tuple[str, ...] = ()
  # dropout p on the adapters' input, (α/r)·(dropout_p(x)·A)·B: only in an ``apply`` given a
  # "dropout" rng (the update's forward passes); every other pass is deterministic
  lora_dropout: float = 0.0

  def __post_init__(self):
    if self.model_type not in SUPPORTED:
      raise ValueError(f"model_type {self.model_type!r} is not one of {SUPPORTED}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                       f"num_kv_heads={self.num_kv_heads} (grouped-query attention needs it)")
    if self.head_dim % 2 and not self.is_gpt2:
      raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
    if self.remat_policy not in REMAT_POLICIES:
      raise ValueError(f"remat_policy {self.remat_policy!r}: choose one of "
                       f"{', '.join(REMAT_POLICIES)}")
    if self.attention not in ATTENTION_CHOICES:
      raise ValueError(f"attention {self.attention!r}: choose one of "
                       f"{', '.join(ATTENTION_CHOICES)}")
    if self.lora_rank and (self.fused_projections or not self.lora_targets):
      raise ValueError("LoRA (lora_rank > 0) needs lora_targets and separate projections "
                       "(fused_projections=False; merge the adapters before decoding: "
                       "ppojax.models.lora.merge)")
    if not 0 <= self.lora_dropout < 1 or (self.lora_dropout and not self.lora_rank):
      raise ValueError(f"lora_dropout={self.lora_dropout} must be in [0, 1), and 0 without "
                       "adapters (lora_rank = 0)")
    if self.layer_windows is not None and len(self.layer_windows) != self.num_layers:
      raise ValueError(f"layer_windows has {len(self.layer_windows)} entries for "
                       f"{self.num_layers} layers")

  @property
  def is_gpt2(self) -> bool:
    return self.model_type == "gpt2"

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def rope_type(self) -> str:
    return dict(self.rope_scaling or ()).get("rope_type", "default")

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  @classmethod
  def from_hf(cls, hf: dict[str, Any], **overrides) -> "ModelConfig":
    """From a Hugging Face ``config.json`` dict (transformers 4.x or 5.x spelling)."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED:
      raise ValueError(
          f"model_type {model_type!r} is not supported; ppojax supports {', '.join(SUPPORTED)}")
    if model_type == "gpt2":
      hidden = hf["n_embd"]
      kwargs = dict(
          vocab_size=hf["vocab_size"], hidden_size=hidden,
          intermediate_size=hf.get("n_inner") or 4 * hidden, num_layers=hf["n_layer"],
          num_heads=hf["n_head"], num_kv_heads=hf["n_head"], head_dim=hidden // hf["n_head"],
          max_position_embeddings=hf["n_positions"], norm_eps=hf["layer_norm_epsilon"],
          tie_word_embeddings=hf.get("tie_word_embeddings", True), qkv_bias=True, out_bias=True)
      if hf.get("activation_function", "gelu_new") != "gelu_new":
        raise ValueError(f"GPT-2 activation {hf['activation_function']!r} is not supported")
      if hf.get("scale_attn_by_inverse_layer_idx") or not hf.get("scale_attn_weights", True):
        raise ValueError("GPT-2 scale_attn_by_inverse_layer_idx=True or scale_attn_weights=False "
                         "is not supported")
    else:
      heads = hf["num_attention_heads"]
      rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
      theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
      if "type" in rope:  # transformers 4.x spelling
        rope.setdefault("rope_type", rope.pop("type"))
      if rope.get("rope_type", "default") not in ("default", "llama3", "linear"):
        raise ValueError(
            f"rope_type {rope['rope_type']!r} is not supported (default, linear, llama3 are)")
      if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (silu is)")
      if hf.get("mlp_bias") or (hf.get("attention_bias") and model_type != "qwen2"):
        raise ValueError("Llama checkpoints with attention_bias or mlp_bias are not supported")
      kwargs = dict(
          vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
          intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
          num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
          head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
          max_position_embeddings=hf["max_position_embeddings"], norm_eps=hf["rms_norm_eps"],
          tie_word_embeddings=hf.get("tie_word_embeddings", False), rope_theta=float(theta),
          rope_scaling=tuple(sorted(rope.items())) if rope.get("rope_type", "default") != "default"
          else None,
          qkv_bias=model_type == "qwen2", layer_windows=_layer_windows(hf, model_type))
    eos = hf.get("eos_token_id")
    kwargs.update(model_type=model_type, bos_token_id=hf.get("bos_token_id"),
                  eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
                  pad_token_id=hf.get("pad_token_id"))
    kwargs.update(overrides)
    return cls(**kwargs)

  def to_hf(self) -> dict[str, Any]:
    """A ``config.json`` dict that transformers' Auto classes load."""
    eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
    common = dict(architectures=[_HF_ARCH[self.model_type]], model_type=self.model_type,
                  vocab_size=self.vocab_size, bos_token_id=self.bos_token_id, eos_token_id=eos,
                  pad_token_id=self.pad_token_id, tie_word_embeddings=self.tie_word_embeddings,
                  torch_dtype="float32")
    if self.is_gpt2:
      return dict(common, n_embd=self.hidden_size, n_inner=self.intermediate_size,
                  n_layer=self.num_layers, n_head=self.num_heads,
                  n_positions=self.max_position_embeddings, layer_norm_epsilon=self.norm_eps,
                  activation_function="gelu_new")
    rope = dict(self.rope_scaling or (("rope_type", "default"),), rope_theta=self.rope_theta)
    hf = dict(common, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
              num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
              num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
              max_position_embeddings=self.max_position_embeddings, rms_norm_eps=self.norm_eps,
              hidden_act="silu", rope_theta=self.rope_theta, rope_parameters=rope)
    if self.rope_scaling:
      hf["rope_scaling"] = dict(self.rope_scaling)
    windows = set(self.layer_windows or (0,))
    if self.model_type == "llama":
      hf.update(attention_bias=False, mlp_bias=False)
    elif self.model_type == "mistral":
      hf["sliding_window"] = max(windows) or None
    elif self.model_type == "qwen2":
      window = max(windows)
      layers = self.layer_windows or (0,) * self.num_layers
      hf.update(use_sliding_window=bool(window), sliding_window=window or None,
                max_window_layers=next((i for i, w in enumerate(layers) if w), self.num_layers),
                layer_types=["sliding_attention" if w else "full_attention"
                             for w in (self.layer_windows or (0,) * self.num_layers)])
    return hf


def _layer_windows(hf: dict[str, Any], model_type: str) -> tuple[int, ...] | None:
  """Sliding-window size per layer, 0 for full attention (Mistral: all layers; Qwen2: by
  ``layer_types``)."""
  window = hf.get("sliding_window")
  n = hf["num_hidden_layers"]
  if not window:
    return None
  if model_type == "mistral":
    return (int(window),) * n
  if model_type == "qwen2" and hf.get("use_sliding_window"):
    first = hf.get("max_window_layers", 0)  # transformers 4.x: layers >= this slide
    types = hf.get("layer_types") or [
        "sliding_attention" if i >= first else "full_attention" for i in range(n)]
    windows = tuple(int(window) if t == "sliding_attention" else 0 for t in types)
    return windows if any(windows) else None
  return None
