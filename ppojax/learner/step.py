"""The RL iteration over a ``TrainState``, composed from pure functions and compiled: PPO and
its critic-free cousins (GRPO, Dr. GRPO, RLOO, REINFORCE++) are the same step with another
estimator, KL placement and aggregation (``ppojax.core.algorithms``), read from the config once.

    key → k_sample, k_update
    rollout    = sample n responses per prompt, old / ref log-probs, values (experience.rollout)
    scores     = reward model, JAX reward function, or Python reward function
    experience = −β·KL_t shaping (+ score on the last token), the estimator's advantages
                 (GAE, group-relative, …)                         (experience.make_experience)
    update     = E epochs × M shuffled minibatches (lax.scan), each the sum of K micro-batch
                 gradients (lax.scan), clipped by global norm, Adam with warmup + decay
                 (E·M·K = 1: one step at the rollout's params, whose forward pass also gives
                 the old values and log-probs: ``single_pass``)
    β          = KL controller update
    guard      = every optimizer step taken only where scores, advantages and its own losses
                 and gradient norms are finite (a lax.cond); any non-finite: KL controller and
                 step stay, only the key advances (``skipped/nonfinite`` = 1)

The records (``TrainState``, ``Frozen``, ``Models``, ``Context``) live in ``ppojax.learner.state``, the
update (losses, gradients with micro-batch accumulation, optimizer steps, the non-finite
checks) in ``ppojax.learner.update``; both are re-exported here.

Without a critic (an estimator that needs none) the state holds no critic parameters or
optimizer state and no value pass runs; without a KL penalty (β = 0) no reference is held and
no reference pass runs.

With a JAX reward (a reward model or a jnp rule) all of it is one jit-compiled function
(``Step.fused``). A Python reward (e.g. one that parses decoded text) splits it into two
compiled halves with one host round trip: ``rollout`` → host scores → ``learn``. Both paths
derive the same PRNG keys from ``state.key`` and give the same result.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ppojax.core import kl as kl_lib
from ppojax.core.algorithms import Algorithm
from ppojax.data.batch import Prompts
from ppojax.infra import sharding
from ppojax.learner.experience import make_experience

# re-exported: ``step_lib.TrainState``, ``step_lib.update``, ... keep working
from ppojax.learner.state import Frozen, Models, Params, TrainState, critic_params, policy_params
from ppojax.learner.update import (
  all_finite,
  experience_checks,
  finite_checks,
  single_pass,
  single_pass_update,
  update,
)
from ppojax.models import lora
from ppojax.models.passes import map_rows, model_scores
from ppojax.rollout.rollout import Rollout, rollout
from ppojax.rollout.sampling import SamplingConfig

Array = jax.Array


def kl_controller(cfg) -> kl_lib.KLController:
  if cfg.adaptive_kl:
    return kl_lib.adaptive_kl_controller(cfg.kl_coef, cfg.target_kl, cfg.kl_horizon)
  return kl_lib.fixed_kl_controller(cfg.kl_coef)


def needs_reference(cfg) -> bool:
  """Whether the KL penalty needs a reference policy (else KL ≡ 0 and none is held)."""
  return cfg.kl_coef > 0 or cfg.adaptive_kl


def init_state(key: Array, actor: Params, critic: Params | None, actor_tx, critic_tx, cfg,
               base: Params | None = None) -> TrainState:
  """The state before the first iteration; ``critic`` None: no critic and no critic optimizer
  state; ``base`` (LoRA): the frozen base beside the adapters ``actor``, the only trained and
  optimised parameters."""
  return TrainState(
      actor=actor, critic=critic, actor_opt=actor_tx.init(actor),
      critic_opt=None if critic is None else critic_tx.init(critic),
      kl=kl_controller(cfg).init(), step=jnp.zeros((), jnp.int32), key=key, base=base)


def forward_micro_batches(cfg, mesh: jax.sharding.Mesh | None = None) -> int:
  """In how many parts the rollout's forward passes (old and reference log-probs, values,
  reward model) run (``experience.map_rows``): ``cfg.forward_micro_batches``, or where that is
  0, the update's micro-batches per batch (num_minibatches × grad_accum; 1 for a
  ``single_pass`` update), lowered to the largest divisor whose parts still split evenly over
  the mesh's batch devices. Fewer rows per pass: less activation memory, the same numbers."""
  k = cfg.get("forward_micro_batches", 0)
  if k:
    return k
  if single_pass(cfg):
    return 1
  batch, k = cfg.batch_size, cfg.num_minibatches * cfg.grad_accum
  devices = 1 if mesh is None else math.prod(mesh.shape[a] for a in sharding.BATCH)
  return max(d for d in range(1, k + 1) if k % d == 0 and batch % (d * devices) == 0)


class Step(NamedTuple):
  """The compiled pieces of one PPO iteration.

  * ``fused(state, frozen, prompts) → (state, metrics, rollout, scores)``: the whole
    iteration, one compiled function (JAX rewards only; None with a Python reward).
  * ``rollout(state, frozen, prompts) → Rollout``, ``score(frozen, rollout) → scores [B]``
    (compiled, or the Python reward on host arrays), ``learn(state, rollout, scores) →
    (state, metrics)``: the same iteration in three parts, for a Python reward or for timing
    the phases.
  """

  fused: Callable | None
  rollout: Callable
  score: Callable
  learn: Callable


def _keys(state: TrainState):
  """(next state key, sampling key, update key): the same split in every path."""
  return tuple(jax.random.split(state.key, 3))


def make_step(models: Models, algorithm: Algorithm, actor_tx, critic_tx,
              actor_schedule: optax.Schedule, sampling: SamplingConfig, cfg, *,
              python_reward: Callable | None = None, state_shardings=None,
              mesh: jax.sharding.Mesh | None = None) -> Step:
  """Builds the compiled step of ``algorithm`` (``algorithms.from_config``); ``cfg`` is the
  ``rl`` config section (its numbers).

  Where the algorithm needs no critic ``models.critic`` is ignored, and the state must have none (``init_state(..., critic=None, ...)``).
  ``python_reward(rollout_on_host) → scores [B]`` receives the rollout as NumPy arrays;
  ``state_shardings`` (a TrainState of shardings) pins the state's layout across steps, and
  the gradients' to the parameters';
  ``mesh``: the functions are traced under it, so that the models keep every activation's rows
  on the batch axes (``sharding.shard_rows``).
  """
  if not algorithm.needs_critic:  # the state's critic must be None too
    models = dataclasses.replace(models, critic=None)
  elif models.critic is None:
    raise ValueError("the algorithm's estimator needs a critic: give Models.critic")
  controller = kl_controller(cfg)
  group_size = sampling.num_samples_per_prompt
  sources = [models.reward, models.reward_fn, python_reward]
  if sum(x is not None for x in sources) != 1:
    raise ValueError("give exactly one reward: Models.reward (a reward model), Models.reward_fn "
                     "(a JAX rule) or python_reward (a host function)")

  one_pass = single_pass(cfg, models.policy.cfg.lora_dropout)
  micro_batches = forward_micro_batches(cfg, mesh)
  grad_shardings = None if state_shardings is None else (state_shardings.actor,
                                                         state_shardings.critic)
  old_logp = cfg.get("old_logprobs", "recompute")
  if one_pass and old_logp == "recompute":
    old_logp = None  # not in the rollout: the update's own forward pass at the same params

  with_reference = needs_reference(cfg)

  def do_rollout(state: TrainState, frozen: Frozen, prompts: Prompts) -> Rollout:
    _, k_sample, _ = _keys(state)
    actor, ref, sampler_params = state.actor, frozen.reference, None
    if state.base is not None:  # LoRA: the base is the reference; sample from merged weights
      actor = policy_params(state.actor, state.base)
      ref = state.base if with_reference else None
      sampler_params = lora.merge(actor, models.policy.cfg)
    return rollout(models.policy, models.critic, actor, ref,
                   critic_params(state.critic, models, state.base),
                   prompts, k_sample, sampling, old_logp=old_logp, old_values=not one_pass,
                   sampler=models.sampler, micro_batches=micro_batches,
                   reference=models.reference, sampler_params=sampler_params)

  def do_score(frozen: Frozen, r: Rollout) -> Array:
    args = (r.prompts, r.prompt_mask, r.responses, r.mask)
    if models.reward is not None:
      return map_rows(functools.partial(model_scores, models.reward, frozen.reward), args,
                      micro_batches, r.prefix)
    return models.reward_fn(*args).astype(jnp.float32)

  def learn_with_rollout(state: TrainState, r: Rollout, scores: Array
                         ) -> tuple[TrainState, dict, Rollout]:
    """(state, metrics, the rollout with old log-probs and values filled in)."""
    next_key, _, k_update = _keys(state)
    lr = actor_schedule(_opt_count(state.actor_opt))
    if one_pass:  # params and optimizer states stepped only where all is finite (a cond)
      new, exp, exp_metrics, upd = single_pass_update(
          models, actor_tx, critic_tx, state, r, scores, algorithm, cfg, sampling.temperature,
          grad_shardings, group_size)
    else:  # each optimizer step a cond on its own finiteness (and the experience's)
      exp, exp_metrics = make_experience(r, scores, state.kl.beta, algorithm, cfg, group_size)
      ok_before = all_finite(list(experience_checks(scores, exp).values()))
      new, upd = update(models, actor_tx, critic_tx, state, exp, k_update, algorithm, cfg,
                        sampling.temperature, ok_before, grad_shardings)
    ok, flags = finite_checks(scores, exp, upd)
    # A non-finite iteration leaves the KL controller and the step as they were and the
    # next iteration samples anew; its non-finite optimizer steps were not taken.
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)  # noqa
    metrics = {**exp_metrics, **{f"{k}_avg": v for k, v in upd.items()},
               "clip_ratio": upd["policy/clipfrac"],  # trl GRPOTrainer's name
               "objective/kl_coef": state.kl.beta, "lr": lr, **flags}
    kl_state = controller.update(state.kl, exp_metrics["objective/kl"], scores.shape[0])
    new = new._replace(kl=keep(kl_state, state.kl), step=keep(state.step + 1, state.step))
    return new._replace(key=next_key), metrics, exp.rollout

  def do_learn(state: TrainState, r: Rollout, scores: Array) -> tuple[TrainState, dict]:
    return learn_with_rollout(state, r, scores)[:2]

  def fused(state, frozen, prompts):
    r = do_rollout(state, frozen, prompts)
    scores = do_score(frozen, r)
    state, metrics, r = learn_with_rollout(state, r, scores)
    return state, metrics, r, scores

  def under_mesh(fn):
    if mesh is None:
      return fn

    @functools.wraps(fn)
    def traced(*args):
      with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        return fn(*args)
    return traced

  out = None if state_shardings is None else (state_shardings, None)
  learn = jax.jit(under_mesh(do_learn), donate_argnums=0, out_shardings=out)
  rollout_fn = jax.jit(under_mesh(do_rollout))
  if python_reward is not None:
    def score(frozen, r):
      del frozen
      return jnp.asarray(np.asarray(python_reward(sharding.to_host(r)), np.float32))
    return Step(fused=None, rollout=rollout_fn, score=score, learn=learn)
  fused_out = None if out is None else (state_shardings, None, None, None)
  return Step(fused=jax.jit(under_mesh(fused), donate_argnums=0, out_shardings=fused_out),
                 rollout=rollout_fn,
                 score=jax.jit(under_mesh(do_score)), learn=learn)


def _opt_count(opt_state) -> Array:
  """The optimizer step count inside an optax state (the schedule's argument)."""
  counts = optax.tree_utils.tree_get_all_with_path(opt_state, "count")
  return counts[0][1] if counts else jnp.zeros((), jnp.int32)
