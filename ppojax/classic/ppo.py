"""PPO for classic control (CartPole) with ppojax's math core, the whole run one ``lax.scan``.

    key → init: params, Adam, N environments
    repeat num_updates times (lax.scan):
      rollout    T steps of N environments (lax.scan): a ~ π(·|s), gymnax step with auto-reset
      GAE        V'(s_final) of every step; d = γ·(1 − terminal), c = 1 − done; A, R
                 (advantages.gae_episodes: the language-model step's GAE, of which it is the
                 general case)
      update     E epochs × M shuffled minibatches (lax.scan) of losses.ppo_loss: clipped
                 surrogate, clipped value loss, entropy bonus (logprobs.entropy_from_logits),
                 with log π(a|s) from logprobs.selective_log_softmax and advantages whitened per
                 minibatch (ops.masked_whiten); global-norm clip, Adam with a linearly annealed rate

Terminal vs truncated: an episode the pole ends (``terminated``) has no value after it, d = 0; an
episode the 500-step limit ends (``truncated``) is cut, not over: it bootstraps from the critic's
value of its last observation (gymnax's ``final_observation``, before the reset), d = γ. Both cut
the trace (c = 0): the next column is a new episode. The rollout's last column bootstraps the
same way. PureJaxRL (Lu et al. 2022) and CleanRL treat truncation as termination instead.

``make_train(hp)`` returns ``train(key) → (TrainState, metrics)`` with metrics [num_updates];
``jax.vmap(train)`` trains many seeds in one call. ``make_iteration`` gives one iteration for
loops that report as they go (``ppojax.classic.runner``).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import chex
import jax
import jax.numpy as jnp
import optax

from ppojax.classic import agent, envs
from ppojax.core import advantages as adv_lib
from ppojax.core import logprobs, losses, ops

Array = jax.Array


class Hyper(NamedTuple):
  """Hyper-parameters (PureJaxRL's CartPole defaults where not noted). Python values: static."""

  env: str = "CartPole-v1"
  num_envs: int = 4
  num_steps: int = 128  # T per rollout; a batch is N·T steps
  total_timesteps: int = 500_000
  lr: float = 2.5e-4
  anneal_lr: bool = True  # lr → 0 linearly over the run
  num_epochs: int = 4
  num_minibatches: int = 4
  gamma: float = 0.99
  lam: float = 0.95
  clip_eps: float = 0.2
  value_clip: float | None = 0.2  # None: unclipped value loss
  ent_coef: float = 0.01
  vf_coef: float = 0.5
  max_grad_norm: float = 0.5
  hidden: int = 64
  depth: int = 2

  @property
  def batch_size(self) -> int:
    return self.num_envs * self.num_steps

  @property
  def num_updates(self) -> int:
    return self.total_timesteps // self.batch_size

  def check(self) -> Hyper:
    """Itself, or a ``ValueError`` naming the first inconsistent field."""
    for name in ("num_envs", "num_steps", "num_epochs", "num_minibatches", "hidden"):
      if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
        raise ValueError(f"classic.{name}={getattr(self, name)!r} must be an int >= 1")
    if self.batch_size % self.num_minibatches:
      raise ValueError(f"classic.num_minibatches={self.num_minibatches} must divide the batch "
                       f"num_envs·num_steps = {self.batch_size}")
    if self.num_updates < 1:
      raise ValueError(f"classic.total_timesteps={self.total_timesteps} is less than one batch "
                       f"({self.batch_size} steps)")
    if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
      raise ValueError(f"classic.gamma={self.gamma}, lam={self.lam} must lie in [0, 1]")
    if self.lr <= 0 or self.max_grad_norm <= 0:
      raise ValueError(f"classic.lr={self.lr}, max_grad_norm={self.max_grad_norm} must be > 0")
    losses._check_policy_options(self.clip_eps)
    envs.make(self.env)  # a clear error for an unknown environment or a missing gymnax
    return self


class TrainState(NamedTuple):
  params: Any
  opt_state: Any
  env_state: Any  # gymnax states of the N environments
  obs: Array  # [N, D]
  episodes: envs.Episodes
  key: Array
  update: Array  # iterations done (int32)


class Transition(NamedTuple):
  """A rollout, time-major: [T, N] (observations [T, N, D])."""

  obs: Array
  action: Array
  logp: Array
  value: Array
  reward: Array
  terminated: Array
  truncated: Array
  final_obs: Array  # the observation each step led to, before any reset


def make_optimizer(hp: Hyper) -> optax.GradientTransformation:
  """Global-norm clip, then Adam (eps 1e-5); the rate falls linearly to 0 over E·M·updates."""
  steps = hp.num_updates * hp.num_epochs * hp.num_minibatches
  lr = optax.linear_schedule(hp.lr, 0.0, steps) if hp.anneal_lr else hp.lr
  return optax.chain(optax.clip_by_global_norm(hp.max_grad_norm), optax.adam(lr, eps=1e-5))


def network(hp: Hyper) -> agent.ActorCritic:
  env, params = envs.make(hp.env)
  return agent.ActorCritic(env.action_space(params).n, hp.hidden, hp.depth)


def rollout_gae(traj: Transition, next_values: Array, gamma: float, lam: float
                ) -> tuple[Array, Array]:
  """(advantages, returns) [T, N] of a rollout: ``advantages.gae_episodes`` with environments
  as rows, V'_t = ``next_values`` (the critic at ``final_obs``), d_t = γ·(1 − terminal_t) and
  c_t = 1 − (terminal_t ∨ truncated_t)."""
  chex.assert_equal_shape([traj.reward, traj.value, next_values, traj.terminated])
  discounts = gamma * (1.0 - traj.terminated.astype(jnp.float32))
  continues = ~(traj.terminated | traj.truncated)
  adv, ret = adv_lib.gae_episodes(traj.reward.T, traj.value.T, next_values.T, discounts.T,
                                  continues.T, lam)
  return adv.T, ret.T


def loss_fn(net: agent.ActorCritic, hp: Hyper, params, batch: Transition, adv: Array,
            ret: Array) -> tuple[Array, dict[str, Array]]:
  """``losses.ppo_loss`` on a minibatch of b steps, read as one [1, b] "sequence"."""
  logits, values = net.apply(params, batch.obs)
  chunk = max(logprobs.DEFAULT_CHUNK, batch.action.shape[0])
  logp = logprobs.selective_log_softmax(logits, batch.action, chunk_size=chunk)
  entropy = logprobs.entropy_from_logits(logits, chunk_size=chunk)
  row = lambda x: x[None]  # noqa: E731
  mask = jnp.ones((1, batch.action.shape[0]), jnp.bool_)
  adv = ops.masked_whiten(row(adv), mask, shift_mean=True)
  return losses.ppo_loss(
      row(logp), row(batch.logp), adv, row(values), row(batch.value), row(ret), mask,
      row(entropy), vf_coef=hp.vf_coef, ent_coef=hp.ent_coef, clip_eps=hp.clip_eps,
      value_clip=hp.value_clip)


def init(hp: Hyper, key: Array) -> TrainState:
  """Fresh parameters, optimizer and N reset environments from one key."""
  env, env_params = envs.make(hp.env)
  net = network(hp)
  key, k_net, k_env = jax.random.split(key, 3)
  obs, env_state = envs.reset(env, env_params, k_env, hp.num_envs)
  params = net.init(k_net, obs[:1])
  return TrainState(params, make_optimizer(hp).init(params), env_state, obs,
                    envs.Episodes.zeros(hp.num_envs), key, jnp.zeros((), jnp.int32))


def make_iteration(hp: Hyper) -> Callable[[TrainState], tuple[TrainState, dict[str, Array]]]:
  """One PPO iteration: rollout, GAE, update. Pure; jit it, scan it, vmap it."""
  hp.check()
  env, env_params = envs.make(hp.env)
  net, opt = network(hp), make_optimizer(hp)
  grad_fn = jax.value_and_grad(lambda p, b, a, r: loss_fn(net, hp, p, b, a, r), has_aux=True)

  def env_step(carry, _):
    state = carry
    key, k_act, k_env = jax.random.split(state.key, 3)
    logits, value = net.apply(state.params, state.obs)
    action = jax.random.categorical(k_act, logits)
    logp = logprobs.selective_log_softmax(logits, action)
    out, env_state = envs.step(env, env_params, k_env, state.env_state, action)
    episodes = state.episodes.record(out.reward, out.terminated | out.truncated)
    t = Transition(state.obs, action, logp, value, out.reward, out.terminated, out.truncated,
                   out.final_obs)
    return state._replace(env_state=env_state, obs=out.obs, episodes=episodes, key=key), t

  def minibatch(params_opt, mb):
    params, opt_state = params_opt
    (_, metrics), grads = grad_fn(params, *mb)
    updates, opt_state = opt.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), metrics

  def iteration(state: TrainState) -> tuple[TrainState, dict[str, Array]]:
    state, traj = jax.lax.scan(env_step, state, None, length=hp.num_steps)
    _, next_values = net.apply(state.params, traj.final_obs)
    adv, ret = rollout_gae(traj, next_values, hp.gamma, hp.lam)
    flat = jax.tree.map(lambda x: x.reshape((hp.batch_size,) + x.shape[2:]), (traj, adv, ret))
    key, k_perm = jax.random.split(state.key)
    perms = jax.vmap(lambda k: jax.random.permutation(k, hp.batch_size))(
        jax.random.split(k_perm, hp.num_epochs))
    order = perms.reshape(hp.num_epochs * hp.num_minibatches, -1)  # [E·M, b]
    mbs = jax.tree.map(lambda x: x[order], flat)
    (params, opt_state), metrics = jax.lax.scan(minibatch, (state.params, state.opt_state), mbs)
    metrics = jax.tree.map(jnp.mean, metrics)
    ep = state.episodes
    metrics.update({
        "episode/return": jnp.mean(ep.last_ret),  # last finished episode of each environment
        "episode/length": jnp.mean(ep.last_length),
        "episode/finished": jnp.sum(ep.finished).astype(jnp.float32),
        "episode/terminated_frac": jnp.mean(traj.terminated.astype(jnp.float32)),
        "episode/truncated_frac": jnp.mean(traj.truncated.astype(jnp.float32)),
        "objective/advantage_raw": jnp.mean(adv),
    })
    state = state._replace(params=params, opt_state=opt_state, key=key, update=state.update + 1)
    return state, metrics

  return iteration


def iterations(iteration, length: int):
  """``length`` iterations in one ``lax.scan``: state → (state, metrics {name: [length]}). The
  whole run (``make_train``) and the CLI's chunks (``runner``) are this scan."""
  return lambda state: jax.lax.scan(lambda s, _: iteration(s), state, None, length=length)


def make_train(hp: Hyper) -> Callable[[Array], tuple[TrainState, dict[str, Array]]]:
  """``train(key) → (final TrainState, metrics {name: [num_updates]})``: the whole run, every
  iteration inside one ``lax.scan``. ``jax.jit(train)`` compiles it once;
  ``jax.jit(jax.vmap(train))(keys)`` trains one agent per key in one call."""
  iteration = make_iteration(hp)

  def train(key: Array) -> tuple[TrainState, dict[str, Array]]:
    return iterations(iteration, hp.num_updates)(init(hp, key))

  return train


def first_reaching(returns: Array, target: float) -> Array:
  """The first index (iteration) whose return is >= ``target``, along the last axis; −1 where
  none is."""
  hit = returns >= target
  return jnp.where(jnp.any(hit, axis=-1), jnp.argmax(hit, axis=-1), -1)
