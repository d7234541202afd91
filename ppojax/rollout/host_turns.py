"""Multi-turn generation with an environment on the host: Python that cannot be traced (tools
parsed from text, a code runner, a search call). One host round trip per turn for the whole
batch: the compiled decode of a turn stops at the turn's end, the host reads the turns' token
ids, the environment answers each row with token ids, and the compiled ``observe`` writes the
turn and its answer into the same KV cache, which stays on the device: no re-prefill of the
conversation. The trajectory is laid out as ``multiturn``'s, so the learner cannot tell the two
apart.

    trajectory, trips = host_turns(module, params, prompts, prompt_mask, key, config, env)
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Protocol

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ppojax.rollout import multiturn
from ppojax.rollout.multiturn import Carry, Trajectory
from ppojax.rollout.sampling import SamplingConfig, decode_layout

Array = jax.Array


class HostAnswer(NamedTuple):
  """The environment's answer to one row's turn."""

  ids: list[int]  # the observation's token ids, framed as the next message (``data.turns``)
  reward: float = 0.0
  done: bool = False  # the episode ended: ``ids`` are not shown
  info: dict | None = None  # name → count of this turn (e.g. {"tool_calls": 1})


class HostEnv(Protocol):
  """An environment on the host, one episode per row."""

  max_turns: int  # T
  obs_tokens: int  # O: a longer observation is cut to its first O tokens (``obs_truncated``)
  on_host: bool  # True: how ``build`` and evaluation tell it from a traced ``TokenEnv``

  def reset(self, records: list[dict] | None, prompts: list[list[int]], seed: int) -> None:
    """New episodes, one per row: ``prompts`` holds each row's prompt ids (after a shared
    prefix), ``records`` (None for a token task) each row's record; B·n rows, each prompt's n
    samples next to each other. ``seed``: draw any randomness from it (a function of the
    iteration's key: a resumed run draws the same episodes)."""

  def step(self, turn: int, actions: list[list[int]], live: list[bool]) -> list[HostAnswer]:
    """Answers to the turn's action token ids, one per row (rows not ``live`` are ignored)."""


def on_host(env) -> bool:
  """Whether ``env`` is a host environment (``HostEnv``) rather than a traced ``TokenEnv``."""
  return bool(getattr(env, "on_host", False))


@functools.lru_cache(maxsize=16)
def _layout(module: nn.Module, layers: str):
  """(jitted params → decode-layout params, a holder of the decode module, filled on the first
  call's trace)."""
  holder = {}

  def convert(params):
    holder["module"], params = decode_layout(module, params, layers)
    return params
  return jax.jit(convert), holder


@functools.partial(jax.jit, static_argnames=("module", "slots", "n"))
def _start(module, params, prompts, prompt_mask, prefix, slots: int, n: int) -> Carry:
  apply = functools.partial(module.apply, {"params": params})
  return multiturn.start(apply, module.cfg, prompts, prompt_mask, prefix, slots, n)


@functools.partial(jax.jit, static_argnames=("module", "size", "config"), donate_argnums=(2,))
def _decode(module, params, carry: Carry, base, key, size: int, config: SamplingConfig):
  apply = functools.partial(module.apply, {"params": params})
  return multiturn.decode_turn(apply, module.cfg, carry, base, size, key, config)


_record = jax.jit(multiturn.record_turn, static_argnames=("last_turn", "pad_id"))


@functools.partial(jax.jit, static_argnames=("module", "size"), donate_argnums=(2,))
def _observe(module, params, carry: Carry, base, turn, turn_mask, obs, obs_mask, ended,
             size: int) -> Carry:
  apply = functools.partial(module.apply, {"params": params})
  carry = multiturn.observe(apply, module.cfg, carry, base, turn, turn_mask, obs, obs_mask, size)
  return carry._replace(ended=ended)


def answers_to_arrays(answers: list[HostAnswer], live: np.ndarray, obs_tokens: int,
                      pad_id: int) -> dict:
  """The answers as arrays: obs [B, O] right-aligned (an observation over O tokens keeps its
  first O, ``obs_truncated``), obs_mask, reward [B], done [B], info (name → [B])."""
  b = len(answers)
  obs, mask = np.full((b, obs_tokens), pad_id, np.int32), np.zeros((b, obs_tokens), bool)
  reward, done = np.zeros(b, np.float32), np.zeros(b, bool)
  info = {"obs_truncated": np.zeros(b, np.int32)}
  for i, a in enumerate(answers):
    if not live[i]:
      continue
    ids = [int(t) for t in a.ids][:obs_tokens]
    info["obs_truncated"][i] = len(a.ids) > obs_tokens
    if ids:
      obs[i, obs_tokens - len(ids):], mask[i, obs_tokens - len(ids):] = ids, True
    reward[i], done[i] = a.reward, a.done
    for k, v in (a.info or {}).items():
      info.setdefault(k, np.zeros(b, np.int32))[i] = v
  return {"obs": obs, "obs_mask": mask, "reward": reward, "done": done, "info": info}


def _stacked(per_turn: list[dict], turns: int) -> dict:
  """Per-turn dicts of [B, ...] arrays stacked [T, B, ...]: a name missing from a turn (a count
  the environment gave only sometimes) and the turns after every episode ended are zeros."""
  names = {k: v for d in per_turn for k, v in d.items()}
  return {k: jnp.stack([d.get(k, jnp.zeros_like(like)) for d in per_turn]
                       + [jnp.zeros_like(like)] * (turns - len(per_turn)))
          for k, like in names.items()}


def host_turns(module: nn.Module, params, prompts: Array, prompt_mask: Array, key: Array,
               config: SamplingConfig, env: HostEnv, prefix: Array | None = None,
               records: list[dict] | None = None) -> tuple[Trajectory, int]:
  """``multiturn.generate_turns`` with the environment on the host: (trajectory, round trips).
  Each turn is one compiled decode, one host step for the batch and one compiled ``observe``;
  the cache is donated from turn to turn. ``records``: the batch's, for ``env.reset``."""
  turns, obs_len, length = env.max_turns, env.obs_tokens, config.max_new_tokens
  multiturn.check_model(module.cfg)
  convert, holder = _layout(module, config.layers)
  params = convert(params)
  module = holder["module"]
  p, n = prompts.shape[1], config.num_samples_per_prompt
  slots = p + turns * (length + obs_len)
  size = (0 if prefix is None else prefix.shape[0]) + slots
  carry = _start(module, params, prompts, prompt_mask, prefix, slots, n)
  rows = carry.ended.shape[0]
  host_prompts, host_mask = np.asarray(prompts), np.asarray(prompt_mask, bool)
  seed = int(jax.random.randint(multiturn.reset_key(key), (), 0, 2**31 - 1))
  env.reset(records, [row[m].tolist() for row, m in zip(host_prompts, host_mask)
                      for _ in range(n)], seed)
  ended, columns, counts, trips = np.zeros(rows, bool), [], [], 0
  for k in range(turns):
    base = p + k * (length + obs_len)
    carry, turn, mask = _decode(module, params, carry, jnp.int32(base),
                                jax.random.fold_in(key, k), size, config)
    host_tokens, host_mask = np.asarray(turn.tokens), np.asarray(mask)  # the round trip
    trips += 1
    live = ~ended
    answers = env.step(k, [row[m].tolist() for row, m in zip(host_tokens, host_mask)],
                       live.tolist())
    a = answers_to_arrays(answers, live, obs_len, config.pad_id)
    answer = multiturn.EnvStep(
        None, *(jnp.asarray(a[name]) for name in ("obs", "obs_mask", "reward", "done")),
        {name: jnp.asarray(v) for name, v in a["info"].items()})
    cols, now_ended, obs_mask, count = _record(turn, mask, answer, jnp.asarray(ended),
                                               last_turn=k == turns - 1, pad_id=config.pad_id)
    columns.append(cols)
    counts.append(count)
    ended = np.asarray(now_ended)
    if ended.all():
      break
    if k < turns - 1:
      carry = _observe(module, params, carry, jnp.int32(base), turn.tokens, mask, answer.obs,
                       obs_mask, jnp.asarray(ended), size)
  traj = multiturn.assemble(_stacked(columns, turns), _stacked(counts, turns))
  tokens = jnp.where(traj.seen, traj.tokens, config.pad_id)
  return traj._replace(tokens=tokens), trips
