"""The update half of an RL iteration: the loss on (a slice of) the experience, its gradients
and the optimizer steps, with the non-finite guard. ``ppojax.learner.step`` composes it after the
rollout, the scores and the experience.

    update             = E epochs × M shuffled minibatches (lax.scan), each one optimizer step
                         on the sum of K micro-batch gradients (lax.scan, ``_minibatch_grads``),
                         each micro-batch weighted by its share of the loss (``_micro_weight``)
    single_pass_update = E·M·K = 1 (``single_pass``): one step at the rollout's params, whose
                         forward pass also gives the old values and log-probs
                         (``single_pass_loss``); the critic's backward pass after the actor's step
    guard              = every optimizer step a ``lax.cond`` on the finiteness of the scores,
                         advantages and its own losses and gradient norms (``experience_checks``,
                         ``finite_checks``)

The forward passes (``actor_forward``, ``critic_forward``) take the trained parameters and a
``Context`` (LoRA's frozen base, the dropout key); without a critic its pass returns None and
no value term enters the loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from ppojax.core import losses, ops
from ppojax.core.algorithms import Algorithm
from ppojax.infra import sharding
from ppojax.learner.experience import Experience, make_experience, take_rows
from ppojax.learner.state import Context, Models, TrainState, critic_params, policy_params
from ppojax.models import lora
from ppojax.models.passes import head_logprobs, response_hidden, response_values
from ppojax.rollout.rollout import Rollout

Array = jax.Array


# ---------------------------------------------------------------------------------------------
# The loss: forward passes of actor and critic, the clipped PPO loss
# ---------------------------------------------------------------------------------------------

# The loss metrics that are aggregated with ``cfg.aggregation`` (every other one is a token mean)
AGGREGATED = ("loss/", "policy/entropy_masked")


def _micro_weight(micro_mask: Array, minibatch_mask: Array, aggregation: str) -> Array:
  """The share of a micro-batch in its minibatch's loss, so that Σ_k w_k·L_k is exactly the
  minibatch loss: its count of the aggregation's units (tokens for token_mean, non-empty rows
  for the sequence means) over the minibatch's (``ops.aggregation_count``)."""
  return ops.aggregation_count(micro_mask, aggregation) / jnp.maximum(
      ops.aggregation_count(minibatch_mask, aggregation), 1)


def actor_forward(actor, models: Models, r: Rollout, temperature: float, ent_coef: float,
                  ctx: Context = Context()) -> tuple[Array, Array]:
  """The update's policy pass over prompt + response: (log π_T(response_t), entropy_t), each
  [B, R], at the sampling ``temperature``. The entropy carries a gradient only when
  ``ent_coef`` is non-zero (otherwise it is a metric). ``ctx``: LoRA's frozen base (then
  ``actor`` holds the adapters) and dropout key (``Context``)."""
  args = (r.prompts, r.prompt_mask, r.responses, r.mask, r.prefix)
  actor = policy_params(actor, ctx.base)
  hidden = response_hidden(models.policy, actor, *args,
                           rngs=lora.dropout_rngs(models.policy, ctx.dropout_key, 0))
  logp, entropy = head_logprobs(models.policy, actor, hidden, r.responses, temperature,
                                entropy=True, chunk_size=None)
  return logp, entropy if ent_coef else jax.lax.stop_gradient(entropy)


def critic_forward(critic, models: Models, r: Rollout, ctx: Context = Context()
                   ) -> Array | None:
  """The update's critic pass: V(s_t) [B, R], 0 off the mask (None without a critic); a LoRA
  critic's adapters get the policy's dropout, with a key of their own."""
  if models.critic is None:
    return None
  critic = critic_params(critic, models, ctx.base)
  return response_values(models.critic, critic, r.prompts, r.prompt_mask, r.responses, r.mask,
                          r.prefix, rngs=lora.dropout_rngs(models.critic, ctx.dropout_key, 1))


def update_forward(params, models: Models, r: Rollout, temperature: float, ent_coef: float,
                   ctx: Context = Context()) -> tuple[Array, Array, Array]:
  """(log π_T(response_t), entropy_t, V(s_t)), each [B, R]: ``actor_forward`` and
  ``critic_forward``."""
  actor, critic = params
  return (*actor_forward(actor, models, r, temperature, ent_coef, ctx),
          critic_forward(critic, models, r, ctx))


def _clipped_loss(logp, entropy, values, exp: Experience, algorithm: Algorithm, cfg
                  ) -> tuple[Array, dict]:
  """The PPO loss (without a value term where ``values`` is None, with a KL term where the
  experience carries its β), each token's policy term weighted by the truncated importance
  ratio π_old/π_sampler (``losses.truncated_is_weight``) when ``cfg.tis_cap`` is set."""
  r = exp.rollout
  weight, tis = None, {}
  if cfg.get("tis_cap") is not None:
    weight, tis = losses.truncated_is_weight(r.old_logp, r.sampler_logp, r.mask, cfg.tis_cap)
    tis = {f"policy/{k}": v for k, v in tis.items() if k != "mismatch"}
  loss, metrics = losses.ppo_loss(
      logp, r.old_logp, exp.advantages, values, r.old_values, exp.returns, r.mask, entropy,
      vf_coef=cfg.vf_coef, ent_coef=cfg.ent_coef, clip_eps=cfg.clip_eps,
      clip_eps_low=cfg.get("clip_eps_low"), clip_eps_high=cfg.get("clip_eps_high"),
      dual_clip=cfg.dual_clip, value_clip=cfg.value_clip, aggregation=algorithm.aggregation,
      max_len=r.mask.shape[1], is_weight=weight,  # seq_mean_token_sum_norm's constant: R
      ref_logp=None if exp.kl_coef is None else r.ref_logp, kl_coef=exp.kl_coef,
      kl_estimator=algorithm.kl)
  return loss, {**metrics, **tis}


def ppo_loss_on(params, models: Models, exp: Experience, algorithm: Algorithm, cfg,
                temperature: float, ctx: Context = Context()) -> tuple[Array, dict]:
  """The clipped PPO loss of actor and critic on (a slice of) the experience; log-probs and
  entropy at the sampling ``temperature`` (with LoRA dropout where ``ctx`` has a key: the old
  log-probs it is compared with are the sampling policy's, without)."""
  logp, entropy, values = update_forward(params, models, exp.rollout, temperature, cfg.ent_coef,
                                         ctx)
  return _clipped_loss(logp, entropy, values, exp, algorithm, cfg)


def single_pass_loss(outputs, r: Rollout, scores: Array, beta: Array, algorithm: Algorithm, cfg,
                     group_size: int = 1) -> tuple[Array, tuple[dict, Experience, dict]]:
  """The clipped PPO loss when the update is one gradient step at the rollout's own params
  (``single_pass``), as a function of that step's forward outputs (log π_θ, H, V_θ)
  (``update_forward``): V_old(s_t) — and log π_old where ``r.old_logp`` is None — are those
  outputs under stop_gradient, then rewards, GAE and the loss follow as usual.

      V_old = sg(V_θ),  log π_old = sg(log π_θ),  (A, R) = GAE(sg(·)),  L = L_PPO(θ; A, R)

  The value and the gradient equal those of a separate rollout forward followed by the update
  (same params, so the same numbers up to float rounding): everything the rollout would have
  given is a constant of θ here too. Aux: (loss metrics, experience, experience metrics)."""
  logp, entropy, values = outputs
  old_logp = r.old_logp if r.old_logp is not None else jnp.where(r.mask, logp, 0.0)
  r = r._replace(old_logp=jax.lax.stop_gradient(old_logp),  # values: 0 off the mask (or None)
                 old_values=None if values is None else jax.lax.stop_gradient(values))
  exp, exp_metrics = make_experience(r, scores, beta, algorithm, cfg, group_size)
  loss, metrics = _clipped_loss(logp, entropy, values, exp, algorithm, cfg)
  return loss, (metrics, exp, exp_metrics)

# ---------------------------------------------------------------------------------------------
# Minibatch gradients (K micro-batches) and optimizer steps: the scanned update
# ---------------------------------------------------------------------------------------------

def _minibatch_grads(params, models: Models, exp: Experience, idx: Array, algorithm: Algorithm,
                     cfg, temperature, shardings=None, ctx: Context = Context()):
  """Gradient and metrics of the minibatch ``idx`` [K, n], summed over its K micro-batches;
  the gradients laid out as ``shardings`` (the parameters'; both pairs are (actor, critic or
  None)). A dropout key in ``ctx`` is split into one per micro-batch."""
  mb_mask = exp.rollout.mask[idx.reshape(-1)]

  def grad_fn(*args):
    g, metrics = jax.grad(ppo_loss_on, has_aux=True)(*args)
    return sharding.constrain(g, shardings), metrics

  def micro(grads, xs):
    micro_idx, key = xs
    part = take_rows(exp, micro_idx)
    w = _micro_weight(part.rollout.mask, mb_mask, algorithm.aggregation)
    w_tokens = _micro_weight(part.rollout.mask, mb_mask, "token_mean")
    g, metrics = grad_fn(params, models, part, algorithm, cfg, temperature,
                         ctx._replace(dropout_key=key))
    # the aggregated quantities (losses, the entropy bonus) add up with the aggregation's
    # weights, the token means (clip fractions, ratios, approx. KL, value error) with tokens'
    metrics = {k: (w if k.startswith(AGGREGATED) else w_tokens) * v for k, v in metrics.items()}
    return jax.tree.map(jnp.add, grads, jax.tree.map(lambda x: w * x, g)), metrics

  if idx.shape[0] == 1:  # no accumulation buffer
    return grad_fn(params, models, take_rows(exp, idx[0]), algorithm, cfg, temperature, ctx)
  keys = None if ctx.dropout_key is None else jax.random.split(ctx.dropout_key, idx.shape[0])
  zeros = sharding.constrain(jax.tree.map(jnp.zeros_like, params), shardings)
  grads, metrics = jax.lax.scan(micro, zeros, (idx, keys))
  return grads, jax.tree.map(lambda m: jnp.sum(m, axis=0), metrics)


def _grad_norms(grads) -> dict:
  """The actor's and (where there is one) the critic's gradient norms (before clipping)."""
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


def _params_and_opts(state: TrainState) -> tuple:
  return state.actor, state.critic, state.actor_opt, state.critic_opt


def _with_params(state: TrainState, params_and_opts) -> TrainState:
  actor, critic, actor_opt, critic_opt = params_and_opts
  return state._replace(actor=actor, critic=critic, actor_opt=actor_opt, critic_opt=critic_opt)


def update(models: Models, actor_tx, critic_tx, state: TrainState, exp: Experience, key: Array,
           algorithm: Algorithm, cfg, temperature: float, ok: Array | bool = True,
           shardings=None) -> tuple[TrainState, dict]:
  """E epochs of M shuffled minibatches, each one optimizer step on the sum of K micro-batch
  gradients; metrics are averaged over the E·M steps.

  Each step is a ``lax.cond``: taken where ``ok`` (the experience is finite) and the step's own
  losses and gradient norms are finite, skipped otherwise; no copy of the old state is kept.

  LoRA dropout (p > 0): each step draws its masks from its own key (``lora.dropout_keys``),
  split again per micro-batch; with p = 0 nothing is drawn: the update without dropout."""
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

  carry, metrics = jax.lax.scan(step, _params_and_opts(state), (indices, dropout_keys))
  return _with_params(state, carry), jax.tree.map(jnp.mean, metrics)


# ---------------------------------------------------------------------------------------------
# The single-pass update: E·M·K = 1
# ---------------------------------------------------------------------------------------------


def single_pass(cfg, lora_dropout: float = 0.0) -> bool:
  """Whether the update is one gradient step on the whole batch at the rollout's params (1
  epoch × 1 minibatch × 1 micro-batch) and ``rl.reuse_update_forward`` lets it take the old
  values (and, with ``rl.old_logprobs = "recompute"``, the old log-probs) from its own forward
  pass instead of a rollout forward (``single_pass_loss``): one critic forward pass (and one
  policy forward pass) fewer per iteration, the same iteration up to float rounding.

  Never with LoRA dropout (``lora_dropout`` > 0): the update's forward pass then drops out,
  and the old log-probs and values must be the sampling policy's, without."""
  return bool(cfg.get("reuse_update_forward", True)) and not lora_dropout and (
      cfg.num_epochs * cfg.num_minibatches * cfg.grad_accum == 1)


def single_pass_update(models: Models, actor_tx, critic_tx, state: TrainState, r: Rollout,
                       scores: Array, algorithm: Algorithm, cfg, temperature: float,
                       shardings=None, group_size: int = 1) -> tuple[TrainState, Experience, dict, dict]:
  """The update of a ``single_pass`` config: one gradient of ``single_pass_loss`` on the whole
  batch and one optimizer step per model, the critic's after the actor's:

      (log π, H), vjp_π = vjp(actor_forward, θ);  V, vjp_V = vjp(critic_forward, φ)
      ∂L/∂(log π, H, V) = grad(single_pass_loss)
      θ ← Adam(vjp_π(∂L/∂ log π, ∂L/∂H))          taken if experience, loss and ∇θ are finite
      φ ← Adam(vjp_V(∂L/∂V))   (after θ's step)    taken if those and ∇φ are finite

  The critic's backward pass waits for the actor's step (``lax.optimization_barrier``), so the
  two float32 gradients are never alive together (for Llama-3.1-8B on 16 chips, 1.9 GiB per
  chip saved); each step is a ``lax.cond``, so no old state is copied to survive it. Without a
  critic only the actor's half runs. Returns (state, experience, experience metrics, update
  metrics)."""
  actor_shardings, critic_shardings = (None, None) if shardings is None else shardings
  ctx = Context(state.base)  # no dropout: these log-probs and values are also the old ones
  (logp, entropy), actor_vjp = jax.vjp(
      lambda a: actor_forward(a, models, r, temperature, cfg.ent_coef, ctx), state.actor)
  values = None
  if state.critic is not None:
    values, critic_vjp = jax.vjp(lambda c: critic_forward(c, models, r, ctx), state.critic)
  (d_logp, d_entropy, d_values), (metrics, exp, exp_metrics) = jax.grad(
      single_pass_loss, has_aux=True)((logp, entropy, values), r, scores, state.kl.beta,
                                      algorithm, cfg, group_size)
  ok = all_finite([*experience_checks(scores, exp).values(),
                   *(v for k, v in metrics.items() if k.startswith("loss/"))])

  def step(tx, params, opt, grads, take):
    return jax.lax.cond(take, lambda p, o: _apply_one(tx, p, o, grads), lambda p, o: (p, o),
                        params, opt)

  g_actor = sharding.constrain(actor_vjp((d_logp, d_entropy))[0], actor_shardings)
  actor_norm = optax.tree.norm(g_actor)
  ok = ok & jnp.isfinite(actor_norm)
  actor, actor_opt = step(actor_tx, state.actor, state.actor_opt, g_actor, ok)
  metrics = {**metrics, "policy/grad_norm": actor_norm}
  state = state._replace(actor=actor, actor_opt=actor_opt)
  if state.critic is None:
    return state, exp, exp_metrics, metrics
  d_values, actor, actor_opt = jax.lax.optimization_barrier((d_values, actor, actor_opt))
  g_critic = sharding.constrain(critic_vjp(d_values)[0], critic_shardings)
  critic_norm = optax.tree.norm(g_critic)
  critic, critic_opt = step(critic_tx, state.critic, state.critic_opt, g_critic,
                            ok & jnp.isfinite(critic_norm))
  metrics["val/grad_norm"] = critic_norm
  state = state._replace(actor=actor, critic=critic, actor_opt=actor_opt, critic_opt=critic_opt)
  return state, exp, exp_metrics, metrics

# ---------------------------------------------------------------------------------------------
# The non-finite guard
# ---------------------------------------------------------------------------------------------

NONFINITE_CHECKS = ("scores", "advantages", "loss", "grad_norm")


def all_finite(xs) -> Array:
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in xs]))


def experience_checks(scores: Array, exp: Experience) -> dict[str, Array]:
  """Whether scores and advantages (on the response mask only) are finite: known before any
  optimizer step."""
  return {"scores": all_finite([scores]),
          "advantages": all_finite([jnp.where(exp.rollout.mask, exp.advantages, 0.0)])}


def finite_checks(scores: Array, exp: Experience, upd: dict) -> tuple[Array, dict]:
  """(all finite, metrics) of one iteration: ``nonfinite/{scores,advantages,loss,grad_norm}``
  are 1.0 where that quantity held a NaN or Inf (advantages on the response mask only: padding
  never counts), and ``skipped/nonfinite`` is 1.0 when any did, i.e. when the update (or, with
  several minibatches, a step of it) was skipped.
  Losses and gradient norms are the update's means over its minibatches, so one non-finite
  minibatch makes them non-finite."""
  checks = {
      **experience_checks(scores, exp),
      "loss": all_finite([v for k, v in upd.items() if k.startswith("loss/")]),
      "grad_norm": all_finite([v for k, v in upd.items() if k.endswith("grad_norm")]),
  }
  ok = jnp.all(jnp.stack(list(checks.values())))
  metrics = {f"nonfinite/{k}": 1.0 - v.astype(jnp.float32) for k, v in checks.items()}
  metrics["skipped/nonfinite"] = 1.0 - ok.astype(jnp.float32)
  return ok, metrics
