"""A training run from a config: ``build`` it (ppojax/run/build.py), then loop, with checkpoints,
metrics, sample tables, held-out evaluation (ppojax/run/held_out.py), plots and the final
export. ``ppojax.train`` is the command line around ``run``.
"""

from __future__ import annotations

import pathlib
import time
from typing import Any, NamedTuple

import jax
import numpy as np

from ppojax.data.batch import Prompts
from ppojax.infra import compile as compile_lib
from ppojax.infra import hostmem
from ppojax.infra import sharding as sharding_lib
from ppojax.infra.signals import StopSignals
from ppojax.learner import step as step_lib
from ppojax.learner import update as update_lib
from ppojax.models import lora, save_model
from ppojax.run import baselines, held_out, loop_state, reporting
from ppojax.run import checks as checks_lib
from ppojax.run.build import Run, _import, build
from ppojax.run.progress import Progress
from ppojax.tasks import sources

SHOWN = ("objective/scores", "objective/kl", "objective/entropy_masked", "policy/clipfrac_avg",
         "val/response_length")


def iteration(run: Run, state, prompts: Prompts, records: list[dict] | None = None,
              phase_timing: bool = False):
  """One PPO iteration: (state, metrics as floats, rollout, scores). The fused step unless the
  reward runs on the host or ``phase_timing`` asks for the three phases timed apart;
  ``records`` (the batch's prompts' rows, one per prompt) are what a text reward reads its
  columns from (each prompt's for all n of its samples). Its compiles are counted as the
  programs "step" (fused), or "rollout", "score" and "update" (``ppojax.infra.compile``)."""
  step, frozen = run.step, run.frozen
  timings = {}
  t0 = time.perf_counter()
  if step.fused is not None and not phase_timing:
    with compile_lib.program("step"):
      state, metrics, r, scores = hostmem.compiled_call(step.fused, state, frozen, prompts)
    jax.block_until_ready(metrics)
  else:
    with compile_lib.program("rollout"):
      args = (state, frozen, prompts)
      if step.host_turns:  # an environment on the host: a loop of compiled turns
        args += (per_sample(records, run.sampling.num_samples_per_prompt),)
      r = jax.block_until_ready(hostmem.compiled_call(step.rollout, *args))
    t1 = time.perf_counter()
    if run.host_reward is not None:
      host = run.host_reward(sharding_lib.to_host(r),
                             per_sample(records, run.sampling.num_samples_per_prompt))
      scores = step_lib.with_turn_rewards(r, host)
    else:
      with compile_lib.program("score"):
        scores = jax.block_until_ready(hostmem.compiled_call(step.score, frozen, r))
    hostmem.release()  # the sampling's and scoring's holes, before the update's temporaries
    t2 = time.perf_counter()
    with compile_lib.program("update"):
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

  Compiling: each row carries this process's XLA compiles so far, ``time/compile/PROGRAM``
  (seconds: "build", "step" or "rollout"/"score"/"update", "evaluate", "other"),
  ``compile/count`` and ``compile/cache_hits`` (read from the persistent cache); the run ends
  with a line that sums them up (``ppojax.infra.compile``).
  """
  init_distributed(config)
  before = compile_lib.start()
  with StopSignals() as signals:
    result = _run(config, workdir, stop_after, signals, before)
  print(compile_lib.since(before).summary(), flush=True)
  return result


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


def _run(config, workdir, stop_after, signals: StopSignals,
         compiles: compile_lib.Compiles) -> Result:
  """``run`` under its signal handlers; ``compiles``: the totals at the run's start."""
  with compile_lib.program("build"):
    r = build(config)
  hostmem.release()  # loading's freed buffers (see hostmem.release: a phase's holes would
  # otherwise stay resident under every later phase's peak)
  loop = loop_state.LoopState(r, r.state, signals, held_out.read_evals(workdir),
                              compiles=compiles)
  if workdir:
    loop.open(pathlib.Path(workdir))
  if loop.start == 0 and r.source.eval_records:  # the untrained policy, and its baselines
    _evaluate_before(loop)
  if not r.config.num_iterations:  # the evaluations above only (no training, no export)
    loop.close()
    return Result([], loop.evals)
  history = _train(loop, stop_after)
  if loop.workdir and loop.last == r.config.num_iterations and not signals.received:
    _finish(r, loop.state, loop.workdir)
  return Result(history, loop.evals)


def _evaluate_before(loop: loop_state.LoopState) -> None:
  """The untrained policy, plain and with each instruction of ``eval.baselines``; a phase that
  eval.json holds already (a resumed run) is not evaluated again."""
  for phase, instruction in (("before", None), *baselines.phases(loop.r.config)):
    if phase not in loop.evals and not loop.signals.received:
      loop.evaluate(phase, 0, instruction=instruction)


def _train(loop: loop_state.LoopState, stop_after: int | None) -> list[dict]:
  """The iterations after ``loop.start`` up to ``num_iterations`` (or a stop), then the
  held-out evaluation "after"; returns the logged metric rows."""
  n = loop.r.config.num_iterations
  progress = Progress(n, start=loop.start)
  history = []
  loop_start = time.perf_counter()
  try:
    for it in range(loop.start + 1, n + 1):
      if loop.signals.received:  # arrived after the previous iteration's save
        if loop.unsaved:
          loop.save(loop.last, force=True)
        break
      metrics, rollout, scores = _iterate(loop, it, loop_start)
      _report(loop, it, metrics, history, progress)
      _show_samples(loop, it, rollout, scores, progress)
      _evaluate_during(loop, it, progress)
      if _checkpoint(loop, it, stop_after):
        break
    _end(loop, progress)
  finally:
    progress.close()
    loop.close()
  return history


def _iterate(loop: loop_state.LoopState, it: int, loop_start: float) -> tuple[dict, Any, Any]:
  """Iteration ``it`` on its batch: (metrics, rollout, scores), the metrics with the run's
  counters, episodes per second, peak memory, the compiles so far and the ``eval.monitor``
  metrics."""
  r, config = loop.r, loop.r.config
  batch = checks_lib.rollout_rows(config)  # episodes (responses) per iteration
  drawn = r.source.batch(it - 1)
  prompts = sharding_lib.place_prompts(drawn.prompts, r.mesh)
  loop.state, metrics, rollout, scores = iteration(r, loop.state, prompts, drawn.records,
                                                   config.phase_timing)
  loop.last = it
  loop.count(metrics)
  # eps as trl's: episodes per second since the loop started (the first includes compiling)
  eps = (it - loop.start) * batch / (time.perf_counter() - loop_start)
  loop.train_s += metrics["time/iteration"]
  metrics.update(episode=it * batch, eps=eps,
                 **{"data/truncated_prompts": drawn.truncated,
                    "skipped/nonfinite_total": loop.nonfinite_total, "time/train_s": loop.train_s},
                 **peak_memory(), **compile_lib.since(loop.compiles).metrics())
  if config.eval.monitor and drawn.records:
    metrics.update(_monitor(r, rollout, drawn.records))
  return metrics, rollout, scores


def _report(loop: loop_state.LoopState, it: int, metrics: dict, history: list, progress) -> None:
  """Logs iteration ``it``'s metrics (every ``log_every``-th, the first, the last and any
  skipped one) and says why an update was skipped."""
  n = loop.r.config.num_iterations
  if loop.skipped or it % loop.r.config.log_every == 0 or it in (loop.start + 1, n):
    history.append({"iteration": it, **metrics})
    progress.update(it, {k: metrics[k] for k in SHOWN if k in metrics})
    if loop.writer:
      loop.writer.write(it, metrics)
  if loop.skipped:
    progress.write(f"\niteration {it}: non-finite {_names(loop_state.nonfinite(metrics))}: "
                   f"update skipped ({loop.nonfinite_streak} in a row, {loop.nonfinite_total} in "
                   "all)")


def _show_samples(loop: loop_state.LoopState, it: int, rollout, scores, progress) -> None:
  """Every ``sample_every``-th iteration and the last: a table of its samples."""
  config = loop.r.config
  if config.sample_every and (it % config.sample_every == 0 or it == config.num_iterations):
    rows = _sample_rows(loop.r, rollout, scores, config.sample_table_rows)
    progress.write(f"\nsamples at iteration {it}:\n{reporting.format_samples_table(rows)}")
    if loop.writer:
      loop.writer.write_samples(it, rows)


def _sample_rows(run: Run, r, scores, n: int) -> list[dict]:
  r, scores = sharding_lib.to_host(  # the rows shown
      jax.tree.map(lambda x: x[:n], (r._replace(prefix=None), scores)))
  decode = run.source.decode
  return [{"prompt": decode(r.prompts[i], r.prompt_mask[i]),
           "response": (decode(r.responses[i], r.mask[i]) if r.seen is None else
                        sources.turns_text(decode, r.responses[i], r.mask[i], r.seen[i])),
           "score": float(scores[i])}
          for i in range(len(scores))]



def _evaluate_during(loop: loop_state.LoopState, it: int, progress) -> None:
  """Every ``eval.every``-th iteration before the last: the held-out evaluation."""
  every = loop.r.config.eval.every
  if (every and it % every == 0 and it < loop.r.config.num_iterations
      and loop.r.source.eval_records):
    loop.evaluate(f"iteration_{it}", it, say=progress.write)


def _checkpoint(loop: loop_state.LoopState, it: int, stop_after: int | None) -> bool:
  """Saves iteration ``it`` when due and whether the loop stops there: the last iteration,
  ``stop_after``, a signal (each saved), or ``rl.max_bad_steps`` skipped in a row (saved, then
  ``NonFiniteError``)."""
  config = loop.r.config
  max_bad = config.rl.get("max_bad_steps", 3)
  failed = loop.skipped and 0 < max_bad <= loop.nonfinite_streak
  stop = (it == config.num_iterations or it == stop_after or failed
          or loop.signals.received is not None)
  loop.unsaved = not loop.save(it, force=stop)
  if not loop.unsaved:
    hostmem.release()  # what the checkpoint's writer threads freed
  if failed:
    saved = (f"is saved as checkpoint {it} in {loop.ckpt.directory}" if loop.ckpt
             else "was not saved (no workdir)")
    streak = loop.nonfinite_streak
    raise NonFiniteError(
        f"{streak} PPO iterations in a row ({it - streak + 1} to {it}) had "
        f"non-finite {_names(loop.nonfinite)} and were skipped (rl.max_bad_steps={max_bad}); "
        f"the last good state {saved}. Check the reward function and the learning rate, "
        "then rerun to resume.")
  return stop


def _end(loop: loop_state.LoopState, progress) -> None:
  """After the loop: a stop by a signal said, else the held-out evaluation "after" — again where
  this process trained on past a finished run's end (more ``num_iterations`` in its workdir)."""
  signal, last, start = loop.signals.received, loop.last, loop.start
  if signal:
    where = f"after iteration {last}" if last > start else "before any iteration"
    progress.write(f"\nstopped by {signal} {where}"
                   + (f"; checkpoint {last} saved: run the same command again to resume"
                      if loop.ckpt and last > start else ""))
  elif (last == loop.r.config.num_iterations and loop.r.source.eval_records
        and ("after" not in loop.evals or last > start)):
    progress.close()
    loop.evaluate("after", loop.r.config.num_iterations)


def _names(what: set[str]) -> str:
  """"scores, advantages, loss" in the order of ``step.NONFINITE_CHECKS``."""
  return ", ".join(k for k in update_lib.NONFINITE_CHECKS if k in what) or "values"


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


def _finish(r: Run, state, workdir: pathlib.Path) -> None:
  """The curves picture and the trained policy in Hugging Face format."""
  plotted = reporting.plot_curves(str(workdir / "metrics.jsonl"), str(workdir / "curves.png"))
  policy = r.policy._replace(params=sharding_lib.to_host(held_out.policy_model(r, state)[1]))
  out = save_model(workdir / "policy", policy)
  print(f"wrote {workdir / 'curves.png'} ({', '.join(plotted)}) and the policy to {out}",
        flush=True)
  if state.base is not None:  # and the adapters alone, for peft on the base model
    adapters = lora.save_peft(workdir / "adapters", sharding_lib.to_host(state.actor),
                              r.models.policy.cfg, str(r.config.model.policy),
                              r.config.lora.dropout)
    print(f"wrote the LoRA adapters (peft's layout) to {adapters}", flush=True)
