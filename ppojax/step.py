"""The PPO iteration as one compiled function: rollout → experience → E×M clipped updates.

The step is generic in the models: it sees them only through ``Models``, four pure functions of
parameter pytrees and arrays. Top to bottom:

    tokens        = sample(actor, key)                       [B, R]
    mask          = response mask from the first stop token  (pad == eos safe)
    old/ref logp  = selective_log_softmax(logits(actor|ref, tokens) / T)
    values        = value(critic, tokens);  scores = score(tokens, mask)
    rewards       = −β·KL_t (+ score on the last response token)
    A, R          = GAE (reverse lax.scan), A whitened
    for E epochs, M shuffled minibatches (lax.scan):  Adam on L_clip + c_v·L_V − c_H·H
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax

from ppojax import advantages as adv_lib
from ppojax import kl as kl_lib
from ppojax import losses, ops, rewards

Array = jax.Array
Params = Any


class Models(NamedTuple):
  """The model functions the step composes (all pure, all jit-able)."""

  sample: Callable[[Params, Array, int, float], Array]  # (actor, key, batch, temperature) → [B, R]
  logits: Callable[[Params, Array], Array]  # (actor, tokens [B, R]) → logits of tokens [B, R, V]
  value: Callable[[Params, Array], Array]  # (critic, tokens) → V(s_t) before token t [B, R]
  score: Callable[[Array, Array], Array]  # (tokens, mask) → sequence scores [B]


class TrainState(NamedTuple):
  actor: Params
  critic: Params
  actor_opt: optax.OptState
  critic_opt: optax.OptState
  kl: kl_lib.KLControllerState
  step: Array
  key: Array


class Experience(NamedTuple):
  """One rollout's arrays, all [B, R]."""

  tokens: Array
  mask: Array
  old_logp: Array
  ref_logp: Array
  old_values: Array
  advantages: Array
  returns: Array


def kl_controller(cfg: ml_collections.ConfigDict) -> kl_lib.KLController:
  if cfg.adaptive_kl:
    return kl_lib.adaptive_kl_controller(cfg.kl_coef, cfg.target_kl, cfg.kl_horizon)
  return kl_lib.fixed_kl_controller(cfg.kl_coef)


def init_state(key, actor, critic, actor_tx, critic_tx, cfg) -> TrainState:
  return TrainState(
      actor=actor, critic=critic, actor_opt=actor_tx.init(actor), critic_opt=critic_tx.init(critic),
      kl=kl_controller(cfg).init(), step=jnp.zeros((), jnp.int32), key=key)


def make_experience(models: Models, ref_actor: Params, state: TrainState, key: Array, cfg):
  """Rollout and everything computed from it once per iteration (no gradients)."""
  tokens = models.sample(state.actor, key, cfg.batch_size, cfg.temperature)
  mask = ops.response_mask(tokens, cfg.stop_ids)
  has_stop = ops.has_stop_token(tokens, cfg.stop_ids)
  tokens = ops.truncate_after_stop(tokens, cfg.stop_ids, cfg.pad_id)
  old_logp = ops.selective_log_softmax(models.logits(state.actor, tokens), tokens, cfg.temperature)
  ref_logp = ops.selective_log_softmax(models.logits(ref_actor, tokens), tokens, cfg.temperature)
  old_values = models.value(state.critic, tokens)
  scores = models.score(tokens, mask)
  token_rewards, reward_metrics = rewards.shape_rewards(
      scores, old_logp, ref_logp, mask, state.kl.beta, has_stop=has_stop,
      kl_estimator=cfg.kl_estimator, missing_stop_penalty=cfg.missing_stop_penalty)
  advantages, returns = adv_lib.gae(
      token_rewards, old_values, mask, cfg.gamma, cfg.lam, whiten=cfg.whiten_advantages)
  exp = Experience(tokens, mask, old_logp, ref_logp, old_values, advantages, returns)
  metrics = {f"objective/{k}": v for k, v in reward_metrics.items()}
  metrics["val/num_eos_tokens"] = jnp.sum(has_stop)
  metrics["objective/response_length"] = jnp.mean(jnp.sum(mask, axis=1))
  return exp, metrics


def ppo_minibatch_loss(params, models: Models, mb: Experience, cfg):
  actor, critic = params
  logits = models.logits(actor, mb.tokens)
  logp = ops.selective_log_softmax(logits, mb.tokens, cfg.temperature)
  entropy = ops.entropy_from_logits(logits, cfg.temperature)
  values = models.value(critic, mb.tokens)
  return losses.ppo_loss(
      logp, mb.old_logp, mb.advantages, values, mb.old_values, mb.returns, mb.mask, entropy,
      vf_coef=cfg.vf_coef, ent_coef=cfg.ent_coef, clip_eps=cfg.clip_eps,
      value_clip=cfg.value_clip, aggregation=cfg.aggregation)


def update(models: Models, actor_tx, critic_tx, state: TrainState, exp: Experience, key, cfg):
  """E epochs × M shuffled minibatches of Adam steps, as one ``lax.scan``."""
  batch = cfg.batch_size
  mb_size = batch // cfg.num_minibatches
  perms = jax.vmap(lambda k: jax.random.permutation(k, batch))(
      jax.random.split(key, cfg.num_epochs))
  indices = perms.reshape(cfg.num_epochs * cfg.num_minibatches, mb_size)

  def mb_step(carry, idx):
    actor, critic, actor_opt, critic_opt = carry
    mb = jax.tree.map(lambda x: x[idx], exp)
    grads, metrics = jax.grad(ppo_minibatch_loss, has_aux=True)((actor, critic), models, mb, cfg)
    a_upd, actor_opt = actor_tx.update(grads[0], actor_opt, actor)
    c_upd, critic_opt = critic_tx.update(grads[1], critic_opt, critic)
    carry = (optax.apply_updates(actor, a_upd), optax.apply_updates(critic, c_upd),
             actor_opt, critic_opt)
    return carry, metrics

  init = (state.actor, state.critic, state.actor_opt, state.critic_opt)
  (actor, critic, actor_opt, critic_opt), metrics = jax.lax.scan(mb_step, init, indices)
  state = state._replace(actor=actor, critic=critic, actor_opt=actor_opt, critic_opt=critic_opt)
  return state, jax.tree.map(jnp.mean, metrics)


def make_train_step(models: Models, ref_actor: Params, actor_tx, critic_tx, cfg):
  """Returns ``train_step(state) -> (state, metrics)``: one whole PPO iteration, jit-compiled."""
  controller = kl_controller(cfg)

  def train_step(state: TrainState):
    key, k_sample, k_update = jax.random.split(state.key, 3)
    exp, exp_metrics = make_experience(models, ref_actor, state, k_sample, cfg)
    state, upd_metrics = update(models, actor_tx, critic_tx, state, exp, k_update, cfg)
    kl_state = controller.update(state.kl, exp_metrics["objective/kl"], cfg.batch_size)
    metrics = {**exp_metrics, **{f"{k}_avg": v for k, v in upd_metrics.items()},
               "objective/kl_coef": state.kl.beta}
    state = state._replace(kl=kl_state, step=state.step + 1, key=key)
    return state, metrics

  return jax.jit(train_step, donate_argnums=0)
