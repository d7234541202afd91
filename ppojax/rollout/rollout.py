"""The rollout: n responses sampled per prompt, then the forward passes that score them without a
gradient (old and reference log-probs, the critic's values), in micro-batches.

    responses           = generate(policy, prompts), n per prompt      [B·n, R]
    old_logp, ref_logp  = log π_T(response | prefix) under actor / reference (no reference: None)
    old_values          = V(s_t), the critic at the position before each response token (no
                          critic: None)
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from ppojax.core import ops
from ppojax.data.batch import Prompts
from ppojax.models.passes import map_rows, response_logprobs, response_values, without_prefix
from ppojax.rollout.host_turns import HostEnv, host_turns
from ppojax.rollout.multiturn import TokenEnv, Trajectory, generate_turns
from ppojax.rollout.sampling import Generation, SamplingConfig, generate

Array = jax.Array

# (prompts [B, P], prompt_mask [B, P], responses [B, R], response_mask [B, R]) → scores [B]
RewardFn = Callable[[Array, Array, Array, Array], Array]


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
  # compute dtype, its KV-cache decode), for the mismatch metric and ``rl.tis_cap``
  sampler_logp: Array | None = None
  # [B] bool: the rows the loss counts (dynamic sampling's fill is out: ``step.keep_groups``);
  # None: all
  in_loss: Array | None = None
  # multi-turn (``rollout.multiturn``): [B, R] the tokens attended to, the policy's and the
  # environment's (``mask`` is the policy's alone); None: ``mask``
  seen: Array | None = None
  # multi-turn: [B, R] each turn's environment reward on its last policy token
  turn_rewards: Array | None = None
  # multi-turn: name → [B] per-episode counts (turns, truncated turns, the environment's own)
  episode: dict | None = None


def attended(r: Rollout) -> Array:
  """The response tokens the model attends to [B, R]: ``r.seen``, or the response mask."""
  return r.mask if r.seen is None else r.seen


def own_rows(prompts: Prompts) -> tuple[Array, Array]:
  """The prompts' tokens and mask after their shared prefix (all of them without one)."""
  if prompts.prefix is None:
    return prompts.tokens, prompts.mask
  return without_prefix(prompts.tokens, prompts.mask, prompts.prefix.shape[0])[:2]


def sample(sampler: nn.Module, params, prompts: Prompts, key: Array, sampling: SamplingConfig,
           env: TokenEnv | None = None) -> Generation | Trajectory:
  """The generation of ``prompts``: one response per sample (``sampling.generate``), or with
  ``env`` a whole episode (``multiturn.generate_turns``); the shared prefix's prefill runs
  once."""
  tokens, mask = own_rows(prompts)
  if env is None:
    return generate(sampler, params, tokens, mask, key, sampling, prefix=prompts.prefix)
  return generate_turns(sampler, params, tokens, mask, key, sampling, env, prefix=prompts.prefix)


def sample_on_host(sampler: nn.Module, params, prompts: Prompts, key: Array,
                   sampling: SamplingConfig, env: HostEnv, records: list[dict] | None = None
                   ) -> tuple[Trajectory, int]:
  """``sample`` with an environment on the host (``host_turns``): (episodes, round trips)."""
  tokens, mask = own_rows(prompts)
  return host_turns(sampler, params, tokens, mask, key, sampling, env, prompts.prefix, records)


def rollout(policy: nn.Module, critic: nn.Module | None, actor, reference_params, critic_params,
            prompts: Prompts, key: Array, sampling: SamplingConfig,
            old_logp: str = "recompute", old_values: bool = True,
            sampler: nn.Module | None = None, micro_batches: int = 1,
            reference: nn.Module | None = None, sampler_params=None,
            env: TokenEnv | None = None) -> Rollout:
  """Sample responses from the actor (with the ``sampler`` module where given: the policy's
  architecture at another compute dtype), then score them with actor, reference and critic,
  those forward passes in ``micro_batches`` parts (``map_rows``).
  ``sampling.num_samples_per_prompt`` = n samples per prompt: the rollout's B·n rows hold prompt
  i's samples at i·n … i·n + n − 1, each with its prompt. Without a reference
  (``reference_params`` None) ``ref_logp`` is None; without a critic (``critic`` None) so are
  the values. ``reference``: the module applying ``reference_params`` (default: ``policy``);
  ``sampler_params``: the sampler's params (default: ``actor``; with LoRA, the merged weights of
  the base-model ``sampler``).

  ``old_logp`` says where log π_old comes from:

  * "recompute": a forward pass of the actor over prompt + response;
  * "sampler": ``Generation.logprobs``, i.e. log softmax(logits / T) at the sampled token under
    the same actor params (the two differ only by float rounding: the KV-cache decode sums in
    another order than the full forward);
  * None: not computed here (``Rollout.old_logp`` is None): a single-pass update takes it from
    its own forward pass at the same params.

  ``old_values=False`` leaves ``Rollout.old_values`` None for the same reason. ``env``: whole
  episodes (``sample``), the passes over ``seen``, their outputs 0 off the policy's tokens."""
  if old_logp not in ("recompute", "sampler", None):
    raise ValueError(f"old_logp must be 'recompute', 'sampler' or None, got {old_logp!r}")
  sampler = policy if sampler is None else sampler
  sampler_params = actor if sampler_params is None else sampler_params
  gen = sample(sampler, sampler_params, prompts, key, sampling, env)
  return passes_on(policy, critic, actor, reference_params, critic_params, prompts, gen,
                   sampling, old_logp, old_values, micro_batches, reference)


def passes_on(policy: nn.Module, critic: nn.Module | None, actor, reference_params,
              critic_params, prompts: Prompts, gen: Generation | Trajectory,
              sampling: SamplingConfig, old_logp: str | None = "recompute",
              old_values: bool = True, micro_batches: int = 1,
              reference: nn.Module | None = None) -> Rollout:
  """The ``Rollout`` of a generation (``sample``'s, or ``host_turns``'): its no-gradient passes
  (arguments as ``rollout``'s), over the tokens seen, their outputs 0 off the policy's."""
  reference = policy if reference is None else reference
  turns = isinstance(gen, Trajectory)
  seen = gen.seen if turns else gen.mask
  n = sampling.num_samples_per_prompt
  tokens, mask = (prompts.tokens, prompts.mask) if n == 1 else (
      jnp.repeat(prompts.tokens, n, axis=0), jnp.repeat(prompts.mask, n, axis=0))
  rows = (tokens, mask, gen.tokens, seen)

  def passes(*rows_and_prefix):
    *args, prefix = rows_and_prefix
    logp = lambda module, params: response_logprobs(  # noqa: E731
        module, params, *args, sampling.temperature, prefix)
    return {"old": logp(policy, actor) if old_logp == "recompute" else None,
            "ref": logp(reference, reference_params) if reference_params is not None else None,
            "values": response_values(critic, critic_params, *args, prefix)
                      if old_values and critic is not None else None}

  out = map_rows(passes, rows, micro_batches, prompts.prefix)
  if turns:  # the passes attended to ``seen``: keep the policy's tokens
    out = {k: None if v is None else jnp.where(gen.mask, v, 0.0) for k, v in out.items()}
  old = out["old"]  # None: not computed here
  if old_logp == "sampler":
    old = gen.logprobs  # 0 off the mask, like the recomputed log-probs
  # multi-turn: an episode the environment ended stopped, one out of turns was cut off
  has_stop = gen.done if turns else ops.has_stop_token(gen.tokens, sampling.stop_ids)
  extra = dict(seen=seen, turn_rewards=gen.turn_rewards, episode=gen.episode) if turns else {}
  return Rollout(
      prompts=tokens, prompt_mask=mask, responses=gen.tokens, mask=gen.mask, has_stop=has_stop,
      old_logp=jax.lax.stop_gradient(old), ref_logp=jax.lax.stop_gradient(out["ref"]),
      old_values=jax.lax.stop_gradient(out["values"]), prefix=prompts.prefix,
      sampler_logp=jax.lax.stop_gradient(gen.logprobs), **extra)
