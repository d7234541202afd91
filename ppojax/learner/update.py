"""The update: E epochs × M shuffled minibatches, each one optimizer step per model on the sum
of K micro-batch gradients, every step guarded by the finiteness of what it read.

    update = for e < E, m < M:  g = Σ_k w_k·∇L(rows_k)  (w_k: the micro-batch's share of the
                                minibatch loss),  θ ← Adam(clip(g))  if all finite
    E·M·K = 1 and ``reuse_forward``: the one step's own forward pass also gives the old
             log-probs and values, and the experience is built inside its gradient
             (``loss.own_forward_loss``): one actor and one critic forward pass fewer
    ``rl.pack_fractions`` (f_1 < … < f_k): each gradient over the micro-batch's sequences
             packed into the fewest ⌈f_i·n⌉ rows that hold them, else padded; over the
             minibatches, a sequence with no token in the loss takes no slot
             (``loss.packed_or_padded``)

The guard: every optimizer step is a ``lax.cond`` on the finiteness of the scores, the
advantages (on the mask) and its own losses and gradient norms (``finite_checks``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from ppojax.core import ops
from ppojax.core.algorithms import Algorithm
from ppojax.core.optim import accumulate
from ppojax.infra import sharding
from ppojax.learner.experience import Experience, loss_tokens, make_experience, take_rows
from ppojax.learner.loss import (
  AGGREGATED,
  actor_forward,
  critic_forward,
  loss_on,
  own_forward_loss,
  packed_or_padded,
)
from ppojax.learner.state import Context, Models, TrainState
from ppojax.models import lora
from ppojax.models.packing import Packing
from ppojax.rollout.rollout import Rollout

Array = jax.Array
NONFINITE_CHECKS = ("scores", "advantages", "loss", "grad_norm")


def update(models: Models, algorithm: Algorithm, actor_tx, critic_tx, state: TrainState,
           r: Rollout, scores: Array, key: Array, cfg, temperature: float, *,
           reuse_forward: bool = False, shardings=None, group_size: int = 1
           ) -> tuple[TrainState, Experience, dict, dict]:
  """(state, experience, experience metrics, update metrics averaged over the E·M steps) of
  the rollout ``r`` and its scores [B]. ``reuse_forward`` (``single_pass(cfg)``): the rollout
  holds no old values (nor, maybe, old log-probs) and the one step's forward pass gives them.
  ``shardings``: the (actor, critic) parameters' layout, which the gradients keep."""
  if reuse_forward:
    return _own_forward_step(models, algorithm, actor_tx, critic_tx, state, r, scores, cfg,
                             temperature, shardings, group_size)
  exp, exp_metrics = make_experience(r, scores, state.kl.beta, algorithm, cfg, group_size)
  ok = all_finite(list(experience_checks(scores, exp).values()))
  state, metrics = _minibatch_steps(models, algorithm, actor_tx, critic_tx, state, exp, key,
                                    cfg, temperature, ok, shardings)
  return state, exp, exp_metrics, metrics


def single_pass(cfg, lora_dropout: float = 0.0) -> bool:
  """Whether the update is one step on the whole batch at the rollout's params (E·M·K = 1)
  whose forward pass may give the old values and log-probs (``rl.reuse_update_forward``);
  never with LoRA dropout (the old log-probs and values must be without it)."""
  return bool(cfg.get("reuse_update_forward", True)) and not lora_dropout and (
      cfg.num_epochs * cfg.num_minibatches * cfg.grad_accum == 1)


def _minibatch_steps(models: Models, algorithm: Algorithm, actor_tx, critic_tx,
                     state: TrainState, exp: Experience, key: Array, cfg, temperature: float,
                     ok: Array | bool, shardings) -> tuple[TrainState, dict]:
  """E epochs of M shuffled minibatches (a ``lax.scan``), each step taken where ``ok`` and its
  own losses and gradient norms are finite. LoRA dropout draws each step's masks from its own
  key (``lora.dropout_keys``), split again per micro-batch."""
  batch = exp.advantages.shape[0]
  e, m, k = cfg.num_epochs, cfg.num_minibatches, cfg.grad_accum
  perms = jax.vmap(lambda kk: jax.random.permutation(kk, batch))(jax.random.split(key, e))
  indices = perms.reshape(e * m, k, batch // (m * k))
  dropout_keys = lora.dropout_keys(key, e * m) if models.policy.cfg.lora_dropout else None

  def step(carry, xs):
    (actor, critic), (idx, dropout_key) = carry[:2], xs
    grads, metrics = _minibatch_grads((actor, critic), models, exp, idx, algorithm, cfg,
                                      temperature, shardings, Context(state.base, dropout_key))
    metrics = {**metrics, **_grad_norms(grads)}
    take = ok & all_finite([v for name, v in metrics.items() if name.startswith("loss/")
                            or name.endswith("grad_norm")])
    carry = jax.lax.cond(take, lambda c: _apply_grads(actor_tx, critic_tx, c, grads),
                         lambda c: c, carry)
    return carry, metrics

  carry = (state.actor, state.critic, state.actor_opt, state.critic_opt)
  (actor, critic, actor_opt, critic_opt), metrics = jax.lax.scan(
      step, carry, (indices, dropout_keys))
  state = state._replace(actor=actor, critic=critic, actor_opt=actor_opt, critic_opt=critic_opt)
  return state, jax.tree.map(jnp.mean, metrics)


def _micro_weight(micro_mask: Array, minibatch_mask: Array, aggregation: str) -> Array:
  """A micro-batch's share of its minibatch's loss, so that Σ_k w_k·L_k is the minibatch loss:
  its count of the aggregation's units over the minibatch's (``ops.aggregation_count``)."""
  return ops.aggregation_count(micro_mask, aggregation) / jnp.maximum(
      ops.aggregation_count(minibatch_mask, aggregation), 1)


def _minibatch_grads(params, models: Models, exp: Experience, idx: Array, algorithm: Algorithm,
                     cfg, temperature, shardings=None, ctx: Context = Context()):
  """Gradient and metrics of the minibatch ``idx`` [K, n], summed over its K micro-batches
  (a ``lax.scan``) and laid out as ``shardings``; a dropout key is split per micro-batch."""
  mb_mask = loss_tokens(exp)[idx.reshape(-1)]

  def grad_fn(params, models, part, algorithm, cfg, temperature, ctx):  # packed where it pays
    def grads(packed):
      g, metrics = jax.grad(loss_on, has_aux=True)(params, models, part, algorithm, cfg,
                                                   temperature, ctx, packed)
      return sharding.constrain(g, shardings), metrics
    (g, metrics), packing_metrics = packed_or_padded(grads, part.rollout, cfg,
                                                     loss_tokens(part))
    return g, {**metrics, **packing_metrics}

  def micro(xs):  # (w·g, metrics weighted to add up to the minibatch's)
    micro_idx, key = xs
    part = take_rows(exp, micro_idx)
    w = _micro_weight(loss_tokens(part), mb_mask, algorithm.aggregation)
    w_tokens = _micro_weight(loss_tokens(part), mb_mask, "token_mean")
    g, metrics = grad_fn(params, models, part, algorithm, cfg, temperature,
                         ctx._replace(dropout_key=key))
    # losses and the entropy bonus add up with the aggregation's weights, token means by tokens
    metrics = {k: (w if k.startswith(AGGREGATED) else w_tokens) * v for k, v in metrics.items()}
    return jax.tree.map(lambda x: w * x, g), metrics

  if idx.shape[0] == 1:  # no accumulation buffer
    return grad_fn(params, models, take_rows(exp, idx[0]), algorithm, cfg, temperature, ctx)
  keys = None if ctx.dropout_key is None else jax.random.split(ctx.dropout_key, idx.shape[0])
  zeros = sharding.constrain(jax.tree.map(jnp.zeros_like, params), shardings)
  grads, metrics = accumulate(micro, zeros, (idx, keys))
  return grads, jax.tree.map(lambda m: jnp.sum(m, axis=0), metrics)


def _own_forward_step(models: Models, algorithm: Algorithm, actor_tx, critic_tx,
                      state: TrainState, r: Rollout, scores: Array, cfg, temperature: float,
                      shardings, group_size: int) -> tuple[TrainState, Experience, dict, dict]:
  """The ``reuse_forward`` update: one gradient of ``own_forward_loss``, the critic's backward
  pass and step after the actor's (``lax.optimization_barrier``: the two gradients are never
  alive together), each step a ``lax.cond``; over packed rows where they fit
  (``packed_or_padded``).

      (log π, H), vjp_π = vjp(actor_forward, θ);  V, vjp_V = vjp(critic_forward, φ)
      θ ← Adam(vjp_π(∂L/∂(log π, H)))   if experience, loss and ∇θ are finite
      φ ← Adam(vjp_V(∂L/∂V))            if those and ∇φ are finite"""
  def step(packed):
    return _own_forward_body(models, algorithm, actor_tx, critic_tx, state, r, scores, cfg,
                             temperature, shardings, group_size, packed)
  (state, exp, exp_metrics, metrics), packing_metrics = packed_or_padded(step, r, cfg)
  return state, exp, exp_metrics, {**metrics, **packing_metrics}


def _own_forward_body(models: Models, algorithm: Algorithm, actor_tx, critic_tx,
                      state: TrainState, r: Rollout, scores: Array, cfg, temperature: float,
                      shardings, group_size: int, packed: Packing | None
                      ) -> tuple[TrainState, Experience, dict, dict]:
  """``_own_forward_step`` on the padded rows (``packed`` None) or the packed ones."""
  actor_shardings, critic_shardings = (None, None) if shardings is None else shardings
  ctx = Context(state.base)  # no dropout: these log-probs and values are also the old ones
  (logp, entropy), actor_vjp = jax.vjp(
      lambda a: actor_forward(a, models, r, temperature, cfg.ent_coef, ctx, packed), state.actor)
  values = None
  if state.critic is not None:
    values, critic_vjp = jax.vjp(lambda c: critic_forward(c, models, r, ctx, packed),
                                 state.critic)
  (d_logp, d_entropy, d_values), (metrics, exp, exp_metrics) = jax.grad(
      own_forward_loss, has_aux=True)((logp, entropy, values), r, scores, state.kl.beta,
                                      algorithm, cfg, group_size)
  ok = all_finite([*experience_checks(scores, exp).values(),
                   *(v for k, v in metrics.items() if k.startswith("loss/"))])
  g_actor = sharding.constrain(actor_vjp((d_logp, d_entropy))[0], actor_shardings)
  metrics = {**metrics, "policy/grad_norm": optax.tree.norm(g_actor)}
  ok = ok & jnp.isfinite(metrics["policy/grad_norm"])
  actor, actor_opt = _guarded(actor_tx, state.actor, state.actor_opt, g_actor, ok)
  state = state._replace(actor=actor, actor_opt=actor_opt)
  if state.critic is None:
    return state, exp, exp_metrics, metrics
  d_values, actor, actor_opt = jax.lax.optimization_barrier((d_values, actor, actor_opt))
  g_critic = sharding.constrain(critic_vjp(d_values)[0], critic_shardings)
  metrics["val/grad_norm"] = optax.tree.norm(g_critic)
  critic, critic_opt = _guarded(critic_tx, state.critic, state.critic_opt, g_critic,
                                ok & jnp.isfinite(metrics["val/grad_norm"]))
  state = state._replace(actor=actor, critic=critic, actor_opt=actor_opt, critic_opt=critic_opt)
  return state, exp, exp_metrics, metrics


def _grad_norms(grads) -> dict:
  """The actor's and (where there is one) the critic's gradient norms, before clipping."""
  g_actor, g_critic = grads
  norms = {"policy/grad_norm": optax.tree.norm(g_actor)}
  if g_critic is not None:
    norms["val/grad_norm"] = optax.tree.norm(g_critic)
  return norms


def _apply_one(tx, params, opt, grads) -> tuple:
  """One optimizer step of one model: (params, opt); no model (None): nothing."""
  if params is None:
    return params, opt
  updates, opt = tx.update(grads, opt, params)
  return optax.apply_updates(params, updates), opt


def _apply_grads(actor_tx, critic_tx, params_and_opts, grads) -> tuple:
  """One optimizer step of actor and critic: (actor, critic, actor_opt, critic_opt)."""
  actor, critic, actor_opt, critic_opt = params_and_opts
  g_actor, g_critic = grads
  actor, actor_opt = _apply_one(actor_tx, actor, actor_opt, g_actor)
  critic, critic_opt = _apply_one(critic_tx, critic, critic_opt, g_critic)
  return actor, critic, actor_opt, critic_opt


def _guarded(tx, params, opt, grads, take) -> tuple:
  """``_apply_one`` where ``take``, else (params, opt) unchanged (a ``lax.cond``)."""
  return jax.lax.cond(take, lambda p, o: _apply_one(tx, p, o, grads), lambda p, o: (p, o),
                      params, opt)


def all_finite(xs) -> Array:
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in xs]))


def experience_checks(scores: Array, exp: Experience) -> dict[str, Array]:
  """Whether scores and advantages (on the response mask only) are finite."""
  return {"scores": all_finite([scores]),
          "advantages": all_finite([jnp.where(exp.rollout.mask, exp.advantages, 0.0)])}


def finite_checks(scores: Array, exp: Experience, upd: dict) -> tuple[Array, dict]:
  """(all finite, metrics): ``nonfinite/{scores,advantages,loss,grad_norm}`` 1.0 where that
  held a NaN or Inf (advantages on the mask only; losses and norms are the update's means, so
  one bad minibatch counts), and ``skipped/nonfinite`` 1.0 when any did."""
  checks = {
      **experience_checks(scores, exp),
      "loss": all_finite([v for k, v in upd.items() if k.startswith("loss/")]),
      "grad_norm": all_finite([v for k, v in upd.items() if k.endswith("grad_norm")]),
  }
  ok = jnp.all(jnp.stack(list(checks.values())))
  metrics = {f"nonfinite/{k}": 1.0 - v.astype(jnp.float32) for k, v in checks.items()}
  metrics["skipped/nonfinite"] = 1.0 - ok.astype(jnp.float32)
  return ok, metrics
