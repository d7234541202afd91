"""Dynamic sampling (DAPO; Yu et al. 2025): a group whose n responses all score the same has
advantage 0 under every group estimator, so it carries no policy gradient. The rollout samples
an over-provisioned set of G ≥ B groups (``rl.oversample``), and the update keeps B of them:

    spread_g  = max_i s_{g,i} ≠ min_i s_{g,i}
    kept      = the first B groups in the order (groups with spread first, each part in its
                sampled order)                       — a stable sort: static shapes, one program
    in loss_g = spread_g                             — where fewer than B groups have spread,
                                                       the rest are filled from the others with
                                                       their rows masked out of the loss

verl instead samples again on the host until B groups with spread are found
(``max_num_gen_batches``): a batch of data-dependent size per iteration, a compile per size
here. This keeps one shape and reports how much it kept (``kept_fraction``).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

Array = jax.Array


def sampled_prompts(batch_size: int, oversample: float = 1.0) -> int:
  """Prompts a rollout samples: round(B·f) for ``rl.batch_size`` B and ``rl.oversample`` f ≥ 1."""
  return int(round(batch_size * oversample))


def select_groups(scores: Array, group_size: int, keep: int) -> tuple[Array, Array, dict]:
  """The rows of ``keep`` of the groups of ``scores`` [G·n] (rows g·n … g·n + n − 1 are group
  g), groups with a spread of scores first, each part in its sampled order.

  Returns:
    rows [keep·n] int32 (indices into the G·n rows), in_loss [keep·n] bool (the row's group has
    a spread; the fill's rows are False) and metrics: ``zero_spread_fraction`` (of the G
    sampled groups), ``kept_fraction`` (of the ``keep`` groups, those with a spread).
  """
  chex.assert_rank(scores, 1)
  groups = scores.reshape(-1, group_size)
  if not 0 < keep <= groups.shape[0]:
    raise ValueError(f"keep={keep} groups of the {groups.shape[0]} sampled")
  spread = jnp.max(groups, axis=1) != jnp.min(groups, axis=1)
  order = jnp.argsort(~spread, stable=True)[:keep]  # False (a spread) sorts first
  rows = (order[:, None] * group_size + jnp.arange(group_size)).reshape(-1).astype(jnp.int32)
  in_loss = jnp.repeat(spread[order], group_size)
  metrics = {"zero_spread_fraction": jnp.mean(~spread, dtype=jnp.float32),
             "kept_fraction": jnp.mean(spread[order], dtype=jnp.float32)}
  return rows, in_loss, metrics
