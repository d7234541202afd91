"""Model configuration: one frozen dataclass describing every supported architecture.

Built from a Hugging Face ``config.json`` dict (``from_hf``) and written back (``to_hf``) on
export. The families (``families.FAMILIES``): Llama 2/3 (incl. "llama3" and "linear" RoPE
scaling), Mistral, Qwen2, Qwen3, SmolLM2 (Llama) and SmolLM3, Gemma 2, Gemma 3 (text), OLMo 2,
OLMo 3, GPT-2. A family is data: ``ModelConfig``'s layer description (norms, q/k norm, MLP,
positions, per-layer windows and RoPE) is filled from the family's row and the checkpoint's
``config.json``, and ``models.transformer`` follows it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from ppojax.models import families
from ppojax.models.families import SUPPORTED  # noqa: F401  (ppojax.models.config.SUPPORTED)

# ModelConfig.remat_policy → what ``jax.checkpoint`` saves of each layer's forward pass
# ("weight_matmul": the name ``layers.Linear`` gives its products, which jax's dot
# policies cannot see inside their custom VJP)
_POLICIES = jax.checkpoint_policies
REMAT_POLICIES = {
    "nothing": _POLICIES.nothing_saveable,  # the layer input only: recompute all
    "dots": _POLICIES.save_from_both_policies(  # every matmul: weights' and attention's
        _POLICIES.dots_saveable, _POLICIES.save_only_these_names("weight_matmul")),
    "dots_no_batch": _POLICIES.save_only_these_names("weight_matmul"),  # the weights' matmuls
}
ATTENTION_CHOICES = ("auto", "einsum", "xla", "cudnn")  # ModelConfig.attention
DECODE_CHOICES = ("auto", "einsum", "pallas")  # ModelConfig.decode_attention
# the layer description's fields that default to the family's row (``families.Family``)
_FROM_FAMILY = ("norm", "norm_offset", "sublayer_norms", "qk_norm", "mlp", "positions")


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
  # The layer description (``families``); None: the family's row
  norm: str | None = None  # "rms" (RMSNorm) or "layer" (LayerNorm with bias)
  norm_offset: float | None = None  # RMSNorm scale w + offset (Gemma: 1)
  sublayer_norms: str | None = None  # "pre" (Llama), "post" (OLMo 2/3), "both" (Gemma 2/3)
  qk_norm: str | None = None  # "", "head" (each head's D: Qwen3, Gemma 3), "proj" (H·D: OLMo)
  mlp: str | None = None  # "swiglu", "geglu" (tanh-GELU gate: Gemma), "gelu" (GPT-2's fc→proj)
  positions: str | None = None  # "rope" or "learned" (GPT-2)
  embed_scale: float = 1.0  # embeddings × this (Gemma: √hidden_size, rounded to the dtype)
  query_pre_attn_scalar: float | None = None  # scores / √this (None: head_dim; Gemma's field)
  attn_softcap: float = 0.0  # attention scores c·tanh(s/c) (Gemma 2; 0: none)
  final_softcap: float = 0.0  # logits c·tanh(z/c) (Gemma 2; 0: none)
  # sliding-window layers' own RoPE, where it differs from rope_theta/rope_scaling (Gemma 3's
  # local base 10k against 1M; OLMo 3)
  local_rope_theta: float | None = None
  local_rope_scaling: tuple[tuple[str, Any], ...] | None = None
  nope_layers: tuple[int, ...] = ()  # layers without RoPE (SmolLM3: every 4th)
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
  # a decode step's attention (``attention.decode_path``): "auto" (the fused Pallas kernel of
  # ``decode_kernel`` on one NVIDIA GPU in bf16/fp16, else "einsum"), "einsum" or "pallas"
  decode_attention: str = "auto"
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
    row = families.family(self.model_type)
    for name in _FROM_FAMILY:  # the family's row fills what was not given
      if getattr(self, name) is None:
        object.__setattr__(self, name, getattr(row, name))
    self._check_description()
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                       f"num_kv_heads={self.num_kv_heads} (grouped-query attention needs it)")
    if self.head_dim % 2 and self.positions == "rope":
      raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
    if self.remat_policy not in REMAT_POLICIES:
      raise ValueError(f"remat_policy {self.remat_policy!r}: choose one of "
                       f"{', '.join(REMAT_POLICIES)}")
    if self.attention not in ATTENTION_CHOICES:
      raise ValueError(f"attention {self.attention!r}: choose one of "
                       f"{', '.join(ATTENTION_CHOICES)}")
    if self.decode_attention not in DECODE_CHOICES:
      raise ValueError(f"decode_attention {self.decode_attention!r}: choose one of "
                       f"{', '.join(DECODE_CHOICES)}")
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

  def _check_description(self):
    choices = {"norm": ("rms", "layer"), "sublayer_norms": tuple(families.NORM_PLACES),
               "qk_norm": ("", "head", "proj"), "mlp": ("swiglu", "geglu", "gelu"),
               "positions": ("rope", "learned")}
    for name, allowed in choices.items():
      if getattr(self, name) not in allowed:
        raise ValueError(f"{name}={getattr(self, name)!r}: choose one of {allowed}")
    if self.nope_layers and not all(0 <= i < self.num_layers for i in self.nope_layers):
      raise ValueError(f"nope_layers {self.nope_layers} name layers outside 0 … "
                       f"{self.num_layers - 1}")

  @property
  def is_gpt2(self) -> bool:
    return self.model_type == "gpt2"

  @property
  def family(self) -> families.Family:
    return families.FAMILIES[self.model_type]

  @property
  def windows(self) -> tuple[int, ...]:
    """Sliding-window size per layer, 0 for full attention."""
    return self.layer_windows or (0,) * self.num_layers

  @property
  def layer_ropes(self) -> tuple[int, ...]:
    """Which RoPE each layer applies: 0 the model's (``rope_theta``, ``rope_scaling``), 1 the
    sliding layers' own (``local_rope_theta``), −1 none (``nope_layers``; learned positions)."""
    if self.positions != "rope":
      return (-1,) * self.num_layers
    local = self.local_rope_theta is not None
    return tuple(-1 if i in self.nope_layers else 1 if local and w else 0
                 for i, w in enumerate(self.windows))

  @property
  def rope_per_layer(self) -> bool:
    """Whether layers differ in their RoPE (then ``model_rope`` gives one table per kind)."""
    return self.positions == "rope" and set(self.layer_ropes) != {0}

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
    """From a Hugging Face ``config.json`` dict (transformers 4.x or 5.x spelling): the family's
    row (``families.FAMILIES``) plus what the file says. Raises ``ValueError`` (one line naming
    the field and the supported families) for anything ppojax cannot build."""
    if (reason := families.unsupported_reason(hf)) is not None:
      raise ValueError(reason)
    model_type = hf["model_type"]
    kwargs = _gpt2_kwargs(hf) if model_type == "gpt2" else _decoder_kwargs(hf, model_type)
    eos = hf.get("eos_token_id")
    kwargs.update(model_type=model_type, bos_token_id=hf.get("bos_token_id"),
                  eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
                  pad_token_id=hf.get("pad_token_id"))
    kwargs.update(overrides)
    return cls(**kwargs)

  def to_hf(self) -> dict[str, Any]:
    """A ``config.json`` dict that transformers' Auto classes load."""
    eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
    common = dict(architectures=[self.family.architecture], model_type=self.model_type,
                  vocab_size=self.vocab_size, bos_token_id=self.bos_token_id, eos_token_id=eos,
                  pad_token_id=self.pad_token_id, tie_word_embeddings=self.tie_word_embeddings,
                  torch_dtype="float32")
    if self.is_gpt2:
      return dict(common, n_embd=self.hidden_size, n_inner=self.intermediate_size,
                  n_layer=self.num_layers, n_head=self.num_heads,
                  n_positions=self.max_position_embeddings, layer_norm_epsilon=self.norm_eps,
                  activation_function="gelu_new")
    rope = dict(self.rope_scaling or (("rope_type", "default"),), rope_theta=self.rope_theta)
    act = "silu" if self.mlp == "swiglu" else "gelu_pytorch_tanh"
    hf = dict(common, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
              num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
              num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
              max_position_embeddings=self.max_position_embeddings, rms_norm_eps=self.norm_eps,
              hidden_act=act, hidden_activation=act, rope_theta=self.rope_theta,
              rope_parameters=rope, attention_bias=False, mlp_bias=False)
    if self.rope_scaling:
      hf["rope_scaling"] = dict(self.rope_scaling)
    window = max(self.windows) or None
    hf["sliding_window"] = window
    if self.family.layer_types:
      hf.update(use_sliding_window=bool(window),
                layer_types=["sliding_attention" if w else "full_attention" for w in self.windows])
    if self.model_type in ("qwen2", "qwen3"):  # transformers 4.x reads max_window_layers
      hf["max_window_layers"] = next((i for i, w in enumerate(self.windows) if w),
                                     self.num_layers)
    if self.local_rope_theta is not None:  # rope_parameters keyed by layer type
      local = dict(self.local_rope_scaling or (("rope_type", "default"),),
                   rope_theta=self.local_rope_theta)
      hf["rope_parameters"] = {"full_attention": rope, "sliding_attention": local}
      hf.pop("rope_scaling", None)
    if self.model_type == "smollm3":
      hf["no_rope_layers"] = [int(r >= 0) for r in self.layer_ropes]
    if self.family.gemma_fields:
      scalar = self.query_pre_attn_scalar or self.head_dim
      hf.update(query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
                attn_logit_softcapping=self.attn_softcap or None,
                final_logit_softcapping=self.final_softcap or None)
    return hf


def _gpt2_kwargs(hf: dict[str, Any]) -> dict[str, Any]:
  hidden = hf["n_embd"]
  if hf.get("activation_function", "gelu_new") != "gelu_new":
    raise ValueError(f"GPT-2 activation {hf['activation_function']!r} is not supported")
  if hf.get("scale_attn_by_inverse_layer_idx") or not hf.get("scale_attn_weights", True):
    raise ValueError("GPT-2 scale_attn_by_inverse_layer_idx=True or scale_attn_weights=False "
                     "is not supported")
  return dict(
      vocab_size=hf["vocab_size"], hidden_size=hidden,
      intermediate_size=hf.get("n_inner") or 4 * hidden, num_layers=hf["n_layer"],
      num_heads=hf["n_head"], num_kv_heads=hf["n_head"], head_dim=hidden // hf["n_head"],
      max_position_embeddings=hf["n_positions"], norm_eps=hf["layer_norm_epsilon"],
      tie_word_embeddings=hf.get("tie_word_embeddings", True), qkv_bias=True, out_bias=True)


def _rope(params: dict[str, Any]) -> tuple[float, tuple | None]:
  """(base, scaling items or None) of one layer type's RoPE parameters."""
  params = dict(params)
  theta = float(params.pop("rope_theta"))
  if params.get("rope_type") not in ("default", "llama3", "linear"):
    raise ValueError(f"rope_type {params['rope_type']!r} is not supported (default, linear, "
                     "llama3 are)")
  return theta, (tuple(sorted(params.items())) if params["rope_type"] != "default" else None)


def _decoder_kwargs(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
  """ModelConfig fields of a Llama-like decoder from its config.json and its family's row."""
  row = families.FAMILIES[model_type]
  act = families.hidden_act(hf)
  if act not in families.MLP_ACTIVATIONS[row.mlp]:
    raise ValueError(f"config field hidden_act {act!r} is not supported for {model_type} "
                     f"({' or '.join(families.MLP_ACTIVATIONS[row.mlp])} is)")
  if hf.get("mlp_bias") or (hf.get("attention_bias") and not row.qkv_bias):
    raise ValueError(f"config fields attention_bias or mlp_bias are not supported for "
                     f"{model_type} (checkpoints with those biases)")
  heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
  types = families.layer_types(hf, model_type)
  window = int(hf.get("sliding_window") or 0)
  if "sliding_attention" in types and not window:
    raise ValueError("config field layer_types names sliding_attention layers, but "
                     "sliding_window is not set")
  windows = tuple(window if t == "sliding_attention" else 0 for t in types)
  theta, scaling = _rope(families.rope_parameters(hf, "full_attention"))
  local_theta, local_scaling = _rope(families.rope_parameters(hf, "sliding_attention"))
  if not row.local_rope or (local_theta, local_scaling) == (theta, scaling):
    local_theta = local_scaling = None
  no_rope = hf.get("no_rope_layers") or []
  return dict(
      vocab_size=hf["vocab_size"], hidden_size=hidden,
      intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
      num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or hidden // heads,
      max_position_embeddings=hf["max_position_embeddings"], norm_eps=hf["rms_norm_eps"],
      tie_word_embeddings=hf.get("tie_word_embeddings", False), rope_theta=theta,
      rope_scaling=scaling, qkv_bias=row.qkv_bias,
      layer_windows=windows if any(windows) else None,
      embed_scale=families.embed_scale(hidden) if row.embed_scale else 1.0,
      query_pre_attn_scalar=(float(hf["query_pre_attn_scalar"])
                             if row.gemma_fields and hf.get("query_pre_attn_scalar") else None),
      attn_softcap=float(row.gemma_fields and hf.get("attn_logit_softcapping") or 0.0),
      final_softcap=float(row.gemma_fields and hf.get("final_logit_softcapping") or 0.0),
      local_rope_theta=local_theta, local_rope_scaling=local_scaling,
      nope_layers=tuple(i for i, use in enumerate(no_rope) if not use))
