"""A run from a config, built: the models (loaded or initialised), rewards, mesh, sharded
``TrainState`` and compiled step (``build``), ready for ``runner.run``'s loop or for a
deviceless compile (``ppojax.run.aot``). The config's algorithm is resolved first
(``algorithms.resolve``): a critic and its optimizer exist only where the estimator needs one,
a reference only where there is a KL penalty.
"""

from __future__ import annotations

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

from ppojax.core import algorithms
from ppojax.core.optim import lr_schedule, make_optimizer
from ppojax.data import encoding
from ppojax.infra import sharding as sharding_lib
from ppojax.learner import state as state_lib
from ppojax.learner import step as step_lib
from ppojax.models import (
  SMOLLM2_NAMES,
  CausalLM,
  LoadedModel,
  ModelConfig,
  ValueModel,
  abstract_model,
  hf,
  init_params,
  load_model,
  lora,
  model_config,
  partition_rules,
  public,
)
from ppojax.rollout.sampling import SamplingConfig
from ppojax.run import checks as checks_lib
from ppojax.tasks import count, sources


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


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


def tiny_model_config(c: ml_collections.ConfigDict) -> ModelConfig:
  """A small random-init Llama-style model (``model.policy = "tiny"``)."""
  return ModelConfig(
      model_type="llama", vocab_size=c.vocab_size, hidden_size=c.hidden_size,
      intermediate_size=c.intermediate_size, num_layers=c.num_layers, num_heads=c.num_heads,
      num_kv_heads=c.num_kv_heads, head_dim=c.hidden_size // c.num_heads,
      max_position_embeddings=c.max_position_embeddings, norm_eps=1e-5, tie_word_embeddings=True,
      bos_token_id=count.BOS, eos_token_id=count.STOP, pad_token_id=count.STOP)


def _numerics(config) -> dict:
  return dict(dtype=config.model.dtype, remat=config.model.remat,
              remat_policy=config.model.remat_policy, scan_layers=config.model.scan_layers)


def cast_floats(tree, dtype: str):
  """``tree``'s floating-point leaves (arrays or ``jax.ShapeDtypeStruct``s, shardings kept) in
  ``dtype``, new buffers; ``dtype`` "": copies as they are."""
  def one(x):
    to = jnp.dtype(dtype) if dtype and jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
    if isinstance(x, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(x.shape, to, sharding=x.sharding)
    return x.astype(to) if to != x.dtype else jnp.copy(x)
  return jax.tree.map(one, tree)


def load_tokenizer(name: str):
  """The tokenizer of a Hugging Face directory or hub id, a GGUF file or "smollm2"."""
  name = str(name)
  if name.lower() in SMOLLM2_NAMES or name.endswith(".gguf"):
    from ppojax.models import gguf  # pylint: disable=import-outside-toplevel
    return gguf.read_tokenizer(gguf.fetch_smollm2() if not name.endswith(".gguf") else name)
  from transformers import AutoTokenizer  # pylint: disable=import-outside-toplevel
  return AutoTokenizer.from_pretrained(str(hf.resolve(name)))


def load_named(name: str, key, *, tiny=None, tokenizer: str = "", head: str = "lm",
               abstract: bool = False, with_tokenizer: bool = True, **numerics) -> LoadedModel:
  """A model by config name: "tiny" (random init from the ``tiny`` section; with a
  ``tokenizer`` its vocabulary and special ids come from it, else from the token tasks of
  ppojax/tasks/count.py) or anything ``load_model`` accepts. ``tokenizer``, when set, replaces the
  checkpoint's. A value head is zero-initialised (V = 0, or r = 0 for a reward model).
  ``abstract``: the same model with ``jax.ShapeDtypeStruct`` params (``models.abstract_model``);
  no weights are read and no tokenizer is loaded; ``with_tokenizer=False``: none is read from
  a Hugging Face directory either (``load_model``)."""
  tok = load_tokenizer(tokenizer) if tokenizer and not abstract else None
  if name != "tiny":
    if abstract:
      return abstract_model(model_config(name, **numerics), head)
    model = load_model(name, head=head, with_tokenizer=with_tokenizer, **numerics)
    return model._replace(tokenizer=tok) if tok is not None else model
  if tok is None:
    cfg = tiny_model_config(tiny)
  else:
    cfg = tiny_model_config(ml_collections.ConfigDict(dict(tiny.to_dict(),
                                                           vocab_size=len(tok)))).replace(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=encoding.pad_token_id(tok))
  cfg = cfg.replace(**numerics)
  if abstract:
    return abstract_model(cfg, head)
  module = ValueModel(cfg) if head == "value" else CausalLM(cfg)
  params = init_params(module, key)
  if head == "value":
    params = dict(params, score=jax.tree.map(jnp.zeros_like, params["score"]))
  return LoadedModel(cfg, params, tok, head)


def load_policy(config, key, abstract: bool = False) -> LoadedModel:
  m = config.model
  return load_named(m.policy, key, tiny=m.tiny, tokenizer=m.tokenizer, abstract=abstract,
                    **_numerics(config))


def critic_from_policy(policy: LoadedModel) -> LoadedModel:
  """A ValueModel with the policy's backbone and a zero head (V = 0 at the start)."""
  if _is_abstract(policy.params):
    return abstract_model(policy.cfg, "value")
  head = {"kernel": jnp.zeros((policy.cfg.hidden_size, 1), jnp.float32)}
  backbone = jax.tree.map(jnp.copy, policy.params["model"])  # own buffers: the state is donated
  return LoadedModel(policy.cfg, {"model": backbone, "score": head},
                     policy.tokenizer, "value")


def _import(path: str):
  module, _, name = path.partition(":")
  if not name:
    raise ValueError(f"reward.fn={path!r}: expected 'package.module:function'")
  return getattr(importlib.import_module(module), name)


# ---------------------------------------------------------------------------------------------
# Build
# ---------------------------------------------------------------------------------------------


def sampling_config(config, policy: LoadedModel) -> SamplingConfig:
  s = config.sampling
  stop_ids = tuple(s.stop_ids) if s.stop_ids else _eos_ids(policy)
  pad_id = s.pad_id if s.pad_id is not None else policy.cfg.pad_token_id
  pad_id = stop_ids[0] if pad_id is None else pad_id  # pad id 0 is a valid id
  return SamplingConfig(max_new_tokens=s.max_new_tokens, stop_ids=stop_ids, pad_id=pad_id,
                        temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                        min_new_tokens=s.min_new_tokens,
                        num_samples_per_prompt=s.get("num_samples_per_prompt", 1))


def _eos_ids(policy: LoadedModel) -> tuple[int, ...]:
  eos = policy.cfg.eos_token_id
  if eos is None:
    raise ValueError("the policy's config has no eos_token_id: set sampling.stop_ids")
  return tuple(eos) if isinstance(eos, (tuple, list)) else (eos,)


def validate(config, num_devices: int | None = None) -> None:
  """Every check that needs no model weights (``ppojax.run.checks.validate``): option names and
  types, choices, sizes against the devices (default: those present) and the policy's context
  length."""
  num_devices = jax.device_count() if num_devices is None else num_devices
  checks_lib.validate(config, num_devices, _context_length(config))


def _context_length(config) -> int | None:
  """The policy's context length from its config alone (None where that needs a download)."""
  name = str(config.model.policy)
  if name == "tiny":
    return config.model.tiny.max_position_embeddings
  if name.lower() in SMOLLM2_NAMES or name.endswith(".gguf"):
    from ppojax.models import gguf  # pylint: disable=import-outside-toplevel
    return gguf.context_length(gguf.fetch_smollm2() if not name.endswith(".gguf") else name)
  path = pathlib.Path(name).expanduser()
  hf_config = hf.read_config(path) if (path / "config.json").is_file() else public.lookup(name)
  if hf_config is not None:
    return hf_config.get("max_position_embeddings") or hf_config.get("n_positions")
  return None


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
  rl = config.rl
  with_critic = algorithm.needs_critic
  with_reference = step_lib.needs_reference(rl)  # else KL ≡ 0: no reference is held
  key = jax.random.key(config.seed)
  key, k_policy = jax.random.split(key)
  policy = load_policy(config, k_policy, abstract)
  checks_lib.check_sizes(config, len(devices), policy.cfg.max_position_embeddings)
  source = None
  if not abstract:
    # The data next (it needs the policy's tokenizer): a bad file, a missing field or a prompt
    # the tokenizer cannot render fails here, before any other model loads or anything compiles.
    source = sources.make_source(config, policy.tokenizer)
    source.batch(0)
  reward_model = None
  if config.reward.kind == "model":
    reward_model = load_named(config.model.reward, jax.random.fold_in(k_policy, 1),
                              tiny=config.model.tiny, head="value", abstract=abstract,
                              with_tokenizer=False, **_numerics(config))  # the policy's serves
    if reward_model.cfg.vocab_size < policy.cfg.vocab_size:  # its embedding would read past
      raise ValueError(  # its end (NaN scores): it cannot share the policy's tokenizer
          f"model.reward={config.model.reward!r} has a vocabulary of "
          f"{reward_model.cfg.vocab_size} tokens, the policy {config.model.policy!r} "
          f"{policy.cfg.vocab_size}: the reward model reads the policy's tokens, so it must be "
          "trained with the same tokenizer (e.g. ppojax.supervised.train_rm from the policy)")
  init = config.model.critic_init
  if init == "reward" and reward_model is None:
    raise ValueError("model.critic_init='reward' needs reward.kind='model' and model.reward")
  critic = None
  lora_critic = with_critic and config.lora.critic
  if with_critic and not lora_critic:
    critic = reward_model if init in ("reward", "auto") and reward_model else (
        critic_from_policy(policy))

  if (source and source.prefix
      and any(m.cfg.layer_windows for m in (policy, critic, reward_model) if m)):
    source = sources.make_source(config, policy.tokenizer, shared_prefix=False)  # see Decoder
  sampler_dtype = config.sampling.dtype
  policy_cfg = policy.cfg  # with LoRA: the base's, and the policy module's has the adapters
  if config.lora.rank:
    policy_cfg = lora.adapted_config(policy.cfg, config.lora.rank, config.lora.alpha,
                                     config.lora.targets, config.lora.dropout)
  with_sampler = (sampler_dtype and sampler_dtype != policy.cfg.dtype) or config.lora.rank
  critic_module = ValueModel(policy_cfg) if lora_critic else (
      ValueModel(critic.cfg) if critic else None)
  models = state_lib.Models(
      policy=CausalLM(policy_cfg), critic=critic_module,
      reward=ValueModel(reward_model.cfg) if reward_model else None,
      reward_fn=_import(config.reward.fn) if config.reward.kind == "jax" else None,
      # LoRA samples from the merged weights with the base's architecture (lora.merge)
      sampler=(CausalLM(policy.cfg.replace(dtype=sampler_dtype or policy.cfg.dtype))
               if with_sampler else None),
      reference=CausalLM(policy.cfg) if config.lora.rank else None)
  host_reward = python_reward = None
  if config.reward.kind == "python":
    python_reward = _import(config.reward.fn)
    host_reward = lambda rollout, records: python_reward(rollout)  # noqa: E731
  elif config.reward.kind == "text":
    host_reward = _text_reward(config, policy)
    python_reward = _records_required

  optim = config.optim
  updates = config.num_iterations * rl.num_epochs * rl.num_minibatches
  schedules = {name: lr_schedule(o.lr, updates, o.warmup_steps, o.decay, o.end_factor)
               for name, o in (("actor", optim.actor), ("critic", optim.critic))}
  txs = {name: make_optimizer(schedules[name], optim.max_grad_norm, optim[name].weight_decay,
                              state_dtype=optim.state_dtype)
         for name in schedules}

  mesh = sharding_lib.make_mesh(tuple(config.mesh.shape), devices=devices)
  rules = partition_rules()
  actor_params, base = policy.params, None
  if config.lora.rank:  # train adapters only; the frozen base rides in the state, uncopied
    base = (cast_floats(policy.params, config.lora.base_dtype) if config.lora.base_dtype
            else policy.params)
    adapters = functools.partial(lora.init_adapters, cfg=policy_cfg,
                                 key=jax.random.fold_in(k_policy, 2))
    actor_params = jax.eval_shape(adapters, base) if abstract else adapters(base)
  init = lambda actor, critic, base: step_lib.init_state(  # noqa: E731
      key, actor, critic, txs["actor"], txs["critic"], rl, base)
  critic_params = None if critic is None else critic.params
  if lora_critic:  # its own adapters and a zero value head on the policy's base
    critic_adapters = functools.partial(lora.init_adapters, cfg=policy_cfg,
                                        key=jax.random.fold_in(k_policy, 3))
    head = {"kernel": jnp.zeros((policy.cfg.hidden_size, 1), jnp.float32)}
    model_adapters = (jax.eval_shape(critic_adapters, base) if abstract
                      else critic_adapters(base))["model"]
    critic_params = {"model": model_adapters,
                     "score": jax.eval_shape(lambda: head) if abstract else head}
  state_shardings = sharding_lib.param_shardings(
      jax.eval_shape(init, actor_params, critic_params, base), mesh, rules)
  reward_shardings = None if reward_model is None else (
      sharding_lib.param_shardings(reward_model.params, mesh, rules))
  if abstract:
    state = _abstract(jax.eval_shape(init, actor_params, critic_params, base), state_shardings)
    reward_params = None if reward_model is None else _abstract(reward_model.params,
                                                                  reward_shardings)
  else:
    state = sharding_lib.place(init(actor_params, critic_params, base), state_shardings)
    reward_params = None if reward_model is None else sharding_lib.place(reward_model.params,
                                                                         reward_shardings)
  # the reference: a copy of the initial policy (own buffers: the state is donated)
  frozen_dtype = config.model.frozen_dtype
  with_copy = with_reference and not config.lora.rank  # LoRA's reference is its base
  frozen = state_lib.Frozen(cast_floats(state.actor, frozen_dtype) if with_copy else None,
                           None if reward_params is None else (
                               cast_floats(reward_params, frozen_dtype) if frozen_dtype
                               else reward_params))

  sampling = sampling_config(config, policy)
  step = step_lib.make_step(models, algorithm, txs["actor"], txs["critic"], schedules["actor"],
                            sampling, rl, python_reward=python_reward,
                            state_shardings=state_shardings, mesh=mesh)
  return Run(config, models, frozen, state, step, mesh, state_shardings, source,
             policy._replace(params=None), host_reward, sampling, algorithm)


def _text_reward(config, policy: LoadedModel):
  if policy.tokenizer is None:
    raise ValueError("reward.kind='text' decodes completions, but the policy has no tokenizer")
  score = sources.text_reward(_import(config.reward.fn), policy.tokenizer, config.data.field)
  return lambda rollout, records: score(rollout.responses, rollout.mask, records)


def _records_required(rollout):
  raise RuntimeError("a text reward needs the batch's records: score it through "
                     "runner.iteration(run, state, prompts, records)")


def _abstract(state, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      state, shardings)


def _is_abstract(params) -> bool:
  return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params))
