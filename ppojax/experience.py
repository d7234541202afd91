"""Rollout → experience: everything the step computes once per iteration, without gradients.

    responses           = generate(policy, prompts), n per prompt      [B·n, R]
    old_logp, ref_logp  = log π_T(response | prefix) under actor / reference (no reference:
                          None, and KL ≡ 0)
    old_values          = V(s_t), the critic at the position before each response token (no
                          critic: None)
    scores              = reward model at the last response token, or a reward function
    rewards             = −β·KL_t (+ score on the last response token); β = 0 here when the
                          KL goes into the loss instead
    advantages, returns = the estimator's (``ppo.estimator``: GAE, GRPO, …; returns None
                          without a critic)

A prompt + response sequence is scored in one forward pass over [B, P + R] tokens: the logits at
position P − 1 + t predict response token t, and the critic's output there is V(s_t) (the
state holding the prompt and t response tokens). Tokens after a response's stop token are
masked out of attention and out of every statistic.

Prompts that all begin with the same C tokens (a chat template's header and system prompt) can
carry them as ``Prompts.prefix`` [C] (``with_prefix``): every forward pass then runs those C
tokens once for the batch instead of once per row (``Decoder``'s ``prefix``), and generation
prefills them once (``generate(..., prefix=)``). The rows keep their full prompts; the passes
drop each row's first C real tokens (``without_prefix``). Same numbers up to float rounding.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ppojax import advantages as adv_lib
from ppojax import kl as kl_lib
from ppojax import ops, rewards
from ppojax.models.cache import positions_from_mask
from ppojax.sampling import SamplingConfig, generate

Array = jax.Array
# (prompts [B, P], prompt_mask [B, P], responses [B, R], response_mask [B, R]) → scores [B]
RewardFn = Callable[[Array, Array, Array, Array], Array]


class Prompts(NamedTuple):
  """A batch of left-padded prompts: tokens and mask [B, P], and optionally ``prefix`` [C], the
  first C real tokens of every row (each row has at least one more; ``with_prefix``)."""

  tokens: Array
  mask: Array
  prefix: Array | None = None


def with_prefix(prompts: Prompts, prefix) -> Prompts:
  """``prompts`` (host arrays) with ``prefix`` [C] as their shared prefix when every row begins
  with those C tokens and has at least one token after them; otherwise without one (the
  passes then run every row whole: the same numbers, another compiled program)."""
  prefix = np.asarray(prefix, np.int32).reshape(-1)
  tokens, mask = np.asarray(prompts.tokens), np.asarray(prompts.mask, bool)
  c = prefix.size
  lengths = mask.sum(axis=1)
  if not c or tokens.shape[1] <= c or (lengths <= c).any():
    return prompts._replace(prefix=None)
  starts = tokens.shape[1] - lengths  # left-padded: each row's first real token
  heads = np.take_along_axis(tokens, starts[:, None] + np.arange(c)[None], axis=1)
  if (np.diff(mask.astype(np.int8), axis=1) < 0).any() or (heads != prefix).any():
    return prompts._replace(prefix=None)
  return prompts._replace(prefix=prefix)


def without_prefix(tokens: Array, mask: Array, c: int) -> tuple[Array, Array, Array]:
  """Left-padded rows [B, T] whose first c real tokens are a shared prefix, without it:
  (tokens, mask, positions), [B, T − c]: the last T − c columns (every row's tokens after its
  prefix lie there), the prefix's own tokens masked out, positions counted from c."""
  positions = positions_from_mask(mask)
  return tokens[:, c:], mask[:, c:] & (positions[:, c:] >= c), positions[:, c:]


class Rollout(NamedTuple):
  """Sampled responses and the model outputs on them, all [B, R] unless noted."""

  prompts: Array  # [B, P]
  prompt_mask: Array  # [B, P]
  responses: Array  # int32, pad_id after the first stop token
  mask: Array  # bool response mask (the stop token included)
  has_stop: Array  # [B] bool: ended by a stop token, not by the length limit
  old_logp: Array | None  # log π_old(token), temperature-scaled (None: the update computes it)
  ref_logp: Array  # log π_ref(token), same temperature
  old_values: Array | None  # V_old(s_t) (None: the update computes it)
  prefix: Array | None = None  # [C] the prompts' shared prefix (``Prompts.prefix``)
  # log π_T(token) as the sampler computed it while sampling (``Generation.logprobs``: its
  # compute dtype, its KV-cache decode), for the mismatch metric and ``ppo.tis_cap``
  sampler_logp: Array | None = None


class Experience(NamedTuple):
  """What the update consumes: the rollout plus advantages and returns [B, R]."""

  rollout: Rollout
  advantages: Array
  returns: Array | None  # the critic's regression target (None: no critic)
  # β of a KL term in the loss (``ppo.kl_in = "loss"``, a scalar); None: no KL in the loss
  kl_coef: Array | None = None


def sequence(prompts: Array, prompt_mask: Array, responses: Array, response_mask: Array,
             prefix: Array | None = None) -> tuple[Array, Array, Array]:
  """Prompt + response as one left-padded sequence: (tokens, mask, positions), [B, P + R];
  with a shared ``prefix`` [C], without it (``without_prefix``): [B, P − C + R]. Either way
  response token t sits at column −R + t."""
  chex.assert_equal_shape_prefix([prompts, prompt_mask, responses, response_mask], 1)
  tokens = jnp.concatenate([prompts, responses], axis=1)
  mask = jnp.concatenate([prompt_mask.astype(jnp.bool_), response_mask.astype(jnp.bool_)], 1)
  if prefix is not None:
    return without_prefix(tokens, mask, prefix.shape[0])
  return tokens, mask, positions_from_mask(mask)


def response_logits(module: nn.Module, params, prompts, prompt_mask, responses, response_mask,
                    prefix: Array | None = None) -> Array:
  """Logits [B, R, V] that predict each response token: the LM head at the R positions before
  each (the head runs on those R positions only). The training passes never hold these whole
  (``head_logprobs``); evaluation reads them."""
  hidden = response_hidden(module, params, prompts, prompt_mask, responses, response_mask,
                           prefix)
  return module.apply({"params": params}, hidden, method="logits")


def response_hidden(module: nn.Module, params, prompts, prompt_mask, responses, response_mask,
                    prefix: Array | None = None, rngs: dict | None = None) -> Array:
  """The policy's final hidden states [B, R, D] at the R positions before each response token
  (where the LM head predicts it). ``rngs``: ``apply``'s (the update's LoRA dropout; None:
  deterministic, as every rollout pass)."""
  tokens, mask, positions = sequence(prompts, prompt_mask, responses, response_mask, prefix)
  hidden, _ = module.apply({"params": params}, tokens, positions, mask, prefix=prefix,
                           method="hidden", rngs=rngs)
  r = responses.shape[1]
  return hidden[:, -r - 1:-1]


def head_params(params) -> dict:
  """The part of a ``CausalLM``'s parameters that its LM head reads: ``lm_head``, or the
  embedding table where the head is tied to it."""
  if "lm_head" in params:
    return {"lm_head": params["lm_head"]}
  return {"model": {"embed": params["model"]["embed"]}}


def head_logprobs(module: nn.Module, params, hidden: Array, tokens: Array, temperature: float,
                  entropy: bool = False, chunk_size: int | None = ops.DEFAULT_CHUNK
                  ) -> tuple[Array, Array | None]:
  """(log π_T(tokens_t), H_t or None), [B, T] float32, from hidden states [B, T, D] through the
  LM head, about ``chunk_size`` tokens (all rows together) at a time:

      for each time chunk c:  z_c = head(h_c) / T,  log π_c = z_c[token] − lse(z_c),
                              H_c = lse(z_c) − Σ softmax(z_c)·z_c

  Only one chunk's logits [B, c, V] exist at a time: the whole [B, T, V] never do (for
  Qwen2.5's 151,936-token vocabulary, 0.6 GB per 1,000 tokens in float32). The rows stay whole
  in every chunk, so rows sharded over a mesh stay sharded. This is for passes without a
  gradient (the rollout's): differentiated, the chunk loop accumulates the head's gradient in a
  whole, unsharded buffer ([D, V] float32, 2 GB for Llama-3.1-8B) on every device, so a loss
  passes ``chunk_size=None`` (the whole logits at once, ``ops.selective_log_softmax`` chunking
  their float32 work)."""
  b, t, _ = hidden.shape
  head = head_params(params)

  def one(h, tok):
    logits = module.apply({"params": head}, h, method="logits")
    logp = ops.selective_log_softmax(logits, tok, temperature)
    return logp, ops.entropy_from_logits(logits, temperature) if entropy else None

  target = t if chunk_size is None else max(1, chunk_size // max(b, 1))
  c = ops._chunk_size(t, target)  # pylint: disable=protected-access
  if c == t:
    return one(hidden, tokens)
  split = lambda x: jnp.swapaxes(x.reshape((b, t // c, c) + x.shape[2:]), 0, 1)  # noqa: E731
  merge = lambda y: jnp.swapaxes(y, 0, 1).reshape(b, t)  # noqa: E731
  outs = jax.lax.map(lambda xs: one(*xs), (split(hidden), split(tokens)))
  return jax.tree.map(merge, outs)


def response_logprobs(module, params, prompts, prompt_mask, responses, response_mask,
                      temperature: float, prefix: Array | None = None,
                      chunk_size: int | None = ops.DEFAULT_CHUNK) -> Array:
  """log π_T(response_t | prefix) [B, R], float32, 0 off the mask (``head_logprobs``: the
  logits ``chunk_size`` tokens at a time; None for a loss)."""
  hidden = response_hidden(module, params, prompts, prompt_mask, responses, response_mask,
                           prefix)
  logp, _ = head_logprobs(module, params, hidden, responses, temperature,
                          chunk_size=chunk_size)
  return jnp.where(response_mask, logp, 0.0)


def response_values(module: nn.Module, params, prompts, prompt_mask, responses, response_mask,
                    prefix: Array | None = None, rngs: dict | None = None) -> Array:
  """V(s_t) [B, R] from a ``ValueModel``: its output at the position before response token t
  (``rngs``: as ``response_hidden``'s)."""
  tokens, mask, positions = sequence(prompts, prompt_mask, responses, response_mask, prefix)
  out, _ = module.apply({"params": params}, tokens, positions, mask, prefix=prefix, rngs=rngs)
  r = responses.shape[1]
  return jnp.where(response_mask, out[:, -r - 1:-1], 0.0)


def model_scores(module: nn.Module, params, prompts, prompt_mask, responses, response_mask,
                 prefix: Array | None = None) -> Array:
  """A reward model's score [B]: its output at the last response token."""
  tokens, mask, positions = sequence(prompts, prompt_mask, responses, response_mask, prefix)
  out, _ = module.apply({"params": params}, tokens, positions, mask, prefix=prefix)
  return ops.gather_last(out[:, -responses.shape[1]:], response_mask)


def map_rows(fn: Callable, rows: tuple, micro_batches: int = 1, *shared):
  """``fn(*rows, *shared)`` computed in ``micro_batches`` sequential parts of the rows (a
  ``lax.map``), so that one part's activations are alive at a time; the outputs (a pytree of
  [B, ...] arrays) are the same as one call's.

  Part j holds rows j, j + k, j + 2k, … (k = micro_batches): rows sharded in contiguous blocks
  over devices give every device its equal share of every part, with no data moved."""
  if micro_batches == 1:
    return fn(*rows, *shared)
  b, k = rows[0].shape[0], micro_batches
  if b % k:
    raise ValueError(f"{b} rows do not split into {k} micro-batches")
  split = lambda x: jnp.swapaxes(x.reshape((b // k, k) + x.shape[1:]), 0, 1)  # noqa: E731
  merge = lambda y: jnp.swapaxes(y, 0, 1).reshape((b,) + y.shape[2:])  # noqa: E731
  outs = jax.lax.map(lambda part: fn(*part, *shared), tuple(split(x) for x in rows))
  return jax.tree.map(merge, outs)


def rollout(policy: nn.Module, critic: nn.Module | None, actor, ref_actor, critic_params,
            prompts: Prompts, key: Array, sampling: SamplingConfig,
            old_logp: str = "recompute", old_values: bool = True,
            sampler: nn.Module | None = None, micro_batches: int = 1,
            reference: nn.Module | None = None, sampler_params=None) -> Rollout:
  """Sample responses from the actor (with the ``sampler`` module where given: the policy's
  architecture at another compute dtype), then score them with actor, reference and critic,
  those forward passes in ``micro_batches`` parts (``map_rows``). ``sampling.num_samples`` = n
  samples per prompt: the rollout's B·n rows hold prompt i's samples at i·n … i·n + n − 1, each
  with its prompt. Without a reference (``ref_actor`` None) ``ref_logp`` is None; without a
  critic (``critic`` None) so are the values. ``reference``: the module applying ``ref_actor``
  (default: ``policy``); ``sampler_params``: the sampler's params (default: ``actor``; with
  LoRA, the merged weights of the base-model ``sampler``).

  ``old_logp`` says where log π_old comes from:

  * "recompute": a forward pass of the actor over prompt + response;
  * "sampler": ``Generation.logprobs``, i.e. log softmax(logits / T) at the sampled token under
    the same actor params (the two differ only by float rounding: the KV-cache decode sums in
    another order than the full forward);
  * "update": not here (``Rollout.old_logp`` is None); a single-pass update takes it from its
    own forward pass at the same params (``update.single_pass_update``).

  ``old_values=False`` leaves ``Rollout.old_values`` None for the same reason."""
  if old_logp not in ("recompute", "sampler", "update"):
    raise ValueError(f"old_logp must be 'recompute', 'sampler' or 'update', got {old_logp!r}")
  sampler = policy if sampler is None else sampler
  reference = policy if reference is None else reference
  sampler_params = actor if sampler_params is None else sampler_params
  if prompts.prefix is None:
    gen = generate(sampler, sampler_params, prompts.tokens, prompts.mask, key, sampling)
  else:
    rest, rest_mask, _ = without_prefix(prompts.tokens, prompts.mask, prompts.prefix.shape[0])
    gen = generate(sampler, sampler_params, rest, rest_mask, key, sampling,
                   prefix=prompts.prefix)
  n = sampling.num_samples
  tokens, mask = (prompts.tokens, prompts.mask) if n == 1 else (
      jnp.repeat(prompts.tokens, n, axis=0), jnp.repeat(prompts.mask, n, axis=0))
  rows = (tokens, mask, gen.tokens, gen.mask)

  def passes(*rows_and_prefix):
    *args, prefix = rows_and_prefix
    logp = lambda module, params: response_logprobs(  # noqa: E731
        module, params, *args, sampling.temperature, prefix)
    return {"old": logp(policy, actor) if old_logp == "recompute" else None,
            "ref": logp(reference, ref_actor) if ref_actor is not None else None,
            "values": response_values(critic, critic_params, *args, prefix)
                      if old_values and critic is not None else None}

  out = map_rows(passes, rows, micro_batches, prompts.prefix)
  old = out["old"]  # None with "update"
  if old_logp == "sampler":
    old = gen.logprobs  # 0 off the mask, like the recomputed log-probs
  return Rollout(
      prompts=tokens, prompt_mask=mask, responses=gen.tokens, mask=gen.mask,
      has_stop=ops.has_stop_token(gen.tokens, sampling.stop_ids),
      old_logp=jax.lax.stop_gradient(old), ref_logp=jax.lax.stop_gradient(out["ref"]),
      old_values=jax.lax.stop_gradient(out["values"]), prefix=prompts.prefix,
      sampler_logp=jax.lax.stop_gradient(gen.logprobs))


def take_rows(exp: Experience, idx: Array) -> Experience:
  """The rows ``idx`` of every per-row array of the experience (a shared prefix [C] belongs to
  every row and the loss's KL coefficient to the batch: they stay whole)."""
  prefix = exp.rollout.prefix
  rows = jax.tree.map(lambda x: x[idx], exp._replace(
      rollout=exp.rollout._replace(prefix=None), kl_coef=None))
  return rows._replace(rollout=rows.rollout._replace(prefix=prefix), kl_coef=exp.kl_coef)


def make_experience(r: Rollout, scores: Array, beta: Array, cfg, group_size: int = 1
                    ) -> tuple[Experience, dict]:
  """Rewards and the estimator's advantages from a rollout and its sequence scores [N].

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
  est = adv_lib.estimator(cfg.estimator)
  kl_in_loss = cfg.kl_in == "loss"
  ref_logp = r.old_logp if r.ref_logp is None else r.ref_logp
  token_rewards, metrics = rewards.shape_rewards(
      scores, r.old_logp, ref_logp, r.mask, 0.0 if kl_in_loss else beta, has_stop=r.has_stop,
      kl_estimator=cfg.kl_estimator, score_clip=cfg.score_clip,
      missing_stop_penalty=cfg.missing_stop_penalty, whiten=cfg.whiten_rewards)
  inputs = adv_lib.AdvantageInputs(scores=jnp.sum(token_rewards, axis=1), rewards=token_rewards,
                                   mask=r.mask, values=r.old_values)
  adv, ret = est.fn(inputs, adv_lib.AdvantageParams(
      gamma=cfg.gamma, lam=cfg.lam, whiten=cfg.whiten_advantages, group_size=group_size))
  metrics = {f"objective/{k}": v for k, v in metrics.items()}
  lengths = jnp.sum(r.mask, axis=1)
  metrics.update({
      # the sampled responses' mean Σ_t −log π(token) over response tokens (trl's
      # objective/entropy also counts −1 per padding position: its INVALID_LOGPROB)
      "objective/entropy_masked": jnp.mean(jnp.sum(-r.old_logp, axis=1)),
      "objective/scores_raw": jnp.mean(scores.astype(jnp.float32)),
      "val/num_stopped": jnp.sum(r.has_stop),  # responses ending on a stop token
      "val/response_length": jnp.mean(lengths),
      **group_metrics(rewards.adjust_scores(scores, r.has_stop, score_clip=cfg.score_clip,
                                            missing_stop_penalty=cfg.missing_stop_penalty),
                      kl_lib.per_token_kl(r.old_logp, ref_logp, cfg.kl_estimator), r.mask,
                      group_size),
  })
  if r.old_values is not None:
    metrics["val/values_rollout"] = ops.masked_mean(r.old_values, r.mask)
  if r.sampler_logp is not None:  # the sampler's log-probs vs the learner's (same params)
    metrics["rollout/logp_mismatch"] = ops.masked_mean(jnp.abs(r.old_logp - r.sampler_logp),
                                                       r.mask)
  kl_coef = jnp.asarray(beta, jnp.float32) if kl_in_loss and r.ref_logp is not None else None
  return Experience(r, adv, ret, kl_coef), metrics


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
