"""A run from a config, built: the models (loaded or initialised, ppojax/run/models.py),
rewards, mesh, sharded ``TrainState`` and compiled step (``build``), ready for ``runner.run``'s
loop or for a deviceless compile (``ppojax.run.aot``). The config's algorithm is resolved first
(``algorithms.resolve``): a critic and its optimizer exist only where the estimator needs one,
a reference only where there is a KL penalty.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import os
import pathlib
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from ppojax import envs
from ppojax.core import algorithms
from ppojax.core.optim import lr_schedule, make_optimizer
from ppojax.infra import sharding as sharding_lib
from ppojax.infra.trees import cast_floats
from ppojax.learner import state as state_lib
from ppojax.learner import step as step_lib
from ppojax.models import CausalLM, LoadedModel, ValueModel, lora, partition_rules
from ppojax.rollout.host_turns import on_host
from ppojax.rollout.sampling import SamplingConfig
from ppojax.run import checks as checks_lib
from ppojax.run import models as models_lib
from ppojax.tasks import sources


class Run(NamedTuple):
  """Everything a training loop needs, built from a config by ``build``."""

  config: ml_collections.ConfigDict
  models: state_lib.Models
  frozen: state_lib.Frozen
  state: state_lib.TrainState
  step: step_lib.Step
  mesh: jax.sharding.Mesh
  state_shardings: Any
  source: sources.Source  # data position → a batch of prompts (host arrays) and records
  # the initial policy's config and tokenizer, for export; its params are None: the state
  # holds the weights (kept here too, the loaded host copy doubled the policy's memory)
  policy: LoadedModel
  # a host reward: (rollout as NumPy arrays, the batch's records) → scores [B]; None when the
  # reward is traced into the compiled step
  host_reward: Callable[[Any, list[dict] | None], np.ndarray] | None
  sampling: SamplingConfig
  algorithm: algorithms.Algorithm  # the record the step was built from (algorithms.from_config)
  env: Any = None  # the multi-turn environment (traced or on the host; evaluation plays it too)


def load_config(path: str | os.PathLike, **overrides) -> ml_collections.ConfigDict:
  """``get_config()`` of a config file, with overrides as keyword arguments whose names use
  "__" for nesting (``rl__kl_coef=0.1``) — the Python twin of ``--config.rl.kl_coef=0.1``.
  ``"file.py:arg"`` calls ``get_config("arg")``, as ``--config file.py:arg`` does."""
  path, arg = str(path), None
  if not pathlib.Path(path).is_file() and ":" in path:
    path, arg = path.rsplit(":", 1)
  spec = importlib.util.spec_from_file_location(pathlib.Path(path).stem, path)
  if spec is None or not pathlib.Path(path).is_file():
    raise FileNotFoundError(f"config file {path} not found")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config() if arg is None else module.get_config(arg)
  for name, value in overrides.items():
    *sections, field = name.split("__")
    node = config
    for section in sections:
      node = node[section]
    if field not in node:
      raise KeyError(f"{path} has no field {'.'.join(sections + [field])}")
    node[field] = value
  return config


def validate(config, num_devices: int | None = None) -> None:
  """Every check that needs no model weights (``ppojax.run.checks.validate``): option names and
  types, choices, sizes against the devices (default: those present) and the policy's context
  length."""
  num_devices = jax.device_count() if num_devices is None else num_devices
  checks_lib.validate(config, num_devices, models_lib.context_length(config))


def build(config, *, devices=None, abstract: bool = False) -> Run:
  """Models, mesh, sharded ``TrainState``, compiled step and data of a run.

  ``devices``: the mesh's devices (default ``jax.devices()``). ``abstract``: parameters, state
  and frozen models are ``jax.ShapeDtypeStruct``s carrying their shardings, no weights are read
  and no data is loaded (``Run.source`` is None): the same step, ready to ``.lower()`` for
  devices that need not be present (``ppojax.run.aot``)."""
  devices = list(jax.devices() if devices is None else devices)
  validate(config, len(devices))
  config = algorithms.resolve(config)  # its choices written out, for config.json and resume
  algorithm = algorithms.from_config(config)
  key = jax.random.key(config.seed)
  key, k_policy = jax.random.split(key)
  policy = models_lib.load_policy(config, k_policy, abstract)
  checks_lib.check_sizes(config, len(devices), policy.cfg.max_position_embeddings)
  source = None if abstract else _load_source(config, policy)
  reward_model = None
  if config.reward.kind == "model":
    reward_model = models_lib.load_reward_model(config, policy, jax.random.fold_in(k_policy, 1),
                                                abstract)
  critic = _initial_critic(config, algorithm, policy, reward_model)
  models = _modules(config, algorithm, policy, critic, reward_model)
  host_reward, python_reward = _host_rewards(config, policy)
  txs, schedules = _optimizers(config)
  mesh = sharding_lib.make_mesh(tuple(config.mesh.shape), devices=devices)
  params = _initial_params(config, algorithm, policy, critic, k_policy, abstract)
  state, state_shardings = _initial_state(config, key, txs, params, mesh, abstract)
  reward_params = _reward_params(reward_model, mesh, abstract)
  frozen = _frozen(config, state, reward_params)
  sampling = sampling_config(config, policy)
  host_env = None
  if on_host(models.env):  # a host environment: out of the static models
    models, host_env = dataclasses.replace(models, env=None), models.env
  step = step_lib.make_step(models, algorithm, txs["actor"], txs["critic"], schedules["actor"],
                            sampling, config.rl, python_reward=python_reward,
                            state_shardings=state_shardings, mesh=mesh, host_env=host_env)
  return Run(config, models, frozen, state, step, mesh, state_shardings, source,
             policy._replace(params=None), host_reward, sampling, algorithm,
             host_env or models.env)


def _load_source(config, policy: LoadedModel) -> sources.Source:
  """The prompt source, its first batch drawn: it needs the policy's tokenizer, and a bad file,
  a missing field or a prompt the tokenizer cannot render fails here, before any other model
  loads or anything compiles."""
  source = sources.make_source(config, policy.tokenizer)
  source.batch(0)
  return source


def _initial_critic(config, algorithm, policy, reward_model) -> LoadedModel | None:
  """The critic's initial model: the reward model (``model.critic_init`` "reward", or "auto"
  with one) or the policy's backbone with a zero head; None without a critic, and with LoRA's
  (``lora.critic``: adapters on the policy's base, ``_initial_params``)."""
  init = config.model.critic_init
  if init == "reward" and reward_model is None:
    raise ValueError("model.critic_init='reward' needs reward.kind='model' and model.reward")
  if not algorithm.needs_critic or _lora_critic(config, algorithm):
    return None
  return reward_model if init in ("reward", "auto") and reward_model else (
      models_lib.critic_from_policy(policy))


def _lora_critic(config, algorithm) -> bool:
  return algorithm.needs_critic and config.lora.critic


def _policy_config(config, policy: LoadedModel):
  """The policy module's config: with LoRA the base's plus the adapters, else the base's."""
  if not config.lora.rank:
    return policy.cfg
  return lora.adapted_config(policy.cfg, config.lora.rank, config.lora.alpha,
                             config.lora.targets, config.lora.dropout)


def _modules(config, algorithm, policy, critic, reward_model) -> state_lib.Models:
  """The Flax modules of the run's models, its traced reward function (``reward.kind`` "jax")
  and its traced environment (``env.name``)."""
  sampler_dtype = config.sampling.dtype
  policy_cfg = _policy_config(config, policy)
  with_sampler = (sampler_dtype and sampler_dtype != policy.cfg.dtype) or config.lora.rank
  critic_module = ValueModel(policy_cfg) if _lora_critic(config, algorithm) else (
      ValueModel(critic.cfg) if critic else None)
  return state_lib.Models(
      policy=CausalLM(policy_cfg), critic=critic_module,
      reward=ValueModel(reward_model.cfg) if reward_model else None,
      reward_fn=_import(config.reward.fn) if config.reward.kind == "jax" else None,
      # LoRA samples from the merged weights with the base's architecture (lora.merge)
      sampler=(CausalLM(policy.cfg.replace(dtype=sampler_dtype or policy.cfg.dtype))
               if with_sampler else None),
      reference=CausalLM(policy.cfg) if config.lora.rank else None,
      env=envs.make_env(config, policy.tokenizer, sampling_config(config, policy)))


def _host_rewards(config, policy: LoadedModel) -> tuple[Callable | None, Callable | None]:
  """(host reward for ``Run.host_reward``, python reward for the step) of ``reward.kind``
  "python" or "text"; (None, None) for a reward traced into the step."""
  if config.reward.kind == "python":
    python_reward = _import(config.reward.fn)
    return (lambda rollout, records: python_reward(rollout)), python_reward
  if config.reward.kind == "text":
    return _text_reward(config, policy), _records_required
  return None, None


def _optimizers(config) -> tuple[dict, dict]:
  """(optimizers, learning-rate schedules) of the actor and the critic, by name."""
  optim, rl = config.optim, config.rl
  updates = config.num_iterations * rl.num_epochs * rl.num_minibatches
  schedules = {name: lr_schedule(o.lr, updates, o.warmup_steps, o.decay, o.end_factor)
               for name, o in (("actor", optim.actor), ("critic", optim.critic))}
  txs = {name: make_optimizer(schedules[name], optim.max_grad_norm, optim[name].weight_decay,
                              state_dtype=optim.state_dtype)
         for name in schedules}
  return txs, schedules


def _initial_params(config, algorithm, policy, critic, k_policy, abstract: bool) -> tuple:
  """(actor, critic, base): the trained parameters the state starts from and LoRA's frozen
  base (None without LoRA). With LoRA the actor trains adapters on the base (cast to
  ``lora.base_dtype`` when set), and with ``lora.critic`` so does the critic, under a zero value
  head."""
  policy_cfg = _policy_config(config, policy)
  actor_params, base = policy.params, None
  if config.lora.rank:  # train adapters only; the frozen base rides in the state, uncopied
    base = (cast_floats(policy.params, config.lora.base_dtype, copy=True) if config.lora.base_dtype
            else policy.params)
    actor_params = _adapters(base, policy_cfg, jax.random.fold_in(k_policy, 2), abstract)
  critic_params = None if critic is None else critic.params
  if _lora_critic(config, algorithm):  # its own adapters and a zero value head on the base
    head = {"kernel": jnp.zeros((policy.cfg.hidden_size, 1), jnp.float32)}
    model_adapters = _adapters(base, policy_cfg, jax.random.fold_in(k_policy, 3),
                               abstract)["model"]
    critic_params = {"model": model_adapters,
                     "score": jax.eval_shape(lambda: head) if abstract else head}
  return actor_params, critic_params, base


def _adapters(base, cfg, key, abstract: bool):
  """LoRA adapters on ``base`` (``lora.init_adapters``; ``abstract``: their shapes)."""
  adapters = functools.partial(lora.init_adapters, cfg=cfg, key=key)
  return jax.eval_shape(adapters, base) if abstract else adapters(base)


def _initial_state(config, key, txs, params, mesh, abstract: bool) -> tuple:
  """(state, its shardings): the ``TrainState`` of ``params`` = (actor, critic, base), placed
  by the partition rules (``abstract``: shapes carrying their shardings)."""
  def init(actor, critic, base):
    return state_lib.init_state(key, actor, critic, txs["actor"], txs["critic"], config.rl, base)
  shardings = sharding_lib.param_shardings(jax.eval_shape(init, *params), mesh,
                                           partition_rules())
  if abstract:
    return _abstract(jax.eval_shape(init, *params), shardings), shardings
  return sharding_lib.place(init(*params), shardings), shardings


def _reward_params(reward_model: LoadedModel | None, mesh, abstract: bool):
  """The reward model's parameters placed by the partition rules (None without one)."""
  if reward_model is None:
    return None
  shardings = sharding_lib.param_shardings(reward_model.params, mesh, partition_rules())
  if abstract:
    return _abstract(reward_model.params, shardings)
  return sharding_lib.place(reward_model.params, shardings)


def _frozen(config, state, reward_params) -> state_lib.Frozen:
  """The reference (a copy of the initial policy, own buffers: the state is donated; none with
  LoRA, whose reference is its base, or without a KL penalty) and the reward model, in
  ``model.frozen_dtype`` when set."""
  frozen_dtype = config.model.frozen_dtype
  with_copy = state_lib.needs_reference(config.rl) and not config.lora.rank  # else KL ≡ 0
  return state_lib.Frozen(cast_floats(state.actor, frozen_dtype, copy=True) if with_copy else None,
                          None if reward_params is None else (
                              cast_floats(reward_params, frozen_dtype, copy=True) if frozen_dtype
                              else reward_params))


def sampling_config(config, policy: LoadedModel) -> SamplingConfig:
  s = config.sampling
  stop_ids = tuple(s.stop_ids) if s.stop_ids else _eos_ids(policy)
  pad_id = s.pad_id if s.pad_id is not None else policy.cfg.pad_token_id
  pad_id = stop_ids[0] if pad_id is None else pad_id  # pad id 0 is a valid id
  return SamplingConfig(max_new_tokens=s.max_new_tokens, stop_ids=stop_ids, pad_id=pad_id,
                        temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                        min_new_tokens=s.min_new_tokens,
                        num_samples_per_prompt=s.get("num_samples_per_prompt", 1),
                        layers=s.get("decode_layers", "auto"),
                        stop_check_every=s.get("stop_check_every", 0))


def _eos_ids(policy: LoadedModel) -> tuple[int, ...]:
  eos = policy.cfg.eos_token_id
  if eos is None:
    raise ValueError("the policy's config has no eos_token_id: set sampling.stop_ids")
  return tuple(eos) if isinstance(eos, (tuple, list)) else (eos,)


def _text_reward(config, policy: LoadedModel):
  if policy.tokenizer is None:
    raise ValueError("reward.kind='text' decodes completions, but the policy has no tokenizer")
  score = sources.text_reward(_import(config.reward.fn), policy.tokenizer, config.data.field)
  return lambda rollout, records: score(rollout.responses, rollout.mask, records)


def _records_required(rollout):
  raise RuntimeError("a text reward needs the batch's records: score it through "
                     "runner.iteration(run, state, prompts, records)")


def _import(path: str):
  module, _, name = path.partition(":")
  if not name:
    raise ValueError(f"reward.fn={path!r}: expected 'package.module:function'")
  try:
    return getattr(importlib.import_module(module), name)
  except AttributeError as e:
    raise ValueError(f"{path!r}: {e}") from None


def _abstract(state, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      state, shardings)

