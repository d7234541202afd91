"""A training run from a config: build the models, state, mesh and compiled step, then loop
(with checkpoints, metrics, sample tables, plots and the final export). ``ppojax.train`` is the
command line around ``run``.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import pathlib
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from ppojax import config as config_lib
from ppojax import data, evaluation, files, sources, tasks
from ppojax import sharding as sharding_lib
from ppojax import step as step_lib
from ppojax.experience import Prompts
from ppojax.models import (SMOLLM2_NAMES, CausalLM, LoadedModel, ModelConfig, ValueModel, hf,
                           abstract_model, init_params, load_model, model_config, partition_rules,
                           public, save_model)
from ppojax.sampling import SamplingConfig
from ppojax.signals import StopSignals

SHOWN = ("objective/scores", "objective/kl", "objective/entropy_masked", "policy/clipfrac_avg",
         "val/response_length")


class Run(NamedTuple):
  """Everything a training loop needs, built from a config by ``build``."""

  config: ml_collections.ConfigDict
  models: step_lib.Models
  frozen: step_lib.Frozen
  state: step_lib.TrainState
  step: step_lib.PPOStep
  mesh: jax.sharding.Mesh
  state_shardings: Any
  source: sources.Source  # data position → a batch of prompts (host arrays) and records
  policy: LoadedModel  # the initial policy (config and tokenizer, for export)
  # a host reward: (rollout as NumPy arrays, the batch's records) → scores [B]; None when the
  # reward is traced into the compiled step
  host_reward: Callable[[Any, list[dict] | None], np.ndarray] | None
  sampling: SamplingConfig


def load_config(path: str | os.PathLike, **overrides) -> ml_collections.ConfigDict:
  """``get_config()`` of a config file, with overrides as keyword arguments whose names use
  "__" for nesting (``ppo__kl_coef=0.1``) — the Python twin of ``--config.ppo.kl_coef=0.1``.
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
      bos_token_id=tasks.BOS, eos_token_id=tasks.STOP, pad_token_id=tasks.STOP)


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
    return load_model(name).tokenizer
  from transformers import AutoTokenizer  # pylint: disable=import-outside-toplevel
  return AutoTokenizer.from_pretrained(str(hf.resolve(name)))


def load_named(name: str, key, *, tiny=None, tokenizer: str = "", head: str = "lm",
               abstract: bool = False, **numerics) -> LoadedModel:
  """A model by config name: "tiny" (random init from the ``tiny`` section; with a
  ``tokenizer`` its vocabulary and special ids come from it, else from the token tasks of
  ppojax/tasks.py) or anything ``load_model`` accepts. ``tokenizer``, when set, replaces the
  checkpoint's. A value head is zero-initialised (V = 0, or r = 0 for a reward model).
  ``abstract``: the same model with ``jax.ShapeDtypeStruct`` params (``models.abstract_model``);
  no weights are read and no tokenizer is loaded."""
  tok = load_tokenizer(tokenizer) if tokenizer and not abstract else None
  if name != "tiny":
    if abstract:
      return abstract_model(model_config(name, **numerics), head)
    model = load_model(name, head=head, **numerics)
    return model._replace(tokenizer=tok) if tok is not None else model
  if tok is None:
    cfg = tiny_model_config(tiny)
  else:
    cfg = tiny_model_config(ml_collections.ConfigDict(dict(tiny.to_dict(),
                                                           vocab_size=len(tok)))).replace(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=data.pad_token_id(tok))
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
                        min_new_tokens=s.min_new_tokens)


def _eos_ids(policy: LoadedModel) -> tuple[int, ...]:
  eos = policy.cfg.eos_token_id
  if eos is None:
    raise ValueError("the policy's config has no eos_token_id: set sampling.stop_ids")
  return tuple(eos) if isinstance(eos, (tuple, list)) else (eos,)


def validate(config, num_devices: int | None = None) -> None:
  """Every check that needs no model weights (``ppojax.config.validate``): option names and
  types, choices, sizes against the devices (default: those present) and the policy's context
  length."""
  num_devices = jax.device_count() if num_devices is None else num_devices
  config_lib.validate(config, num_devices, _context_length(config))


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
  devices that need not be present (``ppojax.aot``)."""
  devices = list(jax.devices() if devices is None else devices)
  validate(config, len(devices))
  key = jax.random.key(config.seed)
  key, k_policy = jax.random.split(key)
  policy = load_policy(config, k_policy, abstract)
  config_lib.check_sizes(config, len(devices), policy.cfg.max_position_embeddings)
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
                              **_numerics(config))
  init = config.model.critic_init
  if init == "reward" and reward_model is None:
    raise ValueError("model.critic_init='reward' needs reward.kind='model' and model.reward")
  critic = reward_model if init in ("reward", "auto") and reward_model else (
      critic_from_policy(policy))

  if (source and source.prefix
      and any(m.cfg.layer_windows for m in (policy, critic, reward_model) if m)):
    source = sources.make_source(config, policy.tokenizer, shared_prefix=False)  # see Decoder
  sampler_dtype = config.sampling.dtype
  models = step_lib.Models(
      policy=CausalLM(policy.cfg), critic=ValueModel(critic.cfg),
      reward=ValueModel(reward_model.cfg) if reward_model else None,
      reward_fn=_import(config.reward.fn) if config.reward.kind == "jax" else None,
      sampler=(CausalLM(policy.cfg.replace(dtype=sampler_dtype))
               if sampler_dtype and sampler_dtype != policy.cfg.dtype else None))
  host_reward = python_reward = None
  if config.reward.kind == "python":
    python_reward = _import(config.reward.fn)
    host_reward = lambda rollout, records: python_reward(rollout)  # noqa: E731
  elif config.reward.kind == "text":
    host_reward = _text_reward(config, policy)
    python_reward = _records_required

  ppo, optim = config.ppo, config.optim
  updates = config.num_iterations * ppo.num_epochs * ppo.num_minibatches
  schedules = {name: step_lib.lr_schedule(o.lr, updates, o.warmup_steps, o.decay, o.end_factor)
               for name, o in (("actor", optim.actor), ("critic", optim.critic))}
  txs = {name: step_lib.make_optimizer(schedules[name], optim.max_grad_norm,
                                       optim[name].weight_decay, state_dtype=optim.state_dtype)
         for name in schedules}

  mesh = sharding_lib.make_mesh(tuple(config.mesh.shape), devices=devices)
  rules = partition_rules()
  init = lambda actor, critic: step_lib.init_state(  # noqa: E731
      key, actor, critic, txs["actor"], txs["critic"], ppo)
  state_shardings = sharding_lib.param_shardings(
      jax.eval_shape(init, policy.params, critic.params), mesh, rules)
  reward_shardings = None if reward_model is None else (
      sharding_lib.param_shardings(reward_model.params, mesh, rules))
  if abstract:
    state = _abstract(jax.eval_shape(init, policy.params, critic.params), state_shardings)
    reward_params = None if reward_model is None else _abstract(reward_model.params,
                                                                  reward_shardings)
  else:
    state = sharding_lib.place(init(policy.params, critic.params), state_shardings)
    reward_params = None if reward_model is None else sharding_lib.place(reward_model.params,
                                                                         reward_shardings)
  # the reference: a copy of the initial policy (own buffers: the state is donated)
  frozen_dtype = config.model.frozen_dtype
  frozen = step_lib.Frozen(cast_floats(state.actor, frozen_dtype),
                           None if reward_params is None else (
                               cast_floats(reward_params, frozen_dtype) if frozen_dtype
                               else reward_params))

  sampling = sampling_config(config, policy)
  step = step_lib.make_ppo_step(models, txs["actor"], txs["critic"], schedules["actor"], sampling,
                                ppo,
                                python_reward=python_reward, state_shardings=state_shardings,
                                mesh=mesh)
  return Run(config, models, frozen, state, step, mesh, state_shardings, source, policy,
             host_reward, sampling)


def _text_reward(config, policy: LoadedModel):
  if policy.tokenizer is None:
    raise ValueError("reward.kind='text' decodes completions, but the policy has no tokenizer")
  score = sources.text_reward(_import(config.reward.fn), policy.tokenizer, config.data.field)
  return lambda rollout, records: score(rollout.responses, rollout.mask, records)


def _records_required(rollout):
  raise RuntimeError("a text reward needs the batch's records: score it through "
                     "runner.iteration(run, state, prompts, records)")


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------


def _sample_rows(run: Run, r, scores, n: int) -> list[dict]:
  r, scores = sharding_lib.to_host(  # the rows shown
      jax.tree.map(lambda x: x[:n], (r._replace(prefix=None), scores)))
  decode = run.source.decode
  return [{"prompt": decode(r.prompts[i], r.prompt_mask[i]),
           "response": decode(r.responses[i], r.mask[i]), "score": float(scores[i])}
          for i in range(len(scores))]


def iteration(run: Run, state, prompts: Prompts, records: list[dict] | None = None,
              phase_timing: bool = False):
  """One PPO iteration: (state, metrics as floats, rollout, scores). The fused step unless the
  reward runs on the host or ``phase_timing`` asks for the three phases timed apart;
  ``records`` (the batch's rows) are what a text reward reads its columns from."""
  step, frozen = run.step, run.frozen
  timings = {}
  t0 = time.perf_counter()
  if step.fused is not None and not phase_timing:
    state, metrics, r, scores = step.fused(state, frozen, prompts)
    jax.block_until_ready(metrics)
  else:
    r = jax.block_until_ready(step.rollout(state, frozen, prompts))
    t1 = time.perf_counter()
    if run.host_reward is not None:
      scores = jnp.asarray(run.host_reward(sharding_lib.to_host(r), records), jnp.float32)
    else:
      scores = jax.block_until_ready(step.score(frozen, r))
    t2 = time.perf_counter()
    state, metrics = step.learn(state, r, scores)
    jax.block_until_ready(metrics)
    timings = {"time/sampling": t1 - t0, "time/scoring": t2 - t1,
               "time/update": time.perf_counter() - t2}
  metrics = {k: float(v) for k, v in sharding_lib.to_host(metrics).items()}
  metrics["time/iteration"] = time.perf_counter() - t0
  return state, {**metrics, **timings}, r, scores


class Result(NamedTuple):
  history: list[dict]  # the logged metric rows
  evals: dict[str, dict]  # "before" / "after": held-out evaluation summaries (if the task has any)


class NonFiniteError(RuntimeError):
  """``ppo.max_bad_steps`` iterations in a row had NaN or Inf in their scores, advantages,
  losses or gradient norms (each one skipped); the last good state was saved first."""


def run(config, workdir: str | None = None, stop_after: int | None = None) -> Result:
  """Trains for ``config.num_iterations`` PPO iterations.

  With a ``workdir``: resumes from its latest complete checkpoint if it comes from the same
  config and data (else ``resume.ResumeError``; a corrupt one falls back to the one before it,
  ``ppojax.resume``), writes metrics.jsonl, TensorBoard events, samples.jsonl, curves.png,
  checkpoints/ and, at the end, policy/ (the trained policy in Hugging Face format).
  ``stop_after``: stop (with a checkpoint) after that iteration, as an interrupted run would;
  running again resumes. A task with held-out prompts is evaluated greedily before the first and
  after the last iteration (eval.json).

  Faults: SIGTERM or SIGINT (Ctrl-C) stops the run after the current iteration with a
  checkpoint, and ``run`` returns normally; a second one aborts the process at once (exit code
  128 + signal number, no checkpoint; the handlers are installed only while ``run`` runs, in the
  main thread). An iteration with non-finite values is skipped (``skipped/nonfinite``); after
  ``ppo.max_bad_steps`` in a row the last good state is saved and ``NonFiniteError`` raised.
  A process killed at any moment resumes from its last complete checkpoint, and metrics.jsonl
  ends up as that of an uninterrupted run.
  """
  init_distributed(config)
  with StopSignals() as signals:
    return _run(config, workdir, stop_after, signals)


def init_distributed(config) -> None:
  """``jax.distributed.initialize`` when ``config.distributed`` is set, with the coordinator,
  process count and index from the config where given (else the cluster's auto-detection).
  CPU processes exchange collectives over Gloo."""
  if not config.get("distributed", False):
    return
  given = {"coordinator_address": config.get("coordinator_address") or None,
           "num_processes": config.get("num_processes") or None,
           "process_id": None if config.get("process_id", -1) < 0 else config.process_id}
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(**{k: v for k, v in given.items() if v is not None})


def _run(config, workdir, stop_after, signals: StopSignals) -> Result:
  from ppojax import checkpoint, reporting, resume  # pylint: disable=import-outside-toplevel

  r = build(config)
  state, start, n = r.state, 0, config.num_iterations
  bad = {"total": 0, "streak": 0}  # skipped iterations: all of them, and the latest run of them
  ckpt = writer = fingerprint = None
  evals = _read_evals(workdir)
  if workdir:
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    ckpt = checkpoint.Checkpointer(workdir / "checkpoints", config.save_every, config.keep)
    fingerprint = resume.fingerprint(config, r.source)  # saved with every checkpoint
    if ckpt.latest_step() is not None:
      try:  # refuses another run's checkpoint; skips (and sets aside) corrupt ones
        state, meta = resume.restore(ckpt, _abstract(state, r.state_shardings), fingerprint,
                                     config)
      except BaseException:
        ckpt.close()
        raise
      start = int(meta["iteration"])
      bad.update(total=int(meta.get("nonfinite_total", 0)),
                 streak=int(meta.get("nonfinite_streak", 0)))
      print(f"resumed from {workdir / 'checkpoints'} at iteration {start}", flush=True)
    _write_json(workdir / "config.json", config.to_dict())  # this invocation's resolved config
    # an evaluation cut short after its metrics row but before eval.json is done again
    redo = [it for it, phase in ((0, "before"), (n, "after"))
            if it == start and phase not in evals]
    _drop_eval_rows(workdir / reporting.METRICS_FILE, redo)
    wandb = config.get("wandb_project") or None
    writer = reporting.MetricWriter(str(workdir), wandb_project=wandb,
                                    wandb_config=config.to_dict() if wandb else None,
                                    resume_step=start)
  batch = config.ppo.batch_size
  if "before" not in evals and start == 0 and r.source.eval_records and not signals.received:
    evals["before"] = _held_out(r, state.actor, "before", workdir, writer, 0)
  progress = reporting.Progress(n, start=start)
  history, last, unsaved = [], start, False  # last: the latest completed iteration
  what: set[str] = set()  # what was non-finite in the current run of skipped iterations

  def save(it: int, state, force: bool) -> bool:
    return bool(ckpt) and ckpt.save(it, state, {
        "iteration": it, "data_position": it, "nonfinite_total": bad["total"],
        "nonfinite_streak": bad["streak"], "fingerprint": fingerprint}, force=force)

  loop_start = time.perf_counter()
  try:
    for it in range(start + 1, n + 1):
      if signals.received:  # arrived after the previous iteration's save
        if unsaved:
          save(last, state, force=True)
        break
      drawn = r.source.batch(it - 1)
      prompts = sharding_lib.place_prompts(drawn.prompts, r.mesh)
      state, metrics, rollout, scores = iteration(r, state, prompts, drawn.records,
                                                  config.phase_timing)
      last = it
      skipped = metrics.get("skipped/nonfinite", 0.0) > 0
      bad["total"] += skipped
      bad["streak"] = bad["streak"] + 1 if skipped else 0
      what = what | _nonfinite(metrics) if skipped else set()  # over the current streak
      # eps as trl's: episodes per second since the loop started (the first includes compiling)
      eps = (it - start) * batch / (time.perf_counter() - loop_start)
      metrics.update(episode=it * batch, eps=eps,
                     **{"data/truncated_prompts": drawn.truncated,
                        "skipped/nonfinite_total": bad["total"]})
      if config.eval.monitor and drawn.records:
        metrics.update(_monitor(r, rollout, drawn.records))
      if skipped or it % config.log_every == 0 or it in (start + 1, n):
        history.append({"iteration": it, **metrics})
        progress.update(it, {k: metrics[k] for k in SHOWN if k in metrics})
        if writer:
          writer.write(it, metrics)
      if skipped:
        progress.write(f"\niteration {it}: non-finite {_names(_nonfinite(metrics))}: update "
                       f"skipped ({bad['streak']} in a row, {bad['total']} in all)")
      if config.sample_every and (it % config.sample_every == 0 or it == n):
        rows = _sample_rows(r, rollout, scores, config.num_samples)
        progress.write(f"\nsamples at iteration {it}:\n{reporting.format_samples_table(rows)}")
        if writer:
          writer.write_samples(it, rows)
      max_bad = config.ppo.get("max_bad_steps", 3)
      failed = skipped and 0 < max_bad <= bad["streak"]
      stop = it == n or it == stop_after or failed or signals.received is not None
      unsaved = not save(it, state, force=stop)
      if failed:
        saved = (f"is saved as checkpoint {it} in {ckpt.directory}" if ckpt
                 else "was not saved (no workdir)")
        raise NonFiniteError(
            f"{bad['streak']} PPO iterations in a row ({it - bad['streak'] + 1} to {it}) had "
            f"non-finite {_names(what)} and were skipped (ppo.max_bad_steps={max_bad}); "
            f"the last good state {saved}. Check the reward function and the learning rate, "
            "then rerun to resume.")
      if stop:
        break
    if signals.received:
      where = f"after iteration {last}" if last > start else "before any iteration"
      progress.write(f"\nstopped by {signals.received} {where}"
                     + (f"; checkpoint {last} saved: run the same command again to resume"
                        if ckpt and last > start else ""))
    elif last == n and r.source.eval_records and "after" not in evals:
      progress.close()
      evals["after"] = _held_out(r, state.actor, "after", workdir, writer, n)
  finally:
    progress.close()
    if ckpt:
      ckpt.wait()
      ckpt.close()
    if writer:
      writer.close()
  if workdir and last == n and not signals.received:
    _finish(r, state, workdir, reporting)
  return Result(history, evals)


def _nonfinite(metrics: dict) -> set[str]:
  """Which of the checked quantities were non-finite in an iteration's metrics."""
  return {k for k in step_lib.NONFINITE_CHECKS if metrics.get(f"nonfinite/{k}")}


def _names(what: set[str]) -> str:
  """"scores, advantages, loss" in the order of ``step.NONFINITE_CHECKS``."""
  return ", ".join(k for k in step_lib.NONFINITE_CHECKS if k in what) or "values"


def _drop_eval_rows(path: pathlib.Path, steps: list[int]) -> None:
  """Removes the held-out evaluation rows at ``steps`` from metrics.jsonl (atomically)."""
  if not steps or not path.exists():
    return
  lines = path.read_bytes().splitlines(keepends=True)
  keep = []
  for line in lines:
    try:
      row = json.loads(line)
    except ValueError:
      keep.append(line)  # not ours to judge: the writer's resume drops a partial last line
      continue
    if not (isinstance(row, dict) and row.get("step") in steps
            and any(k.startswith("eval/") for k in row)):
      keep.append(line)
  if len(keep) != len(lines):
    with files.atomic_write(path, "wb") as f:
      f.write(b"".join(keep))


# ---------------------------------------------------------------------------------------------
# Held-out evaluation
# ---------------------------------------------------------------------------------------------


def _held_out(r: Run, actor, phase: str, workdir, writer, it: int) -> dict:
  """Greedy completions of the held-out prompts, scored by ``config.eval.metrics``; written to
  eval.json, eval_samples_{phase}.jsonl and the metrics (at iteration ``it``), and printed."""
  e = r.config.eval
  metrics = {name: _import(path) for name, path in e.metrics.items()}
  t0 = time.perf_counter()
  summary, rows = evaluation.evaluate(
      r.models.policy, actor, r.source.eval_records, r.source.encode,
      evaluation.greedy(r.sampling, e.max_new_tokens or None), r.policy.tokenizer, metrics,
      e.batch_size, e.group_by or None, r.config.data.field)
  shown = ", ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in summary.items())
  print(f"held-out eval {phase} ({len(rows)} prompts, {time.perf_counter() - t0:.0f} s): "
        f"{shown}", flush=True)
  if writer:  # first: a run cut off before eval.json is written evaluates again (_run)
    writer.write(it, summary)
  if workdir:
    data.write_jsonl(rows, workdir / f"eval_samples_{phase}.jsonl")
    evals = _read_evals(workdir)
    evals[phase] = summary
    _write_json(workdir / "eval.json", evals)  # the commit: this phase is done
  return summary


def _monitor(r: Run, rollout, records: list[dict]) -> dict:
  """``eval.metrics`` on this iteration's sampled responses ("monitor/NAME"): e.g. the true
  accuracy beside a learned reward, to catch reward hacking as it happens."""
  responses, mask = sharding_lib.to_host((rollout.responses, rollout.mask))
  texts = [r.source.decode(t, m) for t, m in zip(responses, mask)]
  return {f"monitor/{name}": float(np.mean(sources.call_text_fn(
      _import(path), records, texts, r.config.data.field)))
          for name, path in r.config.eval.metrics.items()}


def _read_evals(workdir) -> dict:
  path = pathlib.Path(workdir) / "eval.json" if workdir else None
  return json.loads(path.read_text()) if path and path.exists() else {}


def _write_json(path: pathlib.Path, obj) -> None:
  with files.atomic_write(path) as f:
    f.write(json.dumps(obj, indent=1))


def _abstract(state, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      state, shardings)


def _is_abstract(params) -> bool:
  return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params))


def _finish(r: Run, state, workdir: pathlib.Path, reporting) -> None:
  """The curves picture and the trained policy in Hugging Face format."""
  plotted = reporting.plot_curves(str(workdir / "metrics.jsonl"), str(workdir / "curves.png"))
  policy = r.policy._replace(params=sharding_lib.to_host(state.actor))
  out = save_model(workdir / "policy", policy)
  print(f"wrote {workdir / 'curves.png'} ({', '.join(plotted)}) and the policy to {out}",
        flush=True)
