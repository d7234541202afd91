"""Rollout + scores → experience: KL-shaped token rewards and the algorithm's advantages, and the
rollout's metrics.

    rewards             = −β·KL_t (+ score on the last response token); β = 0 here when the
                          KL goes into the loss instead
    advantages, returns = the algorithm's estimator (GAE, GRPO, …; returns None without a
                          critic)
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ppojax.core import advantages as adv_lib
from ppojax.core import correction, ops, rewards
from ppojax.core.algorithms import Algorithm
from ppojax.rollout.rollout import Rollout

Array = jax.Array


class Experience(NamedTuple):
  """What the update consumes: the rollout plus advantages and returns [B, R]."""

  rollout: Rollout
  advantages: Array
  returns: Array | None  # the critic's regression target (None: no critic)
  # β of a KL term in the loss (``rl.kl_in = "loss"``, a scalar); None: no KL in the loss
  kl_coef: Array | None = None
  # [B, R] the tokens the loss counts: the response mask less what ``rl.overlong_filter`` and
  # ``rl.reject`` take out (``loss_tokens``); None: the response mask
  loss_mask: Array | None = None


def loss_tokens(exp: Experience) -> Array:
  """The mask of the tokens the update's loss counts [B, R]."""
  return exp.rollout.mask if exp.loss_mask is None else exp.loss_mask


def take_rows(exp: Experience, idx: Array) -> Experience:
  """The rows ``idx`` of every per-row array of the experience (a shared prefix [C] belongs to
  every row and the loss's KL coefficient to the batch: they stay whole)."""
  prefix = exp.rollout.prefix
  rows = jax.tree.map(lambda x: x[idx], exp._replace(
      rollout=exp.rollout._replace(prefix=None), kl_coef=None))
  return rows._replace(rollout=rows.rollout._replace(prefix=prefix), kl_coef=exp.kl_coef)


def make_experience(r: Rollout, scores: Array, beta: Array, algorithm: Algorithm, cfg,
                    group_size: int = 1) -> tuple[Experience, dict]:
  """Rewards and the estimator's advantages from a rollout and its sequence scores [N] (of a
  multi-turn rollout: the episode's outcome plus its turns' rewards, ``step.score``; the turns'
  rewards then sit on their turns' last tokens, the rest on the last policy token).

      r_t = −β_r·KL_t + 1[t = last]·s          (``rewards.shape_rewards``; β_r = β where
                                               ``cfg.kl_in`` is "reward", else 0)
      (A, R) = estimator(s_seq = Σ_t r_t, r_t, mask, V_old)   (``advantages.ESTIMATORS``)

  A sequence estimator (GRPO, RLOO, …) reads s_seq, the token estimators (GAE, REINFORCE++)
  r_t. With ``cfg.kl_in`` "loss" the experience carries β for the loss's KL term. Without a
  reference (``r.ref_logp`` None) KL ≡ 0.

  ``cfg`` (the resolved ``ppo`` section, ``algorithms.resolve``) supplies estimator, kl_in,
  kl_estimator, missing_stop_penalty, score_clip, whiten_rewards, gamma, lam and
  whiten_advantages; ``group_size``: the samples per prompt n (rows i·n … i·n + n − 1 are
  prompt i's).
  """
  kl_in_loss = algorithm.kl_in_loss
  ref_logp = r.old_logp if r.ref_logp is None else r.ref_logp
  outcome = scores if r.turn_rewards is None else scores - episode_return(r)
  outcome, shaping = overlong_shaping(outcome, r.mask, cfg)
  loss_mask, filtered = filters(r, cfg)
  token_rewards, metrics = rewards.shape_rewards(
      outcome, r.old_logp, ref_logp, r.mask, 0.0 if kl_in_loss else beta, has_stop=r.has_stop,
      kl_estimator=algorithm.kl, score_clip=cfg.score_clip,
      missing_stop_penalty=cfg.missing_stop_penalty, whiten=cfg.whiten_rewards)
  token_rewards, metrics = add_turn_rewards(token_rewards, metrics, r)
  inputs = adv_lib.AdvantageInputs(scores=jnp.sum(token_rewards, axis=1), rewards=token_rewards,
                                   mask=r.mask, values=r.old_values)
  adv, ret = algorithm.estimate(inputs, adv_lib.AdvantageParams(
      gamma=cfg.gamma, lam=cfg.lam, whiten=cfg.whiten_advantages, group_size=group_size))
  metrics = {f"objective/{k}": v for k, v in {**metrics, **shaping}.items()}
  metrics.update(filtered)
  metrics.update(rollout_metrics(r, scores, outcome, ref_logp, algorithm, cfg, group_size))
  kl_coef = jnp.asarray(beta, jnp.float32) if kl_in_loss and r.ref_logp is not None else None
  return Experience(r, adv, ret, kl_coef, loss_mask), metrics


def add_turn_rewards(token_rewards: Array, metrics: dict, r: Rollout) -> tuple[Array, dict]:
  """Multi-turn: each turn's reward added on its last policy token, and the shaped score's
  metrics made the whole episode's; one turn: as they are."""
  if r.turn_rewards is None:
    return token_rewards, metrics
  mean_return = jnp.mean(episode_return(r))
  return token_rewards + r.turn_rewards, {
      **metrics, "scores": metrics["scores"] + mean_return,
      "rlhf_reward": metrics["rlhf_reward"] + mean_return}


def rollout_metrics(r: Rollout, raw: Array, outcome: Array, ref_logp: Array,
                    algorithm: Algorithm, cfg, group_size: int) -> dict:
  """The rollout's metrics: lengths, stops, entropy, trl GRPOTrainer's group metrics on the
  adjusted scores (``raw``: the scores as given; ``outcome``: shaped, less any turns'
  rewards), values, the sampler/learner mismatch and a multi-turn rollout's episodes."""
  scores = rewards.adjust_scores(outcome, r.has_stop, score_clip=cfg.score_clip,
                                 missing_stop_penalty=cfg.missing_stop_penalty)
  if r.turn_rewards is not None:
    scores = scores + episode_return(r)
  metrics = {
      # the sampled responses' mean Σ_t −log π(token) over response tokens (trl's
      # objective/entropy also counts −1 per padding position: its INVALID_LOGPROB)
      "objective/entropy_masked": jnp.mean(jnp.sum(-r.old_logp, axis=1)),
      "objective/scores_raw": jnp.mean(raw.astype(jnp.float32)),  # before any shaping
      "val/num_stopped": jnp.sum(r.has_stop),  # responses ending on a stop token
      "val/response_length": jnp.mean(jnp.sum(r.mask, axis=1)),
      **group_metrics(scores, algorithm.kl(r.old_logp, ref_logp), r.mask, group_size),
  }
  if r.old_values is not None:
    metrics["val/values_rollout"] = ops.masked_mean(r.old_values, r.mask)
  if r.sampler_logp is not None:  # the sampler's log-probs vs the learner's (same params)
    metrics["rollout/logp_mismatch"] = ops.masked_mean(jnp.abs(r.old_logp - r.sampler_logp),
                                                       r.mask)
  return {**metrics, **episode_metrics(r)}


def episode_return(r: Rollout) -> Array:
  """A multi-turn rollout's sum of its turns' rewards [B]."""
  return jnp.sum(r.turn_rewards, axis=1)


def episode_metrics(r: Rollout) -> dict:
  """A multi-turn rollout's per-episode means (``episode/turns``, ``episode/truncated_turns``,
  the environment's counts), ``episode/cut_off`` (the share of episodes out of turns) and
  ``episode/obs_share`` (the environment's share of the tokens seen); {} for one turn."""
  if r.episode is None:
    return {}
  out = {f"episode/{k}": jnp.mean(v.astype(jnp.float32)) for k, v in r.episode.items()}
  seen = r.seen.astype(jnp.bool_)
  out["episode/obs_share"] = (jnp.sum(seen & ~r.mask, dtype=jnp.float32)
                              / jnp.maximum(jnp.sum(seen, dtype=jnp.float32), 1.0))
  out["episode/cut_off"] = 1.0 - jnp.mean(r.has_stop.astype(jnp.float32))
  return out


def overlong_shaping(scores: Array, mask: Array, cfg) -> tuple[Array, dict]:
  """The scores plus DAPO's soft overlong penalty where ``cfg.overlong_buffer`` > 0
  (``rewards.overlong_penalty`` over the last ``overlong_buffer`` tokens before the limit)."""
  buffer = cfg.get("overlong_buffer", 0)
  if not buffer:
    return scores, {}
  penalty = rewards.overlong_penalty(jnp.sum(mask, axis=1), mask.shape[1], buffer,
                                     cfg.get("overlong_factor", 1.0))
  return scores.astype(jnp.float32) + penalty, {"overlong_penalty": jnp.mean(penalty)}


def filters(r: Rollout, cfg) -> tuple[Array | None, dict]:
  """The loss's token mask where a filter is on (None otherwise) and its metrics: the rows
  dynamic sampling left out (``Rollout.in_loss``); ``rl.overlong_filter`` drops responses cut
  off by the length limit (no stop token; DAPO's overlong filtering), ``rl.reject`` the tokens
  or responses whose sampler/learner ratio leaves [``reject_low``, ``reject_high``]
  (``correction.rejection_mask``)."""
  keep, metrics = r.mask.astype(jnp.bool_), {}
  if r.in_loss is not None:  # dynamic sampling's fill (``step.keep_groups``)
    keep = keep & r.in_loss[:, None]
    metrics["rollout/rows_in_loss"] = jnp.mean(r.in_loss.astype(jnp.float32))
  if cfg.get("overlong_filter", False):
    keep = keep & r.has_stop[:, None]
    metrics["rollout/overlong_filtered"] = 1.0 - jnp.mean(r.has_stop.astype(jnp.float32))
  if cfg.get("reject", ""):
    kept, rejected = correction.rejection_mask(r.old_logp, r.sampler_logp, r.mask,
                                               cfg.reject_low, cfg.reject_high, cfg.reject)
    keep = keep & kept
    metrics.update({f"rollout/{k}": v for k, v in rejected.items()})
  return (keep if metrics else None), metrics


def group_metrics(scores: Array, kl: Array, mask: Array, group_size: int) -> dict[str, Array]:
  """trl GRPOTrainer's names for what it logs: ``reward`` (mean score), ``kl`` (mean per-token
  KL over response tokens), ``completion_length`` (mean tokens); with groups (n > 1)
  ``reward_std`` (the mean over groups of the scores' std, Bessel-corrected) and
  ``frac_reward_zero_std`` (the share of groups whose scores are all equal: no signal)."""
  out = {"reward": jnp.mean(scores), "kl": ops.masked_mean(kl, mask),
         "completion_length": jnp.mean(jnp.sum(mask, axis=1).astype(jnp.float32))}
  if group_size > 1:
    groups = scores.reshape(-1, group_size)
    std = jnp.std(groups, axis=1, ddof=1)
    out.update(reward_std=jnp.mean(std), frac_reward_zero_std=jnp.mean(
        (jnp.max(groups, axis=1) == jnp.min(groups, axis=1)).astype(jnp.float32)))
  return out
