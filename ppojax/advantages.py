"""Advantage estimators. Generalised Advantage Estimation (Schulman et al. 2016)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from ppojax import ops

Array = jax.Array


def gae(
    rewards: Array,
    values: Array,
    mask: Array,
    gamma: float | Array = 1.0,
    lam: float | Array = 0.95,
    *,
    last_values: Array | None = None,
    whiten: bool = False,
) -> tuple[Array, Array]:
  """GAE advantages and returns over a response mask, by a reverse ``lax.scan`` over time.

    δ_t = r_t + γ·V_{t+1}·m_{t+1} − V_t
    A_t = δ_t + γλ·A_{t+1}·m_{t+1}
    R_t = A_t + V_t                        (returns: the critic's regression target)

  The episode ends at the last response token: the value after it is 0, also for responses cut
  off by the length limit — unless ``last_values`` [B] is given, which bootstraps V(s_{end+1}) for
  every row (pass ``jnp.where(has_stop, 0, v_next)`` to bootstrap only truncated rows). Rewards
  and values at padded positions are never read, and advantages and returns there are 0.
  ``mask`` must be a prefix mask (``ops.response_mask``); a gap would end the episode at the gap.

  Returns are computed from the raw advantages; ``whiten`` then whitens the advantages over the
  mask (``ops.masked_whiten``, shift_mean=True) as trl does.

  Args:
    rewards, values, mask: [B, T].
    gamma, lam: discount γ and GAE parameter λ.

  Returns:
    (advantages, returns), both float32 [B, T].
  """
  chex.assert_rank([rewards, values, mask], 2)
  chex.assert_equal_shape([rewards, values, mask])
  mask = mask.astype(jnp.bool_)
  r = jnp.where(mask, rewards, 0.0).astype(jnp.float32)
  v = jnp.where(mask, values, 0.0).astype(jnp.float32)
  next_mask = jnp.pad(mask[:, 1:], ((0, 0), (0, 1)))
  next_v = jnp.pad(v[:, 1:], ((0, 0), (0, 1)))  # already 0 where m_{t+1} = 0
  if last_values is not None:
    chex.assert_shape(last_values, (rewards.shape[0],))
    at_end = ops.last_token_mask(mask) & mask
    next_v = jnp.where(at_end, last_values[:, None].astype(jnp.float32), next_v)
  deltas = r + gamma * next_v - v

  def step(adv_next, xs):
    delta_t, mask_t, next_mask_t = xs
    adv_t = delta_t + gamma * lam * jnp.where(next_mask_t, adv_next, 0.0)
    adv_t = jnp.where(mask_t, adv_t, 0.0)
    return adv_t, adv_t

  init = jnp.zeros(rewards.shape[:1], jnp.float32)
  _, adv = jax.lax.scan(step, init, (deltas.T, mask.T, next_mask.T), reverse=True)
  advantages = adv.T
  returns = jnp.where(mask, advantages + v, 0.0)
  if whiten:
    advantages = ops.masked_whiten(advantages, mask, shift_mean=True)
  return advantages, returns
