"""Vectorised gymnax environments with automatic reset, and episode bookkeeping.

gymnax (``pip install 'ppojax[classic]'``) steps one environment as a pure function; ``step``
below vmaps it over N environments. gymnax's ``step`` resets an environment whose episode ended
in the same call and returns the observation *before* the reset as ``final_observation``: the
state whose value a truncated episode bootstraps from (``advantages.gae_episodes``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array

# Discrete-action classic-control tasks gymnax ships; the agent is the same for each.
DISCRETE = ("CartPole-v1", "Acrobot-v1", "MountainCar-v0")


def make(name: str) -> tuple[Any, Any]:
  """(env, env_params) of a gymnax environment with discrete actions, or a clear error."""
  if name not in DISCRETE:
    raise ValueError(f"classic.env={name!r}: choose one of {DISCRETE} (discrete actions)")
  try:
    import gymnax  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError("classic control needs gymnax: pip install 'ppojax[classic]'") from e
  return gymnax.make(name)


class Step(NamedTuple):
  """One vectorised step, each [N]: ``obs`` is after any reset, ``final_obs`` before it."""

  obs: Array
  final_obs: Array
  reward: Array
  terminated: Array  # the MDP ended (pole fell): nothing after it has value
  truncated: Array  # the time limit (500 steps for CartPole-v1) ended it: bootstrap


def reset(env, params, key: Array, num_envs: int) -> tuple[Array, Any]:
  """N fresh environments: (obs [N, D], states)."""
  return jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(key, num_envs), params)


def step(env, params, key: Array, states, actions: Array) -> tuple[Step, Any]:
  """Steps N environments at once; those whose episode ended start a new one."""
  keys = jax.random.split(key, actions.shape[0])
  obs, states, reward, terminated, truncated, info = jax.vmap(
      env.step, in_axes=(0, 0, 0, None))(keys, states, actions, params)
  out = Step(obs, info["final_observation"], reward.astype(jnp.float32),
             terminated.astype(jnp.bool_), jnp.logical_and(truncated, ~terminated))
  return out, states


class Episodes(NamedTuple):
  """Per environment [N]: the running episode's return and length; the last finished one's."""

  ret: Array
  length: Array
  last_ret: Array
  last_length: Array
  finished: Array  # episodes finished so far (int32)

  @staticmethod
  def zeros(num_envs: int) -> Episodes:
    z = jnp.zeros((num_envs,), jnp.float32)
    return Episodes(z, z, z, z, jnp.zeros((num_envs,), jnp.int32))

  def record(self, reward: Array, done: Array) -> Episodes:
    """G ← G + r, L ← L + 1; where ``done``: the last episode is (G, L), and G, L restart at 0."""
    ret, length = self.ret + reward, self.length + 1.0
    return Episodes(jnp.where(done, 0.0, ret), jnp.where(done, 0.0, length),
                    jnp.where(done, ret, self.last_ret), jnp.where(done, length, self.last_length),
                    self.finished + done.astype(jnp.int32))
