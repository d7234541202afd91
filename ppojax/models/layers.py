"""The transformer's building blocks: norms (RMSNorm with scale w or offset + w, LayerNorm), the
soft-cap, ``Linear`` (with its LoRA adapters) and the MLP (SwiGLU, GeGLU, GPT-2's GELU), each
following ``ModelConfig``'s layer description (``models.transformer`` assembles them).
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from ppojax.models.config import ModelConfig
from ppojax.models.kernels import lora_dropout_matmul, lora_matmul, swiglu, weight_matmul

Array = jax.Array


class RMSNorm(nn.Module):
  """y = x / √(mean(x²) + ε) · w, normalised in float32; with ``offset`` (Gemma's norms)
  y = x / √(mean(x²) + ε) · (offset + w), w initialised at 0 and the product taken in float32."""

  eps: float
  dtype: jnp.dtype
  param_dtype: jnp.dtype
  offset: float = 0.0

  @nn.compact
  def __call__(self, x):
    init = nn.initializers.zeros if self.offset else nn.initializers.ones
    w = self.param("scale", init, (x.shape[-1],), self.param_dtype)
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
    if self.offset:
      return (y * (self.offset + w.astype(jnp.float32))).astype(self.dtype)
    return w.astype(self.dtype) * y.astype(self.dtype)


def norm_layer(cfg: ModelConfig, name: str) -> nn.Module:
  """The model's norm (``cfg.norm``): RMSNorm, scale w or offset + w, or GPT-2's LayerNorm."""
  if cfg.norm == "layer":
    return nn.LayerNorm(epsilon=cfg.norm_eps, dtype=cfg.compute_dtype,
                        param_dtype=cfg.param_dtype, name=name)
  return RMSNorm(cfg.norm_eps, cfg.compute_dtype, jnp.dtype(cfg.param_dtype), cfg.norm_offset,
                 name=name)


def softcap(x: Array, cap: float) -> Array:
  """c·tanh(x/c) (Gemma 2's logit soft-cap); x itself for c = 0."""
  return cap * jnp.tanh(x / cap) if cap else x


class Linear(nn.Module):
  """y = x·W + b with W [in, out] ("kernel") — or stored [out, in] with
  ``cfg.transposed_kernels``, then y = x·Wᵀ + b; the same function of the same parameters up
  to the transpose (``transpose_kernels``). Computed in the compute dtype, accumulated in
  float32 (``weight_matmul``).

  A LoRA target adds (α/r)·(x·A)·B (``lora_matmul``). With ``cfg.lora_dropout`` p > 0 and a
  "dropout" rng in the ``apply`` call (the policy update's forward passes), the adapters' input
  is dropped out, (α/r)·(dropout_p(x)·A)·B (``lora_dropout_matmul``), with a mask of its own
  for each layer and each call; without that rng (sampling, old and reference log-probs,
  evaluation) the layer is deterministic, and p = 0 never looks for one."""

  cfg: ModelConfig
  features: int
  use_bias: bool

  @nn.compact
  def __call__(self, x):
    cfg = self.cfg
    shape = (x.shape[-1], self.features)
    kernel = self.param("kernel", nn.initializers.normal(0.02),
                        shape[::-1] if cfg.transposed_kernels else shape, cfg.param_dtype)
    x, kernel = x.astype(cfg.compute_dtype), kernel.astype(cfg.compute_dtype)
    w_axis = 1 if cfg.transposed_kernels else 0
    if cfg.lora_rank and self.name in cfg.lora_targets:  # x·(W + (α/r)·A·B), W frozen
      a = self.param("lora_a", lora_a_init, (shape[0], cfg.lora_rank), jnp.float32)
      b = self.param("lora_b", nn.initializers.zeros, (cfg.lora_rank, shape[1]), jnp.float32)
      a, b, scale = a.astype(x.dtype), b.astype(x.dtype), cfg.lora_alpha / cfg.lora_rank
      if cfg.lora_dropout and self.has_rng("dropout"):
        keep = jax.random.bernoulli(self.make_rng("dropout"), 1.0 - cfg.lora_dropout, x.shape)
        y = lora_dropout_matmul(x, kernel, a, b, keep, scale, cfg.lora_dropout, w_axis)
      else:
        y = lora_matmul(x, kernel, a, b, scale, w_axis)
    else:
      y = weight_matmul(x, kernel, w_axis)
    # named for the remat policies (REMAT_POLICIES): the custom VJP hides the dot inside
    y = checkpoint_name(y, "weight_matmul")
    if self.use_bias:
      bias = self.param("bias", nn.initializers.zeros, (self.features,), cfg.param_dtype)
      y = y + bias.astype(cfg.compute_dtype)
    return y


def lora_a_init(key, shape, dtype=jnp.float32):
  """LoRA's A [in, r]: uniform in ±1/√in (peft's Kaiming-uniform with a = √5); B starts at 0,
  so the adapted model starts as the base model."""
  bound = 1.0 / math.sqrt(shape[-2])
  return jax.random.uniform(key, shape, dtype, -bound, bound)


class MLP(nn.Module):
  """down(act(gate(x))·up(x)) with act silu ("swiglu") or tanh-GELU ("geglu"); GPT-2's
  proj(gelu(fc(x))) ("gelu")."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.cfg
    if cfg.mlp == "gelu":  # fc → GELU (tanh approximation, "gelu_new") → proj
      hidden = nn.gelu(Linear(cfg, cfg.intermediate_size, True, name="fc")(x), approximate=True)
      return Linear(cfg, cfg.hidden_size, True, name="proj")(hidden)
    if cfg.fused_projections:  # one matmul, split by columns: [gate | up]
      gate_up = Linear(cfg, 2 * cfg.intermediate_size, False, name="gate_up")(x)
      gate, up = jnp.split(gate_up, 2, -1)
    else:
      gate = Linear(cfg, cfg.intermediate_size, False, name="gate")(x)
      up = Linear(cfg, cfg.intermediate_size, False, name="up")(x)
    hidden = swiglu(gate, up) if cfg.mlp == "swiglu" else nn.gelu(gate, approximate=True) * up
    return Linear(cfg, cfg.hidden_size, False, name="down")(hidden)
