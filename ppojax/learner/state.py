"""The records an RL iteration passes around, and how the parameter trees they hold combine:

    TrainState  what trains and changes every iteration (params, optimizer states, KL, step, key)
    Frozen      what never trains (the reference policy, the reward model)
    Models      the modules (static) and how a sequence is scored
    Context     what the update's forward passes read besides the trained parameters

``policy_params`` and ``critic_params`` assemble a model's whole parameter tree from these
(with LoRA: the frozen base and the trained adapters); ``init_state`` is the state before the
first iteration.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from ppojax.core import kl as kl_lib
from ppojax.models import lora
from ppojax.rollout.rollout import RewardFn

Array = jax.Array
Params = Any


class TrainState(NamedTuple):
  actor: Params  # the policy's trained parameters: all of them, or with LoRA its adapters
  critic: Params | None  # None: no critic (the estimator needs none)
  actor_opt: optax.OptState
  critic_opt: optax.OptState | None
  kl: kl_lib.KLControllerState
  step: Array  # completed PPO iterations, int32
  key: Array  # typed PRNG key
  # LoRA: the policy's frozen base (never stepped nor checkpointed; also the reference policy).
  # None: full fine-tuning
  base: Params | None = None


class Frozen(NamedTuple):
  """Parameters that never train: the reference policy (None without a KL penalty) and the
  reward model (or None)."""

  reference: Params | None
  reward: Params | None


@dataclasses.dataclass(frozen=True)
class Models:
  """The modules (hashable, static) and how a sequence is scored."""

  policy: nn.Module  # a CausalLM
  critic: nn.Module | None  # a ValueModel; None without a critic
  reward: nn.Module | None = None  # a ValueModel used as reward model, or
  reward_fn: RewardFn | None = None  # a JAX rule (prompts, prompt_mask, responses, mask) → [B]
  sampler: nn.Module | None = None  # generates with the policy's params (None: ``policy``)
  reference: nn.Module | None = None  # applies the reference's params (None: ``policy``)
  # a traced environment (``rollout.multiturn.TokenEnv``): multi-turn rollouts, its rewards
  # on each turn's last token (with no other reward, they are the whole reward)
  env: Any = None

  def __post_init__(self):
    if self.reward is not None and self.reward_fn is not None:
      raise ValueError("give one of reward (a reward model) and reward_fn, not both")


class Context(NamedTuple):
  """What the update's forward passes read besides the trained parameters.

  ``base``: LoRA's frozen base (then the actor's params are its adapters); None: full
  fine-tuning. ``dropout_key``: the key of LoRA's dropout on the adapters' input in this
  forward pass (``layers.Linear``); None: none (also for the models without dropout)."""

  base: Params | None = None
  dropout_key: Array | None = None


def policy_params(actor: Params, base: Params | None) -> Params:
  """The policy's whole parameter tree: ``actor`` itself, or with LoRA the frozen base and the
  adapters together (``lora.combine``; the gradient of a function of it flows to ``actor``)."""
  return actor if base is None else lora.combine(base, actor)


def critic_params(critic: Params, models: Models, base: Params | None) -> Params:
  """The critic's whole parameter tree: ``critic`` itself, or for a LoRA critic (its module's
  ``lora_rank`` > 0) the policy's frozen backbone with the critic's own adapters and value
  head (``critic`` = {"model": adapters, "score": head}): one copy of the base for both."""
  if critic is None or not models.critic.cfg.lora_rank:
    return critic
  return lora.combine({"model": base["model"]}, critic)


def kl_controller(cfg) -> kl_lib.KLController:
  """The KL coefficient's controller: adaptive (Ziegler et al. 2019) or fixed β."""
  if cfg.adaptive_kl:
    return kl_lib.adaptive_kl_controller(cfg.kl_coef, cfg.target_kl, cfg.kl_horizon)
  return kl_lib.fixed_kl_controller(cfg.kl_coef)


def needs_reference(cfg) -> bool:
  """Whether the KL penalty needs a reference policy (else KL ≡ 0 and none is held)."""
  return cfg.kl_coef > 0 or cfg.adaptive_kl


def init_state(key: Array, actor: Params, critic: Params | None, actor_tx, critic_tx, cfg,
               base: Params | None = None) -> TrainState:
  """The state before the first iteration; ``critic`` None: no critic and no critic optimizer
  state; ``base`` (LoRA): the frozen base beside the adapters ``actor``, the only trained and
  optimised parameters."""
  return TrainState(
      actor=actor, critic=critic, actor_opt=actor_tx.init(actor),
      critic_opt=None if critic is None else critic_tx.init(critic),
      kl=kl_controller(cfg).init(), step=jnp.zeros((), jnp.int32), key=key, base=base)
