"""Advantage estimators: GAE with a critic; group-relative (GRPO, Dr. GRPO), leave-one-out
(RLOO) and batch-whitened returns (REINFORCE++) without one.

Every estimator returns ``(advantages, returns)``, both [N, T] (returns None where there is no
critic target), 0 off the response mask, so any of them plugs in where GAE's output goes.
Group estimators read sequence scores [N] whose N = B·n rows are B groups of n samples of one
prompt each, **contiguous** (rows g·n … g·n + n − 1 are group g): group statistics are
``scores.reshape(B, n)`` reductions. A degenerate group (all scores equal, or n = 1) gives
advantage exactly 0, never NaN. ``ESTIMATORS`` picks one by name (``estimator``).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

from ppojax.core import ops

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
  A ``mask`` with gaps (a multi-turn trajectory: the policy's tokens between observations) is
  one episode over its masked tokens: the columns off the mask are skipped, so V_{t+1} and
  A_{t+1} above are those of the next masked token (one γ per policy token, none for the
  observation between), and a prefix mask (``ops.response_mask``) is the special case.

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
  t = mask.shape[1]
  v = jnp.where(mask, values, 0.0).astype(jnp.float32)
  # the next masked column after each t (t: none), skipping the gaps of a multi-turn mask
  index = jnp.where(mask, jnp.arange(t, dtype=jnp.int32)[None], t)
  after = jnp.pad(index[:, 1:], ((0, 0), (0, 1)), constant_values=t)
  next_index = jax.lax.cummin(after, axis=1, reverse=True)
  has_next = next_index < t
  next_v = jnp.where(has_next, jnp.take_along_axis(v, jnp.minimum(next_index, t - 1), axis=1),
                     0.0)
  if last_values is not None:
    chex.assert_shape(last_values, (rewards.shape[0],))
    at_end = ops.last_token_mask(mask) & mask
    next_v = jnp.where(at_end, last_values[:, None].astype(jnp.float32), next_v)
  # The response is one episode that ends at its last token: a discount of γ everywhere (the
  # value after the end is 0 or last_values, already in next_v) and a trace cut at the end.
  advantages, returns = gae_episodes(rewards, v, next_v, gamma, has_next, lam, mask=mask)
  if whiten:
    advantages = ops.masked_whiten(advantages, mask, shift_mean=True)
  return advantages, returns


def gae_episodes(
    rewards: Array,
    values: Array,
    next_values: Array,
    discounts: float | Array,
    continues: Array,
    lam: float | Array = 0.95,
    *,
    mask: Array | None = None,
) -> tuple[Array, Array]:
  """GAE over steps that may hold several episodes per row (vectorised environments), by a
  reverse ``lax.scan`` over time; ``gae`` (one episode per row, the response) is a special case.

    δ_t = r_t + d_t·V'_t − V_t
    A_t = δ_t + λ·d_t·c_t·A_{t+1}
    R_t = A_t + V_t

  V'_t is the value of the state the step led to, *before* any automatic reset; d_t the step's
  discount and c_t whether the next column continues this episode. For an environment step:

  * within an episode:     d_t = γ,  c_t = 1   (V'_t = V_{t+1})
  * terminal (the MDP ends): d_t = 0, c_t = 0   (nothing after it has value)
  * truncated (time limit): d_t = γ, c_t = 0   (bootstrap from V'_t = V(s_final), the last
    observation's value, not the reset one's; the trace stops: the next column is a new episode)

  After the last column A_{T} = 0, so the last column always bootstraps from V'_{T−1} (the
  rollout's cut is a truncation). ``mask`` (optional) zeroes A and R where it is 0 (rewards and
  values there unread) and hands A_{t+1} on across it (``gae``'s gaps; c = 0 cuts an episode).

  Args:
    rewards, values, next_values: [B, T].
    discounts: [B, T], or a scalar γ for every step.
    continues: [B, T] (bool or 0/1).
    lam: GAE parameter λ.
    mask: [B, T] or None (every step counts).

  Returns:
    (advantages, returns), both float32 [B, T].
  """
  chex.assert_rank([rewards, values, next_values, continues], 2)
  chex.assert_equal_shape([rewards, values, next_values, continues])
  mask = jnp.ones(rewards.shape, jnp.bool_) if mask is None else mask.astype(jnp.bool_)
  chex.assert_equal_shape([rewards, mask])
  discounts = jnp.broadcast_to(jnp.asarray(discounts, jnp.float32), rewards.shape)
  r = jnp.where(mask, rewards, 0.0).astype(jnp.float32)
  v = jnp.where(mask, values, 0.0).astype(jnp.float32)
  next_v = jnp.where(mask, next_values, 0.0).astype(jnp.float32)
  deltas = r + discounts * next_v - v

  def step(adv_next, xs):
    delta_t, discount_t, continue_t, mask_t = xs
    adv_t = delta_t + lam * discount_t * jnp.where(continue_t, adv_next, 0.0)
    # a masked-out step passes the next step's advantage through (``gae``'s gaps) and is 0
    return jnp.where(mask_t, adv_t, adv_next), jnp.where(mask_t, adv_t, 0.0)

  init = jnp.zeros(rewards.shape[:1], jnp.float32)
  xs = (deltas.T, discounts.T, continues.astype(jnp.bool_).T, mask.T)
  _, adv = jax.lax.scan(step, init, xs, reverse=True)
  advantages = adv.T
  return advantages, jnp.where(mask, advantages + v, 0.0)


def discounted_returns(rewards: Array, mask: Array, gamma: float | Array = 1.0) -> Array:
  """Reward-to-go over a response mask: G_t = Σ_{k ≥ t} γ^{k−t}·r_k·m_k (0 off the mask).

  The episode ends at the last response token (``gae`` with V ≡ 0 and λ = 1, which this is).

  Args:
    rewards, mask: [B, T]; ``mask`` a prefix mask (``ops.response_mask``).

  Returns:
    G, float32 [B, T].
  """
  chex.assert_rank([rewards, mask], 2)
  chex.assert_equal_shape([rewards, mask])
  returns, _ = gae(rewards, jnp.zeros(rewards.shape, jnp.float32), mask, gamma, 1.0)
  return returns


def reinforce_pp(rewards: Array, mask: Array, gamma: float | Array = 1.0, *, eps: float = 1e-8
                 ) -> tuple[Array, Array]:
  """REINFORCE++ (Hu 2025, "REINFORCE++: a simple and efficient approach for aligning large
  language models"): discounted returns of the KL-shaped token rewards, whitened over every
  response token of the batch — the batch is the baseline, no critic.

    r_t = −β·KL_t + 1[t = last]·s         (``rewards.shape_rewards``)
    G_t = Σ_{k ≥ t} γ^{k−t}·r_k            (``discounted_returns``)
    A_t = (G_t − mean_m(G)) / √(var_m(G) + eps)   over all masked tokens of the batch

  (``ops.masked_whiten``: unbiased variance, eps inside the root.) Where every masked G_t is the
  same (or there is at most one), A = 0 exactly.

  Args:
    rewards, mask: [B, T] token rewards and the (prefix) response mask.

  Returns:
    (advantages A, returns G), float32 [B, T], 0 off the mask.
  """
  returns = discounted_returns(rewards, mask, gamma)
  mask = mask.astype(jnp.bool_)
  lo = jnp.min(jnp.where(mask, returns, jnp.inf))
  hi = jnp.max(jnp.where(mask, returns, -jnp.inf))
  white = ops.masked_whiten(returns, mask, shift_mean=True, eps=eps)
  return jnp.where(hi > lo, white, 0.0), returns


def _groups(scores: Array, mask: Array, group_size: int) -> tuple[Array, Array]:
  """scores [N] as [N/n, n] float32 groups centred on their means (r_i − mean_j r_j), and per
  group whether it is degenerate [N/n, 1] (all scores equal, which includes n = 1)."""
  chex.assert_rank([scores, mask], [1, 2])
  chex.assert_equal_shape_prefix([scores, mask], 1)
  if not isinstance(group_size, (int, np.integer)) or group_size < 1:
    raise ValueError(f"group_size={group_size!r} must be a Python int >= 1 (samples per prompt)")
  if scores.shape[0] % group_size:
    raise ValueError(f"{scores.shape[0]} scores do not split into groups of {group_size}: "
                     "give B·n rows, the n samples of each prompt next to each other")
  groups = scores.astype(jnp.float32).reshape(-1, group_size)
  degenerate = jnp.max(groups, axis=1, keepdims=True) == jnp.min(groups, axis=1, keepdims=True)
  return groups - jnp.mean(groups, axis=1, keepdims=True), degenerate


def _per_token(seq_adv: Array, degenerate: Array, mask: Array) -> Array:
  """Group advantages [N/n, n] (0 in degenerate groups) broadcast over the mask: [N, T]."""
  seq_adv = jnp.where(degenerate, 0.0, seq_adv).reshape(-1)
  return jnp.where(mask.astype(jnp.bool_), seq_adv[:, None], 0.0)


def grpo(scores: Array, mask: Array, group_size: int, *, eps: float = 1e-6
         ) -> tuple[Array, None]:
  """Group-normalised advantage (GRPO; Shao et al. 2024, "DeepSeekMath", §4.1.2, outcome
  supervision): for sample i of a group of n,

    A_i = (r_i − mean_j r_j) / (std_j r_j + eps),   std with Bessel's correction (n − 1)

  as trl, verl and OpenRLHF compute it; every response token of sample i gets A_i. A group whose
  scores are all equal (and a group of 1) gets 0.

  Args:
    scores: [N] sequence scores, N = B·n, the n samples of a prompt contiguous.
    mask: [N, T] response mask.
    group_size: n, a Python int.

  Returns:
    (advantages [N, T] float32, None): no critic target.
  """
  centred, degenerate = _groups(scores, mask, group_size)
  ss = jnp.sum(jnp.square(centred), axis=1, keepdims=True)
  std = jnp.sqrt(ss / max(group_size - 1, 1))
  return _per_token(centred / (std + eps), degenerate, mask), None


def dr_grpo(scores: Array, mask: Array, group_size: int) -> tuple[Array, None]:
  """Group-centred advantage without the std scaling (Dr. GRPO; Liu et al. 2025,
  "Understanding R1-Zero-like training: a critical perspective", §3.2):

    A_i = r_i − mean_j r_j

  Dividing by the group's std favours prompts that are nearly all right or all wrong; Dr. GRPO
  drops it (and the 1/|o_i| length normalisation: aggregate with
  ``seq_mean_token_sum_norm``). A group of equal scores (or of 1) gets 0.

  Args, Returns: as ``grpo``.
  """
  centred, degenerate = _groups(scores, mask, group_size)
  return _per_token(centred, degenerate, mask), None


def rloo(scores: Array, mask: Array, group_size: int) -> tuple[Array, None]:
  """REINFORCE leave-one-out (RLOO; Kool et al. 2019, "Buy 4 REINFORCE samples, get a baseline
  for free!"; Ahmadian et al. 2024, "Back to basics"): each sample's baseline is the mean of the
  other n − 1 scores of its group,

    A_i = r_i − (1/(n−1))·Σ_{j≠i} r_j = n/(n−1)·(r_i − mean_j r_j)

  i.e. Dr. GRPO's advantage scaled by n/(n−1): the papers' estimator (1/n)·Σ_i A_i·∇log π(y_i)
  is unbiased with this per-sample A_i (the baseline does not depend on y_i). The advantages of
  a group sum to 0. A group of 1 (no other sample) or of equal scores gets 0.

  Args, Returns: as ``grpo``.
  """
  centred, degenerate = _groups(scores, mask, group_size)
  scale = group_size / (group_size - 1) if group_size > 1 else 0.0
  return _per_token(scale * centred, degenerate, mask), None


# ---------------------------------------------------------------------------------------------
# The registry: an estimator chosen by name, called the same way whatever it is
# ---------------------------------------------------------------------------------------------


class AdvantageInputs(NamedTuple):
  """What an estimator may read. N rows (B·n, groups contiguous), T response tokens."""

  scores: Array  # [N] sequence scores, adjusted (rewards.adjust_scores: clip, missing-stop)
  rewards: Array  # [N, T] token rewards r_t = −β·KL_t + score on the last token (shape_rewards)
  mask: Array  # [N, T] response mask
  values: Array | None = None  # [N, T] the critic's V(s_t); None without a critic


class AdvantageParams(NamedTuple):
  """Hyper-parameters (Python numbers, or traced scalars where noted); each estimator reads
  only its own."""

  gamma: float | Array = 1.0  # discount (gae, reinforce_pp)
  lam: float | Array = 0.95  # GAE's λ
  whiten: bool = False  # whiten GAE's advantages over the batch (trl's whiten_advantages)
  group_size: int = 1  # samples per prompt n, static (grpo, dr_grpo, rloo)
  eps: float = 1e-6  # GRPO's std offset


class Estimator(NamedTuple):
  """An advantage estimator as data: ``fn(inputs, params) → (advantages [N, T], returns [N, T]
  or None)``; ``needs_critic``: reads ``inputs.values`` and returns the critic's regression
  target (no critic is allocated where False); ``needs_groups``: compares the n samples of each
  prompt (every advantage is 0 with n = 1)."""

  fn: Callable[[AdvantageInputs, AdvantageParams], tuple[Array, Array | None]]
  needs_critic: bool
  needs_groups: bool


def _gae(x: AdvantageInputs, p: AdvantageParams):
  if x.values is None:
    raise ValueError("GAE needs the critic's values: AdvantageInputs(values=...)")
  return gae(x.rewards, x.values, x.mask, p.gamma, p.lam, whiten=p.whiten)


ESTIMATORS: dict[str, Estimator] = {
    # GAE (Schulman et al. 2016): critic V(s_t), KL shaped into the token rewards (PPO, RLHF).
    "gae": Estimator(_gae, needs_critic=True, needs_groups=False),
    # (r − mean_g)/(std_g + eps) per group of n: no critic; KL as a k3 loss term (GRPO).
    "grpo": Estimator(lambda x, p: grpo(x.scores, x.mask, p.group_size, eps=p.eps),
                      needs_critic=False, needs_groups=True),
    # r − mean_g: no critic; KL in the loss; aggregate with seq_mean_token_sum_norm (Dr. GRPO).
    "dr_grpo": Estimator(lambda x, p: dr_grpo(x.scores, x.mask, p.group_size),
                         needs_critic=False, needs_groups=True),
    # r_i − mean_{j≠i} r_j: no critic; KL in the loss (or none).
    "rloo": Estimator(lambda x, p: rloo(x.scores, x.mask, p.group_size),
                      needs_critic=False, needs_groups=True),
    # whitened discounted returns of KL-shaped token rewards: no critic, KL in the rewards.
    "reinforce_pp": Estimator(lambda x, p: reinforce_pp(x.rewards, x.mask, p.gamma),
                              needs_critic=False, needs_groups=False),
}


def estimator(name: str) -> Estimator:
  """The ``ESTIMATORS`` entry ``name`` (gae, grpo, dr_grpo, rloo, reinforce_pp); a clear
  ``ValueError`` for any other name."""
  try:
    return ESTIMATORS[name]
  except KeyError:
    raise ValueError(
        f"unknown advantage estimator {name!r}; choose one of {sorted(ESTIMATORS)}") from None
