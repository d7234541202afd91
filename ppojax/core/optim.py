"""The optimizers of the trained models: a learning-rate schedule (linear warmup, then constant,
linear or cosine decay) and AdamW after global-norm clipping, its moments optionally stored in
bfloat16 (``stored_in``); and the gradient of a batch summed over its micro-batches
(``accumulate``), which the RL update and the supervised stages share."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from ppojax.infra.trees import cast_floats


def lr_schedule(lr: float, total_steps: int, warmup_steps: int = 0, decay: str = "constant",
                end_factor: float = 0.0) -> optax.Schedule:
  """Linear warmup 0 → lr over ``warmup_steps``, then ``decay`` ("constant", "linear" or
  "cosine") from lr to end_factor·lr at ``total_steps`` (optimizer steps)."""
  decay_steps = max(total_steps - warmup_steps, 1)
  if decay == "constant":
    after = optax.constant_schedule(lr)
  elif decay == "linear":
    after = optax.linear_schedule(lr, lr * end_factor, decay_steps)
  elif decay == "cosine":
    after = optax.cosine_decay_schedule(lr, decay_steps, alpha=end_factor)
  else:
    raise ValueError(f"unknown lr decay {decay!r}: choose constant, linear or cosine")
  if not warmup_steps:
    return after
  warmup = optax.linear_schedule(0.0, lr, warmup_steps)
  return optax.join_schedules([warmup, after], [warmup_steps])


def make_optimizer(schedule: optax.Schedule, max_grad_norm: float, weight_decay: float = 0.0,
                   b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                   state_dtype: str = "float32") -> optax.GradientTransformation:
  """Global-norm clipping, then AdamW on ``schedule`` (counts optimizer steps), its moments
  stored in ``state_dtype`` (``stored_in``)."""
  return stored_in(optax.chain(optax.clip_by_global_norm(max_grad_norm),
                               optax.adamw(schedule, b1=b1, b2=b2, eps=eps,
                                           weight_decay=weight_decay)), state_dtype)


def stored_in(tx: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
  """``tx`` whose floating-point state (Adam's m and v) is stored in ``dtype``: upcast to
  float32 for each update, which runs in float32, and rounded back to ``dtype`` after.

      m_stored = round_dtype(m_{t}),  m_{t+1} = β1·float32(m_stored) + (1 − β1)·g

  bfloat16 halves the optimizer's memory (8 → 4 bytes per parameter) at the cost of rounding
  the moments to 8 significant bits each step. ``dtype`` float32: ``tx`` itself."""
  dtype = jnp.dtype(dtype)
  if dtype == jnp.float32:
    return tx

  def init(params):
    return cast_floats(tx.init(params), dtype)

  def update(grads, state, params=None):
    updates, state = tx.update(grads, cast_floats(state, jnp.float32), params)
    return updates, cast_floats(state, dtype)

  return optax.GradientTransformation(init, update)


def accumulate(weighted_grad, zeros, micro_batches):
  """(Σ_k g_k, aux stacked [K, ...]) over the micro-batches x_k (the leading axis of
  ``micro_batches``), where (g_k, aux_k) = weighted_grad(x_k) and g_k is already scaled by
  the micro-batch's weight w_k:

      g = Σ_k w_k·∇L_k,   w_k = units(x_k) / units(batch)   ⇒   g = ∇L(batch)

  a ``lax.scan``, so one micro-batch's activations are alive at a time; ``zeros`` (the
  gradient's shape, laid out as the sum should be) starts the sum."""
  def body(total, x):
    g, aux = weighted_grad(x)
    return jax.tree.map(jnp.add, total, g), aux
  return jax.lax.scan(body, zeros, micro_batches)
