"""The optimizers of the trained models: a learning-rate schedule (linear warmup, then constant,
linear or cosine decay) and AdamW after global-norm clipping, its moments optionally stored in
bfloat16 (``stored_in``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


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

  def cast(tree, to):
    return jax.tree.map(
        lambda x: x.astype(to) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

  def init(params):
    return cast(tx.init(params), dtype)

  def update(grads, state, params=None):
    updates, state = tx.update(grads, cast(state, jnp.float32), params)
    return updates, cast(state, dtype)

  return optax.GradientTransformation(init, update)
