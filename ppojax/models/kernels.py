"""The layers' hand-written kernels: products accumulated in float32 with their gradients
written out (``weight_matmul``), the few-rows decode form on CPU (``columns_matmul``), LoRA's
products with and without adapter dropout (``lora_matmul``, ``lora_dropout_matmul``), and the
gated MLP's activation (``swiglu``). Each is a ``jax.custom_vjp`` whose docstring gives the
forward and backward formulas and the measurement that made it worth writing; ``Linear`` and
``MLP`` (``transformer.py``) are their callers.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from ppojax.infra.sharding import compile_platform

Array = jax.Array


def dot_f32_accumulate(lhs, rhs, dimension_numbers, precision=None,
                       preferred_element_type=None):
  """``lax.dot_general`` accumulated in float32, returned in the operands' dtype.

  For float32 operands this is the plain product. For bfloat16 it is both the more accurate
  and, on XLA:CPU, the fast path: bf16·bf16 → f32 runs on the CPU's bf16 dot instructions
  (300–540 GFLOP/s at decode shapes on this project's 2-core CPU) where bf16 → bf16 took a
  generic loop (27–87 GFLOP/s). Gradients are accumulated in float32 too.

  The layer form — activations x [..., K] times a 2-D weight contracted on one axis (a Linear
  kernel, or the tied LM head's Eᵀ) — takes ``weight_matmul``, whose gradient is written out.
  """
  del preferred_element_type  # always float32
  (lhs_c, rhs_c), batch_dims = dimension_numbers
  if rhs.ndim == 2 and batch_dims == ((), ()) and tuple(lhs_c) == (lhs.ndim - 1,):
    return weight_matmul(lhs, rhs, int(rhs_c[0]), precision)
  return _dot_f32(lhs, rhs, dimension_numbers, precision)


def _dot_f32(lhs, rhs, dimension_numbers, precision=None):
  out = jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                            preferred_element_type=jnp.float32)
  return out.astype(jnp.result_type(lhs, rhs))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def weight_matmul(x: Array, w: Array, w_axis: int, precision=None) -> Array:
  """y = x·W over x's last axis and W's axis ``w_axis`` (0: W [K, F]; 1: W [F, K], i.e. x·Wᵀ),
  accumulated in float32. Its gradient, with dy [..., F] and x, dy flattened to [N, ·]:

      dx = dy·Wᵀ (w_axis 0) or dy·W (w_axis 1)
      dW = xᵀ·dy [K, F]     or dyᵀ·x [F, K]      — one matmul over the N token rows

  The same products JAX's transpose rule gives, but stated directly: from the rule's
  transposed form, XLA:CPU computed dW with both operands transposed, materialising dyᵀ through
  the elementwise backward that produced dy (10 ms per [1216, 1536] gradient, 10x a plain
  copy). Written out, a 30-layer MLP's forward + backward ran 27% faster (203 → 277 GFLOP/s).

  On CPU, x·Wᵀ over at most ``FEW_ROWS`` rows (a decode step) runs as ``columns_matmul``."""
  if w_axis == 1 and few_rows(x):
    return columns_matmul(x, w, precision)
  return _dot_f32(x, w, (((x.ndim - 1,), (w_axis,)), ((), ())), precision)


FEW_ROWS = 64


def columns_pay_off() -> bool:
  """Whether ``columns_matmul`` (and so the [out, in] decode kernels it needs, which
  ``sampling.decode_layout`` makes) pays off: where the program is compiled for the CPU
  (``sharding.compile_platform``, decided at trace time)."""
  return compile_platform() == "cpu"


def few_rows(x: Array) -> bool:
  """Whether ``weight_matmul`` computes x [..., K]·Wᵀ as ``columns_matmul``: where that pays
  off, with at most ``FEW_ROWS`` rows."""
  return columns_pay_off() and math.prod(x.shape[:-1]) <= FEW_ROWS


def columns_matmul(x: Array, w: Array, precision=None) -> Array:
  """x·Wᵀ for x [..., K] and W [F, K], computed as (W·xᵀ)ᵀ: the F output features become the
  rows of the product and the few rows of x its columns.

  XLA:CPU's matmul kernels are slow when the left operand has few rows: SmolLM2-135M's decode
  projections at 16 rows ran at 35–45 GFLOP/s as x·W, 70–92 as (W·xᵀ)ᵀ (30 layers + the LM head,
  ``benchmarks/decode_floor.py``). The optimization barriers keep the two small transposes
  where they are: without them XLA folds them back into an x·Wᵀ product (41 GFLOP/s). The
  kernel must be stored [F, K] (``ModelConfig.transposed_kernels``, or the tied LM head's
  embedding table): contracting a [K, F] kernel's first axis ran at 16 GFLOP/s."""
  x2 = x.reshape(-1, x.shape[-1])
  barrier = jax.lax.optimization_barrier
  y_t = barrier(_dot_f32(w, barrier(x2.T), (((1,), (0,)), ((), ())), precision))  # [F, N]
  return y_t.T.reshape(x.shape[:-1] + (w.shape[0],))


def _weight_matmul_fwd(x, w, w_axis, precision):
  return weight_matmul(x, w, w_axis, precision), (x, w)


def _weight_matmul_bwd(w_axis, precision, residuals, dy):
  x, w = residuals
  dx = _dot_f32(dy, w, (((dy.ndim - 1,), (1 - w_axis,)), ((), ())), precision)
  x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
  rows = (((0,), (0,)), ((), ()))
  dw = _dot_f32(x2, dy2, rows, precision) if w_axis == 0 else _dot_f32(dy2, x2, rows, precision)
  return dx.astype(x.dtype), dw.astype(w.dtype)


weight_matmul.defvjp(_weight_matmul_fwd, _weight_matmul_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def lora_matmul(x: Array, w: Array, a: Array, b: Array, scale: float, w_axis: int) -> Array:
  """x·(W + s·A·B), LoRA's product with W [in, out] (``w_axis`` 0) or [out, in] (1) frozen:

      forward:   W' = W + s·A·B,  y = x·W'              (one product of x, as the base's)
      backward:  ∂x = ∂y·W'ᵀ,  ∂A = s·xᵀ·(∂y·Bᵀ),  ∂B = s·(x·A)ᵀ·∂y,  ∂W = 0

  The adapters' gradients contract over the rows through [rows, r] products: no [in, out]
  weight gradient is formed, and no [rows, out] delta is added to the output as
  y + s·(x·A)·B would (its extra products and transposes ran the update of a 4-layer model
  slower than full fine-tuning on XLA:CPU). W is frozen by construction: its cotangent is 0."""
  return weight_matmul(x, _lora_weight(w, a, b, scale, w_axis), w_axis)


def _lora_weight(w, a, b, scale, w_axis):
  delta = (scale * jnp.dot(a, b, preferred_element_type=jnp.float32)).astype(w.dtype)
  return w + (delta.T if w_axis else delta)


def _lora_matmul_fwd(x, w, a, b, scale, w_axis):
  # W' is formed again in the backward pass (in·out·r multiply-adds): kept as a residual it
  # would hold a second copy of every adapted weight until then
  return lora_matmul(x, w, a, b, scale, w_axis), (x, w, a, b)


def _lora_matmul_bwd(scale, w_axis, residuals, dy):
  x, w, a, b = residuals
  w_eff = _lora_weight(w, a, b, scale, w_axis)
  dx = _dot_f32(dy, w_eff, (((dy.ndim - 1,), (1 - w_axis,)), ((), ())))
  x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
  g = _dot_f32(dy2, b, (((1,), (1,)), ((), ())))  # ∂y·Bᵀ [N, r]
  h = _dot_f32(x2, a, (((1,), (0,)), ((), ())))  # x·A [N, r]
  rows = (((0,), (0,)), ((), ()))
  da = scale * _dot_f32(x2, g, rows)  # xᵀ·(∂y·Bᵀ) [in, r]
  db = scale * _dot_f32(h, dy2, rows)  # (x·A)ᵀ·∂y [r, out]
  return dx.astype(x.dtype), None, da.astype(a.dtype), db.astype(b.dtype)


lora_matmul.defvjp(_lora_matmul_fwd, _lora_matmul_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def lora_dropout_matmul(x: Array, w: Array, a: Array, b: Array, keep: Array, scale: float,
                        rate: float, w_axis: int) -> Array:
  """x·W + s·(x_d·A)·B with LoRA dropout on the adapters' input (peft's ``lora_dropout``):
  x_d = x ⊙ keep/(1 − p), ``keep`` [..., in] a boolean mask of P(True) = 1 − p (inverted
  dropout: E[x_d] = x); the base path x·W never sees it. With dy and x, dy flattened to rows:

      forward:   y = x·W + s·(x_d·A)·B
      backward:  g = dy·Bᵀ [N, r],  ∂x = dy·Wᵀ + s·(g·Aᵀ) ⊙ keep/(1 − p),
                 ∂A = s·x_dᵀ·g,  ∂B = s·(x_d·A)ᵀ·dy,  ∂W = 0

  The base and the adapters see different inputs, so W + s·A·B cannot be merged as in
  ``lora_matmul``; still, each direction holds one full-size product (x·W forward, dy·Wᵀ
  backward) and the adapters' products are all rank r, contracting over the rows as there (no
  [in, out] weight gradient). The mask comes in as an argument, drawn outside (``Linear``), and
  stays for the backward pass as booleans: a byte per input element (a quarter of float32 x);
  x_d is recomputed from x and the mask, elementwise, rather than kept. Drawing the mask again
  from a key in the backward pass would save that byte at the cost of a second pass of the
  random-bits generator over [N, in]; under ``remat`` the layer's forward is recomputed from
  the same key anyway."""
  x_d = _dropped(x, keep, rate)
  h = _dot_f32(x_d, a, (((x.ndim - 1,), (0,)), ((), ())))  # x_d·A [..., r]
  y = jax.lax.dot_general(x, w, (((x.ndim - 1,), (w_axis,)), ((), ())),
                          preferred_element_type=jnp.float32)
  y += scale * jax.lax.dot_general(h, b, (((h.ndim - 1,), (0,)), ((), ())),
                                   preferred_element_type=jnp.float32)
  return y.astype(jnp.result_type(x, w))


def _dropped(x, keep, rate):
  """x ⊙ keep/(1 − p), scaled in float32 (1/(1 − p) is not exact in bfloat16), in x's dtype."""
  return jnp.where(keep, x.astype(jnp.float32) / (1.0 - rate), 0.0).astype(x.dtype)


def _lora_dropout_matmul_fwd(x, w, a, b, keep, scale, rate, w_axis):
  return lora_dropout_matmul(x, w, a, b, keep, scale, rate, w_axis), (x, w, a, b, keep)


def _lora_dropout_matmul_bwd(scale, rate, w_axis, residuals, dy):
  x, w, a, b, keep = residuals
  x_d = _dropped(x, keep, rate).reshape(-1, x.shape[-1])
  dy2 = dy.reshape(-1, dy.shape[-1])
  g = _dot_f32(dy2, b, (((1,), (1,)), ((), ())))  # ∂y·Bᵀ [N, r]
  h = _dot_f32(x_d, a, (((1,), (0,)), ((), ())))  # x_d·A [N, r]
  dx = jax.lax.dot_general(dy, w, (((dy.ndim - 1,), (1 - w_axis,)), ((), ())),
                           preferred_element_type=jnp.float32)  # ∂y·Wᵀ
  dx_d = jax.lax.dot_general(g, a, (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32)  # (∂y·Bᵀ)·Aᵀ [N, in]
  dx += scale * _dropped(dx_d, keep.reshape(dx_d.shape), rate).reshape(dx.shape)
  rows = (((0,), (0,)), ((), ()))
  da = scale * _dot_f32(x_d, g, rows)  # x_dᵀ·(∂y·Bᵀ) [in, r]
  db = scale * _dot_f32(h, dy2, rows)  # (x_d·A)ᵀ·∂y [r, out]
  return dx.astype(x.dtype), None, da.astype(a.dtype), db.astype(b.dtype), None


lora_dropout_matmul.defvjp(_lora_dropout_matmul_fwd, _lora_dropout_matmul_bwd)


@jax.custom_vjp
def swiglu(gate: Array, up: Array) -> Array:
  """silu(g)·u = g·σ(g)·u, the gated MLP's activation. Its gradient, with s = σ(g):

      ∂/∂g = dy·u·s·(1 + g·(1 − s)),    ∂/∂u = dy·g·s

  keeps only g and u for the backward pass, evaluated in their dtype as autodiff would;
  autodiff of the composition kept four [tokens, intermediate] arrays per layer, and reading
  them back cost a 30-layer MLP's forward + backward 10% of its time on CPU."""
  return nn.silu(gate) * up


def _swiglu_fwd(gate, up):
  return swiglu(gate, up), (gate, up)


def _swiglu_bwd(residuals, dy):
  g, u = residuals
  s = jax.nn.sigmoid(g)
  return dy * u * s * (1 + g * (1 - s)), dy * g * s


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)
