"""A training run from a config: ``build`` it (ppojax/run/build.py), then loop, with checkpoints,
metrics, sample tables, held-out evaluation, plots and the final export. ``ppojax.train`` is
the command line around ``run``.
"""

from __future__ import annotations

import json
import pathlib
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ppojax.data import records as records_lib
from ppojax.data.batch import Prompts
from ppojax.infra import files, hostmem
from ppojax.infra import sharding as sharding_lib
from ppojax.infra.signals import StopSignals
from ppojax.learner import state as state_lib
from ppojax.learner import update as update_lib
from ppojax.models import lora, save_model
from ppojax.run import baselines, evaluation
from ppojax.run import checks as checks_lib

# the builders are runner's API too: runner.build(config), runner.load_config(path), ...
from ppojax.run.build import Run, _abstract, _import, build
from ppojax.tasks import sources

SHOWN = ("objective/scores", "objective/kl", "objective/entropy_masked", "policy/clipfrac_avg",
         "val/response_length")


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
  ``records`` (the batch's prompts' rows, one per prompt) are what a text reward reads its
  columns from (each prompt's for all n of its samples)."""
  step, frozen = run.step, run.frozen
  timings = {}
  t0 = time.perf_counter()
  if step.fused is not None and not phase_timing:
    state, metrics, r, scores = hostmem.compiled_call(step.fused, state, frozen, prompts)
    jax.block_until_ready(metrics)
  else:
    r = jax.block_until_ready(hostmem.compiled_call(step.rollout, state, frozen, prompts))
    t1 = time.perf_counter()
    if run.host_reward is not None:
      scores = jnp.asarray(run.host_reward(sharding_lib.to_host(r), per_sample(
          records, run.sampling.num_samples_per_prompt)), jnp.float32)
    else:
      scores = jax.block_until_ready(hostmem.compiled_call(step.score, frozen, r))
    hostmem.release()  # the sampling's and scoring's holes, before the update's temporaries
    t2 = time.perf_counter()
    state, metrics = hostmem.compiled_call(step.learn, state, r, scores)
    jax.block_until_ready(metrics)
    timings = {"time/sampling": t1 - t0, "time/scoring": t2 - t1,
               "time/update": time.perf_counter() - t2}
  metrics = {k: float(v) for k, v in sharding_lib.to_host(metrics).items()}
  hostmem.release()
  metrics["time/iteration"] = time.perf_counter() - t0
  return state, {**metrics, **timings}, r, scores


class Result(NamedTuple):
  history: list[dict]  # the logged metric rows
  # held-out summaries: "before", "before_NAME" (eval.baselines), "iteration_N" (eval.every),
  # "after"
  evals: dict[str, dict]


class NonFiniteError(RuntimeError):
  """``rl.max_bad_steps`` iterations in a row had NaN or Inf in their scores, advantages,
  losses or gradient norms (each one skipped); the last good state was saved first."""


def run(config, workdir: str | None = None, stop_after: int | None = None) -> Result:
  """Trains for ``config.num_iterations`` PPO iterations.

  With a ``workdir``: resumes from its latest complete checkpoint if it comes from the same
  config and data (else ``resume.ResumeError``; a corrupt one falls back to the one before it,
  ``ppojax.run.resume``), writes metrics.jsonl, TensorBoard events, samples.jsonl, curves.png,
  checkpoints/ and, at the end, policy/ (the trained policy in Hugging Face format).
  ``stop_after``: stop (with a checkpoint) after that iteration, as an interrupted run would;
  running again resumes. A task with held-out prompts is evaluated greedily before the first and
  after the last iteration, and after every ``eval.every``-th (eval.json); before the first
  also with each instruction of ``eval.baselines`` (ppojax/run/baselines.py). ``num_iterations``
  0 evaluates the untrained policy only ("before" and the baselines; no export). Each logged row
  carries ``time/train_s`` (the iterations' seconds so far, carried across a resume) and the
  peak memory so far (``peak_memory``).

  Faults: SIGTERM or SIGINT (Ctrl-C) stops the run after the current iteration with a
  checkpoint, and ``run`` returns normally; a second one aborts the process at once (exit code
  128 + signal number, no checkpoint; the handlers are installed only while ``run`` runs, in the
  main thread). An iteration with non-finite values is skipped (``skipped/nonfinite``); after
  ``rl.max_bad_steps`` in a row the last good state is saved and ``NonFiniteError`` raised.
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
  from ppojax.run import checkpoint, reporting, resume  # pylint: disable=import-outside-toplevel

  r = build(config)
  hostmem.release()  # loading's freed buffers (see hostmem.release: a phase's holes would
  # otherwise stay resident under every later phase's peak)
  config = r.config  # the algorithm's defaults filled in (algorithms.resolve)
  state, start, n = r.state, 0, config.num_iterations
  bad = {"total": 0, "streak": 0}  # skipped iterations: all of them, and the latest run of them
  train_s = 0.0  # seconds spent in iterations so far (held-out evaluations and saves not counted)
  ckpt = writer = fingerprint = None
  evals = _read_evals(workdir)
  if workdir:
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    ckpt = checkpoint.Checkpointer(workdir / "checkpoints", config.save_every, config.keep)
    fingerprint = resume.fingerprint(config, r.source)  # saved with every checkpoint
    if ckpt.latest_step() is not None:
      try:  # refuses another run's checkpoint; skips (and sets aside) corrupt ones
        state, meta = resume.restore(ckpt, _saved(_abstract(state, r.state_shardings)),
                                     fingerprint, config)
        state = state._replace(base=r.state.base)  # LoRA's base is not in checkpoints
      except BaseException:
        ckpt.close()
        raise
      start = int(meta["iteration"])
      bad.update(total=int(meta.get("nonfinite_total", 0)),
                 streak=int(meta.get("nonfinite_streak", 0)))
      train_s = float(meta.get("train_seconds", 0.0))
      print(f"resumed from {workdir / 'checkpoints'} at iteration {start}", flush=True)
    _write_json(workdir / "config.json", config.to_dict())  # this invocation's resolved config
    # an evaluation cut short after its metrics row but before eval.json is done again
    phases = [(0, "before"), *((0, p) for p, _ in baselines.phases(config))]
    for it, phase in phases + ([(n, "after")] if n else []):  # n = 0: evaluation only
      if it == start and phase not in evals:
        _drop_eval_rows(workdir / reporting.METRICS_FILE, [it], baselines.metric_prefix(phase))
    wandb = config.get("wandb_project") or None
    writer = reporting.MetricWriter(str(workdir), wandb_project=wandb,
                                    wandb_config=config.to_dict() if wandb else None,
                                    resume_step=start)
  batch = checks_lib.rollout_rows(config)  # episodes (responses) per iteration
  if start == 0 and r.source.eval_records:  # the untrained policy, and its baselines
    for phase, instruction in (("before", None), *baselines.phases(config)):
      if phase not in evals and not signals.received:
        evals[phase] = _held_out(r, state, phase, workdir, writer, 0, instruction=instruction)
  if not n:  # num_iterations = 0: the evaluations above only (no training, no export)
    for closing in (ckpt, writer):
      if closing:
        closing.close()
    return Result([], evals)
  progress = reporting.Progress(n, start=start)
  history, last, unsaved = [], start, False  # last: the latest completed iteration
  what: set[str] = set()  # what was non-finite in the current run of skipped iterations

  def save(it: int, state, force: bool) -> bool:
    return bool(ckpt) and ckpt.save(it, _saved(state), {
        "iteration": it, "data_position": it, "nonfinite_total": bad["total"],
        "nonfinite_streak": bad["streak"], "fingerprint": fingerprint,
        "train_seconds": train_s}, force=force)

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
      train_s += metrics["time/iteration"]
      metrics.update(episode=it * batch, eps=eps,
                     **{"data/truncated_prompts": drawn.truncated,
                        "skipped/nonfinite_total": bad["total"], "time/train_s": train_s},
                     **peak_memory())
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
        rows = _sample_rows(r, rollout, scores, config.sample_table_rows)
        progress.write(f"\nsamples at iteration {it}:\n{reporting.format_samples_table(rows)}")
        if writer:
          writer.write_samples(it, rows)
      if config.eval.every and it % config.eval.every == 0 and it < n and r.source.eval_records:
        phase = f"iteration_{it}"
        evals[phase] = _held_out(r, state, phase, workdir, writer, it, say=progress.write)
      max_bad = config.rl.get("max_bad_steps", 3)
      failed = skipped and 0 < max_bad <= bad["streak"]
      stop = it == n or it == stop_after or failed or signals.received is not None
      unsaved = not save(it, state, force=stop)
      if not unsaved:
        hostmem.release()  # what the checkpoint's writer threads freed
      if failed:
        saved = (f"is saved as checkpoint {it} in {ckpt.directory}" if ckpt
                 else "was not saved (no workdir)")
        raise NonFiniteError(
            f"{bad['streak']} PPO iterations in a row ({it - bad['streak'] + 1} to {it}) had "
            f"non-finite {_names(what)} and were skipped (rl.max_bad_steps={max_bad}); "
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
      evals["after"] = _held_out(r, state, "after", workdir, writer, n)
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
  return {k for k in update_lib.NONFINITE_CHECKS if metrics.get(f"nonfinite/{k}")}


def _names(what: set[str]) -> str:
  """"scores, advantages, loss" in the order of ``step.NONFINITE_CHECKS``."""
  return ", ".join(k for k in update_lib.NONFINITE_CHECKS if k in what) or "values"


def _drop_eval_rows(path: pathlib.Path, steps: list[int], prefix: str = "eval/") -> None:
  """Removes the held-out evaluation rows at ``steps`` (those with a metric named
  ``prefix``...) from metrics.jsonl (atomically)."""
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
            and any(k.startswith(prefix) for k in row)):
      keep.append(line)
  if len(keep) != len(lines):
    with files.atomic_write(path, "wb") as f:
      f.write(b"".join(keep))


# ---------------------------------------------------------------------------------------------
# Held-out evaluation
# ---------------------------------------------------------------------------------------------


def _saved(state):
  """What a checkpoint holds: the state without LoRA's frozen base (the config names it)."""
  return state._replace(base=None)


def policy_model(r: Run, state) -> tuple:
  """(module, params) of the current policy as one plain model: with LoRA the base's
  architecture and the merged weights W + (α/r)·A·B (``lora.merge``), else the policy."""
  if state.base is None:
    return r.models.policy, state.actor
  merged = lora.merge(state_lib.policy_params(state.actor, state.base), r.models.policy.cfg)
  return r.models.reference, merged


def _held_out(r: Run, state, phase: str, workdir, writer, it: int, say=print,
              instruction: str | None = None) -> dict:
  """Greedy completions of the held-out prompts, scored by ``config.eval.metrics``; written to
  eval.json, eval_samples_{phase}.jsonl and the metrics (at iteration ``it``), and shown
  (``say``). ``phase``: "before", "after", "iteration_N" (``eval.every``) or "before_NAME"
  (``eval.baselines``: each prompt with ``instruction`` appended, ppojax/run/baselines.py)."""
  e = r.config.eval
  metrics = {name: _import(path) for name, path in e.metrics.items()}
  records, encode = r.source.eval_records, r.source.encode
  if instruction is not None:
    records, encode = baselines.instructed(r.config, r.policy.tokenizer, records, instruction)
  scorer = None  # RLHF: the reward model's score (the proxy) beside the true metrics
  if r.models.reward is not None:
    scorer = evaluation.reward_model_scorer(r.models.reward, r.frozen.reward)
  t0 = time.perf_counter()
  summary, rows = evaluation.evaluate(
      *policy_model(r, state), records, encode,
      evaluation.greedy(r.sampling, e.max_new_tokens or None), r.policy.tokenizer, metrics,
      e.batch_size, e.group_by or None, r.config.data.field, scorer)
  shown = ", ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in summary.items())
  say(f"held-out eval {phase.replace('_', ' ')} ({len(rows)} prompts, "
      f"{time.perf_counter() - t0:.0f} s): {shown}")
  if writer:  # first: a run cut off before eval.json is written evaluates again (_run)
    prefix = baselines.metric_prefix(phase)
    writer.write(it, {prefix + k.removeprefix("eval/"): v for k, v in summary.items()})
  if workdir:
    records_lib.write_jsonl(rows, workdir / f"eval_samples_{phase}.jsonl")
    evals = _read_evals(workdir)
    evals[phase] = summary
    _write_json(workdir / "eval.json", evals)  # the commit: this phase is done
  hostmem.release()
  return summary


def peak_memory() -> dict[str, float]:
  """The peaks so far, in MiB: this process's resident set (``memory/peak_rss_mb``,
  ``hostmem.peak_rss_mb``) and, on a device whose allocator counts (GPU, TPU), the first local
  device's peak bytes in use (``memory/device_peak_mb``)."""
  out = {"memory/peak_rss_mb": hostmem.peak_rss_mb()}
  try:
    stats = jax.local_devices()[0].memory_stats() or {}
  except (NotImplementedError, RuntimeError):  # CPU back ends may not count
    stats = {}
  if "peak_bytes_in_use" in stats:
    out["memory/device_peak_mb"] = stats["peak_bytes_in_use"] / 2**20
  return out


def per_sample(records: list[dict] | None, n: int) -> list[dict] | None:
  """One record per sampled response: each prompt's record n times, as the rollout's rows
  (prompt i's samples at i·n … i·n + n − 1)."""
  return records if records is None or n == 1 else [rec for rec in records for _ in range(n)]


def _monitor(r: Run, rollout, records: list[dict]) -> dict:
  """``eval.metrics`` on this iteration's sampled responses ("monitor/NAME"): e.g. the true
  accuracy beside a learned reward, to catch reward hacking as it happens."""
  responses, mask = sharding_lib.to_host((rollout.responses, rollout.mask))
  texts = [r.source.decode(t, m) for t, m in zip(responses, mask)]
  records = per_sample(records, r.sampling.num_samples_per_prompt)
  return {f"monitor/{name}": float(np.mean(sources.call_text_fn(
      _import(path), records, texts, r.config.data.field)))
          for name, path in r.config.eval.metrics.items()}


def _read_evals(workdir) -> dict:
  path = pathlib.Path(workdir) / "eval.json" if workdir else None
  return json.loads(path.read_text()) if path and path.exists() else {}


def _write_json(path: pathlib.Path, obj) -> None:
  with files.atomic_write(path) as f:
    f.write(json.dumps(obj, indent=1))


def _finish(r: Run, state, workdir: pathlib.Path, reporting) -> None:
  """The curves picture and the trained policy in Hugging Face format."""
  plotted = reporting.plot_curves(str(workdir / "metrics.jsonl"), str(workdir / "curves.png"))
  policy = r.policy._replace(params=sharding_lib.to_host(policy_model(r, state)[1]))
  out = save_model(workdir / "policy", policy)
  print(f"wrote {workdir / 'curves.png'} ({', '.join(plotted)}) and the policy to {out}",
        flush=True)
  if state.base is not None:  # and the adapters alone, for peft on the base model
    adapters = lora.save_peft(workdir / "adapters", sharding_lib.to_host(state.actor),
                              r.models.policy.cfg, str(r.config.model.policy),
                              r.config.lora.dropout)
    print(f"wrote the LoRA adapters (peft's layout) to {adapters}", flush=True)
