"""The update's loss: the forward passes of actor and critic over prompt + response, and the
clipped loss on (a slice of) the experience.

    (log π_θ, H, V_φ) = forward(θ, φ; prompt + response)         (``update_forward``)
    L = L_clip(log π_θ; log π_old, A) + c_V·L_V(V_φ; V_old, R) − c_H·H (+ β·agg(KL_t))
                                                              (``losses.ppo_loss``)

``loss_on`` reads a precomputed experience; ``own_forward_loss`` builds it from the outputs of
the same forward pass (the single-pass update: one step at the rollout's own params).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from ppojax.core import correction, losses
from ppojax.core.algorithms import Algorithm
from ppojax.learner.experience import Experience, loss_tokens, make_experience
from ppojax.learner.state import Context, Models, critic_params, policy_params
from ppojax.models import lora, packing
from ppojax.models.packing import Packing, unpack
from ppojax.models.passes import (
  head_logprobs,
  packed_hidden,
  packed_values,
  response_hidden,
  response_values,
  sequence,
)
from ppojax.rollout.rollout import Rollout, attended

Array = jax.Array

# The loss metrics aggregated with the algorithm's aggregation (every other one: a token mean)
AGGREGATED = ("loss/", "policy/entropy_masked")


def actor_forward(actor, models: Models, r: Rollout, temperature: float, ent_coef: float,
                  ctx: Context = Context(), packed: Packing | None = None
                  ) -> tuple[Array, Array]:
  """(log π_T(response_t), entropy_t), each [B, R], at the sampling ``temperature``; the
  entropy carries a gradient only where ``ent_coef`` ≠ 0. ``ctx``: LoRA's frozen base (then
  ``actor`` holds the adapters) and dropout key. ``packed``: the rows packed
  (``packed_or_padded``; model and head run on the packed slots, both 0 off the mask)."""
  actor = policy_params(actor, ctx.base)
  rngs = lora.dropout_rngs(models.policy, ctx.dropout_key, 0)
  if packed is None:
    args = (r.prompts, r.prompt_mask, r.responses, attended(r), r.prefix)
    hidden, targets = response_hidden(models.policy, actor, *args, rngs=rngs), r.responses
  else:
    hidden, targets = packed_hidden(models.policy, actor, packed, r.prefix, rngs), packed.targets
  logp, entropy = head_logprobs(models.policy, actor, hidden, targets, temperature,
                                entropy=True, chunk_size=None)
  if packed is not None:
    logp, entropy = unpack(logp, packed, attended(r)), unpack(entropy, packed, attended(r))
  if r.seen is not None:  # multi-turn: the environment's tokens have no log-prob
    logp, entropy = jnp.where(r.mask, logp, 0.0), jnp.where(r.mask, entropy, 0.0)
  return logp, entropy if ent_coef else jax.lax.stop_gradient(entropy)


def critic_forward(critic, models: Models, r: Rollout, ctx: Context = Context(),
                   packed: Packing | None = None) -> Array | None:
  """V(s_t) [B, R], 0 off the mask (None without a critic); a LoRA critic's adapters get the
  policy's dropout, with a key of their own. ``packed``: as ``actor_forward``'s."""
  if models.critic is None:
    return None
  critic = critic_params(critic, models, ctx.base)
  rngs = lora.dropout_rngs(models.critic, ctx.dropout_key, 1)
  if packed is not None:
    values = packed_values(models.critic, critic, packed, attended(r), r.prefix, rngs)
  else:
    values = response_values(models.critic, critic, r.prompts, r.prompt_mask, r.responses,
                             attended(r), r.prefix, rngs=rngs)
  return values if r.seen is None else jnp.where(r.mask, values, 0.0)


def update_forward(params, models: Models, r: Rollout, temperature: float, ent_coef: float,
                   ctx: Context = Context(), packed: Packing | None = None
                   ) -> tuple[Array, Array, Array]:
  """(log π_T(response_t), entropy_t, V(s_t)), each [B, R], of params = (actor, critic)."""
  actor, critic = params
  return (*actor_forward(actor, models, r, temperature, ent_coef, ctx, packed),
          critic_forward(critic, models, r, ctx, packed))


def packed_or_padded(fn: Callable[[Packing | None], Any], r: Rollout, cfg,
                     loss_mask: Array | None = None) -> tuple[Any, dict]:
  """(``fn(packing)``, packing metrics): with ``cfg.pack_fractions`` = (f_1 < … < f_k) the rows
  of ``r`` (n of them) packed into the fewest ⌈f_i·n⌉ rows (``models.packing``) that hold them,
  ``fn(None)`` (the padded rows) where none does, chosen at run time for each micro-batch.
  ``loss_mask`` [n, R] (where the experience is known before the forward pass): a row with no
  token in the loss (dynamic sampling's fill, a filtered response) takes no slot, and ``fn``
  gets 0 for its outputs, which the loss never reads:

      i* = min {i : first-fit of the n sequences into ⌈f_i·n⌉ rows succeeds}   (else padded)

  A ``lax.switch``: all k + 1 branches are compiled, one runs (``fn`` should hold the whole
  gradient, so that no residual crosses the branches; the memory is the largest branch's).
  Only the placements (``packing.first_fit``, a scan over n lengths) run for every shape; the
  chosen branch alone lays its rows out. First-fit decreasing never fails with more rows where
  it fit with fewer, so i* is the cheapest packed shape of the list. Metrics:
  ``update/packed`` (1: a packed shape ran), ``update/pack_rows`` (the rows that ran / n: f_i*,
  1 when padded) and ``update/pack_fill`` (their real-token share). () (off): ``fn(None)``."""
  fractions = tuple(cfg.get("pack_fractions", ()))
  if not fractions:
    return fn(None), {}
  tokens, mask, positions = sequence(r.prompts, r.prompt_mask, r.responses, attended(r),
                                    r.prefix)
  if loss_mask is not None:
    mask = mask & jnp.any(loss_mask, axis=1, keepdims=True)
  n, t = tokens.shape
  counts = sorted({packing.packed_rows(n, f) for f in fractions})
  lengths = jnp.sum(mask, axis=1)
  placements = [packing.first_fit(lengths, c, t) for c in counts]
  index = jnp.argmax(jnp.stack([fits for _, _, fits in placements] + [jnp.bool_(True)]))
  branches = [lambda _, c=c, p=p: fn(packing.pack(tokens, mask, positions, r.responses.shape[1],
                                                  c, p))
              for c, p in zip(counts, placements)] + [lambda _: fn(None)]
  out = jax.lax.switch(index, branches, None)
  rows = jnp.asarray(counts + [n], jnp.float32)[index]  # [n]: the padded branch
  return out, {"update/packed": (index < len(counts)).astype(jnp.float32),
               "update/pack_rows": rows / n,
               "update/pack_fill": jnp.sum(mask, dtype=jnp.float32) / (rows * t)}


def clipped_loss(logp, entropy, values, exp: Experience, algorithm: Algorithm, cfg
                 ) -> tuple[Array, dict]:
  """``losses.ppo_loss`` of the forward outputs on ``exp`` over its loss tokens
  (``experience.loss_tokens``; no value term where ``values`` is None, a KL term where the
  experience carries its β), each token's policy term weighted by the truncated ratio
  min(π_old/π_sampler, ``cfg.tis_cap``), per token or per sequence (``cfg.tis_level``;
  ``correction.is_weight``) where a cap is set. The weights are taken over the whole response
  mask, so a sequence's is its ratio π_old(y)/π_sampler(y) even where ``rl.reject`` took some
  of its tokens out of the loss (verl's ``rollout_corr_helper`` does the same)."""
  r, mask = exp.rollout, loss_tokens(exp)
  weight, tis = None, {}
  if cfg.get("tis_cap") is not None:
    weight, tis = correction.is_weight(r.old_logp, r.sampler_logp, r.mask, cfg.tis_cap,
                                       cfg.get("tis_level", "token"))
    tis = {f"policy/{k}": v for k, v in tis.items() if k != "mismatch"}
  loss, metrics = losses.ppo_loss(
      logp, r.old_logp, exp.advantages, values, r.old_values, exp.returns, mask, entropy,
      vf_coef=cfg.vf_coef, ent_coef=cfg.ent_coef, clip_eps=cfg.clip_eps,
      clip_eps_low=cfg.get("clip_eps_low"), clip_eps_high=cfg.get("clip_eps_high"),
      dual_clip=cfg.dual_clip, value_clip=cfg.value_clip, aggregation=algorithm.aggregation,
      max_len=r.mask.shape[1], is_weight=weight,  # seq_mean_token_sum_norm's constant: R
      ref_logp=None if exp.kl_coef is None else r.ref_logp, kl_coef=exp.kl_coef,
      kl_estimator=algorithm.kl, surrogate=algorithm.surrogate)
  return loss, {**metrics, **tis}


def loss_on(params, models: Models, exp: Experience, algorithm: Algorithm, cfg,
            temperature: float, ctx: Context = Context(), packed: Packing | None = None
            ) -> tuple[Array, dict]:
  """The clipped loss of actor and critic on (a slice of) a precomputed experience (with LoRA
  dropout where ``ctx`` has a key: the old log-probs are the sampling policy's, without)."""
  logp, entropy, values = update_forward(params, models, exp.rollout, temperature, cfg.ent_coef,
                                         ctx, packed)
  return clipped_loss(logp, entropy, values, exp, algorithm, cfg)


def own_forward_loss(outputs, r: Rollout, scores: Array, beta: Array, algorithm: Algorithm,
                     cfg, group_size: int = 1) -> tuple[Array, tuple[dict, Experience, dict]]:
  """The clipped loss as a function of one forward pass's outputs (log π_θ, H, V_θ) at the
  rollout's own params: the old values (and log-probs where ``r.old_logp`` is None) are those
  outputs under stop_gradient, and the experience is built from them.

      V_old = sg(V_θ),  log π_old = sg(log π_θ),  (A, R) = estimate(sg(·)),  L = L(θ; A, R)

  Value and gradient equal a rollout forward followed by the update, up to float rounding.
  Aux: (loss metrics, experience, experience metrics)."""
  logp, entropy, values = outputs
  old_logp = r.old_logp if r.old_logp is not None else jnp.where(r.mask, logp, 0.0)
  r = r._replace(old_logp=jax.lax.stop_gradient(old_logp),  # values: 0 off the mask (or None)
                 old_values=None if values is None else jax.lax.stop_gradient(values))
  exp, exp_metrics = make_experience(r, scores, beta, algorithm, cfg, group_size)
  loss, metrics = clipped_loss(logp, entropy, values, exp, algorithm, cfg)
  return loss, (metrics, exp, exp_metrics)
