"""Multi-turn generation: the policy writes a turn, an environment answers in tokens, the policy
writes the next turn from the same KV cache. Token in, token out: the trajectory is the sampled
ids and the environment's ids, never text tokenised again.

A trajectory after a prompt [B, P] is [B, R] with R = T·(L + O) (T = ``env.max_turns``, L =
``SamplingConfig.max_new_tokens`` per turn, O = ``env.obs_tokens`` per observation):

    columns k·(L+O) … k·(L+O) + L − 1      turn k's policy tokens (pad after its stop token)
    columns k·(L+O) + L … (k+1)·(L+O) − 1  the observation that answers it, right-aligned

    mask  the policy's tokens: the only ones with log-probs, loss, KL and entropy
    seen  the tokens the model attends to: policy ∪ observation (pads are holes in both)

Positions count seen tokens only (``positions_from_mask`` over prompt mask ++ ``seen``), so the
learner's forward pass over prompt + trajectory sees the sampler's sequence token for token. The
column before every policy token is a seen token (the prompt's last, the turn's previous token,
or its observation's last: observations are right-aligned and a continuing episode has at least
one observation token), so its logits predict it in both.

Per turn: the cached decode loop (``sampling._decode``) from the previous logits, the
environment's step on the turn's tokens, then one forward pass over the turn's L + O slots (its
policy tokens again, written by a prefill where the decode skipped its last token, and the
observation) that ends on the next turn's first logits. The environment is either traced (a
``TokenEnv``: the whole rollout is one ``lax.scan`` over turns) or on the host (``host_turns``:
one round trip per turn for the whole batch, the cache staying on the device).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Protocol

import flax.linen as nn
import jax
import jax.numpy as jnp

from ppojax.core import ops
from ppojax.models.rope import model_rope
from ppojax.rollout import sampling as sampling_lib
from ppojax.rollout.sampling import SamplingConfig

Array = jax.Array


class EnvStep(NamedTuple):
  """An environment's answer to one turn of the batch."""

  state: Any
  obs: Array  # [B, O] int32 token ids, right-aligned (pads first)
  obs_mask: Array  # [B, O] bool
  reward: Array  # [B] float32, this turn's reward
  done: Array  # [B] bool: the episode ended (its observation, if any, is not shown)
  info: dict  # name → [B] counts of this turn (e.g. "invalid", "obs_truncated")


class TokenEnv(Protocol):
  """A JAX environment on token ids, traced into the step. Hashable (a frozen dataclass: it is a
  static argument), with fixed budgets."""

  max_turns: int  # T
  obs_tokens: int  # O

  def reset(self, key: Array, prompts: Array, prompt_mask: Array) -> Any:
    """The state of B episodes, one per prompt row [B, P] (a pytree of [B, ...] arrays)."""

  def step(self, state, action: Array, action_mask: Array, turn: Array) -> EnvStep:
    """The answer to the turn's action tokens [B, L] (``action_mask``: the policy's tokens)."""


class Trajectory(NamedTuple):
  """A multi-turn generation, [B, R] unless noted (see the module docstring)."""

  tokens: Array  # int32: policy and observation tokens, pad_id in the holes
  mask: Array  # bool: the policy's tokens
  seen: Array  # bool: policy ∪ observation tokens
  logprobs: Array  # float32 log π_T(token) as sampled, 0 off ``mask``
  sampling_logprobs: Array  # under the truncated distribution, 0 off ``mask``
  turn_rewards: Array  # float32: each turn's reward on its last policy token
  done: Array  # [B] bool: the environment ended the episode (False: out of turns)
  episode: dict  # name → [B] per-episode counts: turns, truncated_turns, the env's info sums


class TurnOutput(NamedTuple):
  """One turn's decode, [B, L] unless noted: tokens (pad after the stop), the log-probs as
  sampled, and whether each row stopped [B] (else it ran out of its L tokens)."""

  tokens: Array
  logp: Array
  sampling_logp: Array
  done: Array


class Carry(NamedTuple):
  """What one turn hands the next: the cache and its mask, the next token's logits [B, V], the
  next token's position [B], and which rows' episodes have ended [B]."""

  cache: Any
  kv_mask: Array
  logits: Array
  position: Array
  ended: Array


def check_model(cfg) -> None:
  """Multi-turn rollouts need layers without a sliding window: a window counts cache slots,
  and a trajectory's holes (pads after a turn's stop, before an observation) would narrow it
  against the positions the model was trained on."""
  if any(cfg.windows):
    raise ValueError(
        f"multi-turn rollouts do not support sliding-window layers yet (this model's windows: "
        f"{sorted(set(w for w in cfg.windows if w))}): a window counts KV-cache slots, and the "
        "holes between turns would narrow it; use a model with full attention (Llama, Qwen2/3, "
        "SmolLM2/3, OLMo 2)")


def start(apply, cfg, prompts: Array, prompt_mask: Array, prefix: Array | None, slots: int,
          n: int) -> Carry:
  """The prompts' prefill into a cache of ``slots`` slots, each row repeated for its n
  samples."""
  shared = 0 if prefix is None else prefix.shape[0]
  logits, cache, kv_mask, position = sampling_lib._prefill(  # pylint: disable=protected-access
      apply, cfg, prompts, prompt_mask.astype(jnp.bool_), prefix, shared, slots, n)
  return Carry(cache, kv_mask, logits[:, -1], position,
               jnp.zeros((logits.shape[0],), jnp.bool_))


def decode_turn(apply, cfg, carry: Carry, base, size: int, key: Array, config: SamplingConfig
                ) -> tuple[Carry, TurnOutput, Array]:
  """One turn of up to L tokens per live row from ``carry.logits``, fed at slots base, base + 1,
  …: (carry with the decode's cache, the turn, its policy mask [B, L])."""
  s = sampling_lib._decode(  # pylint: disable=protected-access
      apply, cfg, carry.logits[:, None], carry.cache, carry.kv_mask, carry.position, base, size,
      key, config, done=carry.ended)
  mask = ops.response_mask(s.tokens, config.stop_ids) & ~carry.ended[:, None]
  return (carry._replace(cache=s.cache), TurnOutput(s.tokens, s.logp, s.sampling_logp, s.done),
          mask)


def observe(apply, cfg, carry: Carry, base, turn: Array, turn_mask: Array, obs: Array,
            obs_mask: Array, size: int) -> Carry:
  """The turn's tokens [B, L] and its observation [B, O] written at slots base … base + L + O − 1
  by one forward pass; its last logits predict the next turn's first token."""
  chunk = jnp.concatenate([turn, obs], axis=1).astype(jnp.int32)
  chunk_mask = jnp.concatenate([turn_mask, obs_mask], axis=1)
  kv_mask = jax.lax.dynamic_update_slice(carry.kv_mask, chunk_mask, (0, base))
  positions = carry.position[:, None] + jnp.maximum(
      jnp.cumsum(chunk_mask.astype(jnp.int32), axis=1) - 1, 0)
  logits, cache = apply(chunk, positions, kv_mask, carry.cache, base, last_only=True,
                        rope=model_rope(cfg, positions, size))
  return carry._replace(cache=cache, kv_mask=kv_mask, logits=logits[:, -1],
                        position=carry.position + jnp.sum(chunk_mask, axis=1, dtype=jnp.int32))


def record_turn(s: TurnOutput, turn_mask: Array, answer: EnvStep, ended: Array,
                last_turn: bool | Array, pad_id: int):
  """The turn's columns [B, L + O] of every trajectory array, the rows' episodes ended after it,
  and the observation mask the next turn sees (none where the episode ended or no turn
  follows). A continuing episode without an observation token ends: the next turn would have
  no logits to start from."""
  obs_mask = answer.obs_mask.astype(jnp.bool_) & ~ended[:, None] & ~answer.done[:, None]
  now_ended = ended | answer.done | ~jnp.any(obs_mask, axis=1)
  obs_mask = obs_mask & ~jnp.asarray(last_turn)
  reward = jnp.where(ended, 0.0, answer.reward.astype(jnp.float32))
  last = ops.last_token_mask(turn_mask) & turn_mask
  zeros = jnp.zeros(answer.obs.shape, jnp.float32)
  cols = {
      "tokens": jnp.concatenate([s.tokens, jnp.where(obs_mask, answer.obs, pad_id)], axis=1),
      "mask": jnp.concatenate([turn_mask, jnp.zeros_like(obs_mask)], axis=1),
      "seen": jnp.concatenate([turn_mask, obs_mask], axis=1),
      "logprobs": jnp.concatenate([jnp.where(turn_mask, s.logp, 0.0), zeros], axis=1),
      "sampling_logprobs": jnp.concatenate(
          [jnp.where(turn_mask, s.sampling_logp, 0.0), zeros], axis=1),
      "turn_rewards": jnp.concatenate([jnp.where(last, reward[:, None], 0.0), zeros], axis=1),
  }
  live = ~ended
  counts = {"turns": live, "truncated_turns": live & ~s.done,  # ran out of its L tokens
            "done": live & answer.done,
            "no_observation": live & ~answer.done & ~jnp.any(answer.obs_mask, axis=1)}
  counts.update({k: jnp.where(live, v, 0) for k, v in answer.info.items()})
  return cols, now_ended, obs_mask, counts


def assemble(columns: dict, counts: dict) -> Trajectory:
  """The per-turn columns ([T, B, L + O] each) as one trajectory [B, T·(L + O)] and the
  per-turn counts ([T, B]) summed per episode."""
  flat = {k: jnp.swapaxes(v, 0, 1).reshape(v.shape[1], -1) for k, v in columns.items()}
  episode = {k: jnp.sum(v.astype(jnp.int32), axis=0) for k, v in counts.items()}
  return Trajectory(**flat, done=episode["done"] > 0, episode=episode)


def reset_key(key: Array) -> Array:
  """The key an environment's episodes are drawn with: a function of the rollout's key, so a
  resumed run draws the same episodes (a host environment gets its bits as a seed)."""
  return jax.random.fold_in(key, 2**31 - 1)


@functools.partial(jax.jit, static_argnames=("module", "config", "env"))
def generate_turns(module: nn.Module, params, prompts: Array, prompt_mask: Array, key: Array,
                   config: SamplingConfig, env: TokenEnv, prefix: Array | None = None
                   ) -> Trajectory:
  """Up to ``env.max_turns`` turns of up to ``config.max_new_tokens`` tokens each after the
  left-padded ``prompts`` [B, P], the traced ``env`` answering each: [B·n, R], prompt i's n
  samples in rows i·n … i·n + n − 1, each group on the same episode (``env.reset`` runs on the
  B prompts, its state repeated). One ``lax.scan`` over turns; turn k samples with
  ``fold_in(key, k)``, the environment resets with ``reset_key(key)``."""
  turns, obs_len, length = env.max_turns, env.obs_tokens, config.max_new_tokens
  if turns < 1 or obs_len < 1:
    raise ValueError(f"env.max_turns and env.obs_tokens must be >= 1, got {turns}, {obs_len}")
  check_model(module.cfg)
  module, params = sampling_lib.decode_layout(module, params, config.layers)
  apply = functools.partial(module.apply, {"params": params})
  p, n = prompts.shape[1], config.num_samples_per_prompt
  shared = 0 if prefix is None else prefix.shape[0]
  slots = p + turns * (length + obs_len)
  size = shared + slots
  carry = start(apply, module.cfg, prompts, prompt_mask, prefix, slots, n)
  env_state = env.reset(reset_key(key), prompts, prompt_mask)
  if n > 1:
    env_state = jax.tree.map(lambda x: jnp.repeat(x, n, axis=0), env_state)

  def turn(c, k):
    carry, env_state = c
    base = p + k * (length + obs_len)
    carry, s, turn_mask = decode_turn(apply, module.cfg, carry, base, size,
                                      jax.random.fold_in(key, k), config)
    answer = env.step(env_state, s.tokens, turn_mask, k)
    cols, ended, obs_mask, counts = record_turn(s, turn_mask, answer, carry.ended,
                                                k == turns - 1, config.pad_id)
    carry = jax.lax.cond(
        k < turns - 1,
        lambda c: observe(apply, module.cfg, c, base, s.tokens, turn_mask, answer.obs,
                          obs_mask, size),
        lambda c: c, carry)
    return (carry._replace(ended=ended), answer.state), (cols, counts)

  (carry, _), (columns, counts) = jax.lax.scan(turn, (carry, env_state), jnp.arange(turns))
  return assemble(columns, counts)
