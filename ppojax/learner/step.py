"""One RL iteration over a ``TrainState``, compiled. PPO, GRPO, Dr. GRPO, RLOO, REINFORCE++, GSPO
and CISPO are this same step with another ``Algorithm`` record (``core.algorithms``); it never
asks which.

    key        → next key, k_sample, k_update
    rollout    = n responses per prompt, old / reference log-probs, values  (``rollout``)
    scores     = reward model, JAX reward function, or a host function      (``score``)
    groups     = with dynamic sampling, B of the sampled groups             (``keep_groups``)
    experience = r_t = −β·KL_t (+ score on the last token) or KL in the loss,
                 (A, R) = algorithm.estimate(...), the loss's token mask    (``learn``)
    update     = E epochs × M minibatches × K micro-batches, clipped loss, Adam; with
                 E·M·K = 1 the update's own forward pass gives the old log-probs and values
    checks     = an iteration with a non-finite score, advantage, loss or gradient norm keeps
                 its KL controller and step (``skipped/nonfinite`` = 1); only the key advances

With a JAX reward the whole iteration is one compiled function (``Step.fused``); a host reward
splits it into ``rollout`` → host scores → ``learn``, with the same keys and results. Without a
critic (the algorithm needs none) no critic exists; without a KL penalty no reference does.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ppojax.core import selection
from ppojax.core.algorithms import Algorithm
from ppojax.data.batch import Prompts
from ppojax.infra import sharding
from ppojax.learner.state import (Frozen, Models, TrainState, critic_params, kl_controller,
                                  needs_reference, policy_params)
from ppojax.learner.experience import episode_return
from ppojax.learner.update import finite_checks, single_pass, update
from ppojax.models import lora
from ppojax.models.passes import map_rows, model_scores
from ppojax.rollout.rollout import Rollout, attended, passes_on, sample, sample_on_host
from ppojax.rollout.sampling import SamplingConfig

Array = jax.Array


class Plan(NamedTuple):
  """What one step is built from; static: nothing here is traced."""

  models: Models
  algorithm: Algorithm
  actor_tx: optax.GradientTransformation
  critic_tx: optax.GradientTransformation
  actor_schedule: optax.Schedule
  sampling: SamplingConfig
  cfg: Any  # the rl config section (its numbers)
  reuse_forward: bool  # E·M·K = 1: the update's forward pass gives old log-probs and values
  old_logp: str | None  # the rollout's log π_old: "recompute", "sampler", None (the update's)
  micro_batches: int  # parts of the rollout's forward passes (``forward_micro_batches``)
  grad_shardings: tuple | None  # (actor, critic) parameter layouts the gradients keep
  host_env: Any = None  # an environment on the host (``host_turns.HostEnv``)


def rollout_of(plan: Plan, state: TrainState, frozen: Frozen, prompts: Prompts) -> Rollout:
  """Responses to ``prompts`` (with a traced environment: whole episodes) and their log-probs
  and values (LoRA: sampled from the merged weights, the base as the reference)."""
  _, k_sample, _ = _keys(state)
  gen = sample(sampler_module(plan), sampler_params(plan, state), prompts, k_sample,
               plan.sampling, plan.models.env)
  return passes_of(plan, state, frozen, prompts, gen)


def sampler_module(plan: Plan):
  """The module that samples: the policy's, or ``Models.sampler`` (another dtype; LoRA's base
  architecture)."""
  return plan.models.policy if plan.models.sampler is None else plan.models.sampler


def sampler_params(plan: Plan, state: TrainState):
  """The sampler's params: the actor's, with LoRA its adapters merged into the base."""
  if state.base is None:
    return state.actor
  return lora.merge(policy_params(state.actor, state.base), plan.models.policy.cfg)


def passes_of(plan: Plan, state: TrainState, frozen: Frozen, prompts: Prompts, gen) -> Rollout:
  """The ``Rollout`` of a generation: old and reference log-probs, values (``passes_on``)."""
  m, actor, reference = plan.models, state.actor, frozen.reference
  if state.base is not None:
    actor = policy_params(state.actor, state.base)
    reference = state.base if needs_reference(plan.cfg) else None
  return passes_on(m.policy, m.critic, actor, reference,
                   critic_params(state.critic, m, state.base), prompts, gen, plan.sampling,
                   plan.old_logp, not plan.reuse_forward, plan.micro_batches, m.reference)


def host_rollout(plan: Plan, params_fn, passes_fn, state: TrainState, frozen: Frozen,
                 prompts: Prompts, records: list[dict] | None = None) -> Rollout:
  """``rollout_of`` with the environment on the host (``host_turns``: one round trip per turn
  for the batch, counted per row in ``episode["host_round_trips"]``); ``params_fn`` and
  ``passes_fn``: ``sampler_params`` and ``passes_of`` compiled."""
  _, k_sample, _ = _keys(state)
  gen, trips = sample_on_host(sampler_module(plan), params_fn(state), prompts, k_sample,
                              plan.sampling, plan.host_env, records)
  episode = {**gen.episode, "host_round_trips": jnp.full(gen.done.shape, trips, jnp.int32)}
  return passes_fn(state, frozen, prompts, gen._replace(episode=episode))


def score(plan: Plan, frozen: Frozen, r: Rollout) -> Array:
  """Scores [B]: the reward model at each response's last token (of a multi-turn trajectory:
  its last token seen), or the JAX reward rule; a multi-turn episode's score is that outcome
  plus its turns' rewards (``experience.episode_return``)."""
  args = (r.prompts, r.prompt_mask, r.responses, r.mask)
  if plan.models.reward is not None:
    args = args[:3] + (attended(r),)
    scores = map_rows(functools.partial(model_scores, plan.models.reward, frozen.reward), args,
                      plan.micro_batches, r.prefix)
  else:
    scores = plan.models.reward_fn(*args).astype(jnp.float32)
  return with_turn_rewards(r, scores)


def with_turn_rewards(r: Rollout, scores: Array) -> Array:
  """The step's scores [B]: an outcome score, plus a multi-turn episode's turn rewards (every
  reward path, traced or on the host, hands ``learn`` the whole episode's)."""
  scores = jnp.asarray(scores, jnp.float32)
  return scores if r.turn_rewards is None else scores + episode_return(r)


def learn(plan: Plan, state: TrainState, r: Rollout, scores: Array
          ) -> tuple[TrainState, dict, Rollout, Array]:
  """(state, metrics, the rollout learned from with old log-probs and values filled in, its
  scores): the groups kept, experience, update, checks, KL controller."""
  r, scores, kept = keep_groups(plan, r, scores)
  next_key, _, k_update = _keys(state)
  lr = plan.actor_schedule(_opt_count(state.actor_opt))
  new, exp, exp_metrics, upd = update(
      plan.models, plan.algorithm, plan.actor_tx, plan.critic_tx, state, r, scores, k_update,
      plan.cfg, plan.sampling.temperature, reuse_forward=plan.reuse_forward,
      shardings=plan.grad_shardings, group_size=plan.sampling.num_samples_per_prompt)
  ok, flags = finite_checks(scores, exp, upd)
  keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)  # noqa
  metrics = {**exp_metrics, **kept, **{f"{k}_avg": v for k, v in upd.items()},
             "clip_ratio": upd["policy/clipfrac"],  # trl GRPOTrainer's name
             "objective/kl_coef": state.kl.beta, "lr": lr, **flags}
  kl_state = kl_controller(plan.cfg).update(state.kl, exp_metrics["objective/kl"],
                                            scores.shape[0])
  new = new._replace(kl=keep(kl_state, state.kl), step=keep(state.step + 1, state.step))
  return new._replace(key=next_key), metrics, exp.rollout, scores


def keep_groups(plan: Plan, r: Rollout, scores: Array) -> tuple[Rollout, Array, dict]:
  """Dynamic sampling (``rl.dynamic_sampling``): the rows of ``rl.batch_size`` of the sampled
  groups, those with a spread of scores first, the fill's rows out of the loss
  (``selection.select_groups``, ``Rollout.in_loss``), and their scores; else all as they are."""
  if not plan.cfg.get("dynamic_sampling", False):
    return r, scores, {}
  rows, in_loss, metrics = selection.select_groups(
      scores, plan.sampling.num_samples_per_prompt, plan.cfg.batch_size)
  kept = jax.tree.map(lambda x: x[rows], r._replace(prefix=None))
  return (kept._replace(prefix=r.prefix, in_loss=in_loss), scores[rows],
          {f"rollout/{k}": v for k, v in metrics.items()})


def iteration(plan: Plan, state: TrainState, frozen: Frozen, prompts: Prompts):
  """The whole iteration: (state, metrics, rollout, scores)."""
  r = rollout_of(plan, state, frozen, prompts)
  scores = score(plan, frozen, r)
  return learn(plan, state, r, scores)


class Step(NamedTuple):
  """The compiled pieces of one iteration: ``fused(state, frozen, prompts) → (state, metrics,
  rollout, scores)`` (None with a host reward); ``rollout(state, frozen, prompts)``,
  ``score(frozen, rollout) → [B]`` and ``learn(state, rollout, scores) → (state, metrics)``:
  the same iteration in three parts (a host reward, or timing the phases)."""

  fused: Callable | None
  rollout: Callable
  score: Callable
  learn: Callable
  host_turns: bool = False  # ``rollout`` is ``host_rollout``: it also takes the batch's records


def make_step(models: Models, algorithm: Algorithm, actor_tx, critic_tx,
              actor_schedule: optax.Schedule, sampling: SamplingConfig, cfg, *,
              python_reward: Callable | None = None, state_shardings=None,
              mesh: jax.sharding.Mesh | None = None, host_env=None) -> Step:
  """The compiled step of ``algorithm``; ``cfg``: the rl config section.
  ``python_reward(rollout on host) → scores [B]``: a host reward; ``state_shardings`` pins the
  state's layout (and the gradients'); ``mesh``: traced under it (activations' rows on the
  batch axes); ``host_env``: an environment on the host (``host_turns.HostEnv``): the rollout
  is then a Python loop of compiled turns (``host_rollout``, which also takes the batch's
  records). Without ``algorithm.needs_critic`` the state must have no critic."""
  plan = _plan(models, algorithm, actor_tx, critic_tx, actor_schedule, sampling, cfg,
               python_reward, state_shardings, mesh, host_env)
  out = None if state_shardings is None else (state_shardings, None)
  compiled = lambda fn, **kw: jax.jit(_under(mesh, functools.partial(fn, plan)), **kw)  # noqa
  learn_fn = compiled(lambda p, s, r, x: learn(p, s, r, x)[:2], donate_argnums=0,
                      out_shardings=out)
  rollout_fn = compiled(rollout_of)
  if host_env is not None:
    rollout_fn = functools.partial(host_rollout, plan, compiled(sampler_params),
                                   compiled(passes_of))
  if python_reward is not None or host_env is not None:
    def host_score(frozen, r):
      del frozen
      return with_turn_rewards(r, np.asarray(python_reward(sharding.to_host(r)), np.float32))
    return Step(None, rollout_fn, host_score if python_reward else compiled(score), learn_fn,
                host_env is not None)
  fused_out = None if out is None else (state_shardings, None, None, None)
  return Step(compiled(iteration, donate_argnums=0, out_shardings=fused_out),
              compiled(rollout_of), compiled(score), learn_fn)


def _plan(models, algorithm, actor_tx, critic_tx, actor_schedule, sampling, cfg, python_reward,
          state_shardings, mesh, host_env=None) -> Plan:
  """The ``Plan``, after checking the models against the algorithm and the reward."""
  if not algorithm.needs_critic:  # the state's critic must be None too
    models = dataclasses.replace(models, critic=None)
  elif models.critic is None:
    raise ValueError("the algorithm's estimator needs a critic: give Models.critic")
  rewards = sum(x is not None for x in (models.reward, models.reward_fn, python_reward))
  if not rewards and (models.env is not None or host_env is not None):
    models = dataclasses.replace(models, reward_fn=_no_score)  # the environment's rewards
  elif rewards != 1:
    raise ValueError("give exactly one reward: Models.reward (a reward model), Models.reward_fn "
                     "(a JAX rule) or python_reward (a host function); with an environment, "
                     "none (its rewards) or one")
  reuse = single_pass(cfg, models.policy.cfg.lora_dropout)
  old_logp = cfg.get("old_logprobs", "recompute")
  grads = None if state_shardings is None else (state_shardings.actor, state_shardings.critic)
  return Plan(models, algorithm, actor_tx, critic_tx, actor_schedule, sampling, cfg, reuse,
              None if reuse and old_logp == "recompute" else old_logp,
              forward_micro_batches(cfg, mesh), grads, host_env)


def _no_score(prompts, prompt_mask, responses, mask) -> Array:
  """0 for every row: the outcome score of a run whose environment gives all the reward."""
  del prompts, prompt_mask, mask
  return jnp.zeros(responses.shape[:1], jnp.float32)


def forward_micro_batches(cfg, mesh: jax.sharding.Mesh | None = None) -> int:
  """Parts the rollout's forward passes run in: ``cfg.forward_micro_batches``, or where that is
  0 the update's micro-batches per batch (M × K; 1 for a single-pass update), lowered to the
  largest divisor whose parts split evenly over the mesh's batch devices."""
  k = cfg.get("forward_micro_batches", 0)
  if k:
    return k
  if single_pass(cfg):
    return 1
  batch = selection.sampled_prompts(cfg.batch_size, cfg.get("oversample", 1.0))
  k = cfg.num_minibatches * cfg.grad_accum
  devices = 1 if mesh is None else math.prod(mesh.shape[a] for a in sharding.BATCH)
  return max(d for d in range(1, k + 1) if k % d == 0 and batch % (d * devices) == 0)


def _under(mesh, fn):
  """``fn`` traced under ``mesh``'s abstract mesh (None: as it is)."""
  if mesh is None:
    return fn

  def traced(*args):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return fn(*args)
  return traced


def _keys(state: TrainState):
  """(next state key, sampling key, update key): the same split in every path."""
  return tuple(jax.random.split(state.key, 3))


def _opt_count(opt_state) -> Array:
  """The optimizer step count inside an optax state (the schedule's argument)."""
  counts = optax.tree_utils.tree_get_all_with_path(opt_state, "count")
  return counts[0][1] if counts else jnp.zeros((), jnp.int32)
