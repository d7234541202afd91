"""The supervised stages' training loop (``fit``), shared by reward-model training
(``ppojax.supervised.train_rm``) and supervised fine-tuning (``ppojax.supervised.sft``): optimizer
steps over the training set, held-out evaluations, metric rows, and checkpoints that a rerun
resumes from as the PPO run does (``runner.run``).
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import shutil
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections

from ppojax.data import encoding
from ppojax.infra import compile as compile_lib
from ppojax.infra import hostmem, trees
from ppojax.infra.signals import StopSignals
from ppojax.models import LoadedModel
from ppojax.run import checkpoint, reporting, resume
from ppojax.run.progress import Progress
from ppojax.supervised import common

# Checkpoint every SAVE_EVERY steps (and at the end), keep the newest KEEP: the defaults of
# ``save_every`` and ``keep`` for a config without them.
SAVE_EVERY, KEEP = 50, 2


class Result(NamedTuple):
  model: LoadedModel  # the trained model (host params)
  before: dict[str, float]  # held-out statistics before training ("eval/..."), and after:
  after: dict[str, float]
  history: list[dict]  # the logged metric rows (with a workdir: also those before a resume)
  finished: bool = True  # False: stopped early (stop_after, a signal), to resume


def fit(config: ml_collections.ConfigDict, workdir: str | pathlib.Path | None, model: LoadedModel,
        loss_fn: common.LossFn, eval_fn: common.EvalFn, train: common.Arrays,
        held_out: common.Arrays, info: dict[str, float] | None = None,
        shown: tuple[str, ...] = ("train/loss",),
        units: Callable[[dict], jax.Array] = common.rows_units, stop_after: int | None = None
        ) -> Result:
  """Trains ``model.params`` for ``train.num_epochs`` epochs of ``train``; evaluates on
  ``held_out`` before, every ``train.eval_every`` steps (−1: every epoch), and after. Metric
  rows (``info`` — e.g. data statistics — and the first evaluation at step 0) go to
  ``workdir/metrics.jsonl``.
  ``units``: what the loss averages over, for exact gradient accumulation (``make_train_step``).

  With a ``workdir`` the run checkpoints and resumes as the PPO run does (``runner.run``):
  params and optimizer state every ``save_every`` steps and at the end, the newest ``keep``
  kept, in ``workdir/checkpoints``; a rerun resumes from the latest complete checkpoint that
  comes from the same config and training data (``ppojax.run.resume``: another run's is refused,
  a corrupt one falls back to the one before) and drops the metric rows written after it, so
  metrics.jsonl and the trained params equal an uninterrupted run's. The batch order is a pure
  function of the step. ``stop_after``, or a first SIGTERM / Ctrl-C, stops after that step with
  a checkpoint (``Result.finished`` is then False); a second signal aborts at once.
  """
  t = config.train
  n = common.rows(train)
  steps = common.num_steps(t.num_epochs, n, t.batch_size)
  _check(t)
  tx, schedule = common.optimizer(config.optim, steps)
  loop = _Loop(
      config, train, steps, schedule,
      eval_every=t.eval_every if t.eval_every >= 0 else common.num_steps(1.0, n, t.batch_size),
      train_step=common.make_train_step(loss_fn, tx, t.grad_accum, units),
      evaluation=functools.partial(_evaluation, eval_fn, held_out, t.eval_batch_size),
      shown=shown)
  loop.compiles = compile_lib.start()
  loop.open(workdir, model, tx)
  try:
    with StopSignals() as signals:
      before = loop.evaluate_before(info)
      loop.run(stop_after, signals)
  finally:
    loop.close()
  finished = loop.last == steps
  after = _eval_stats(loop.history[-1]) if finished else {}
  if finished:
    print(_summary("after training", after), flush=True)
  print(compile_lib.since(loop.compiles).summary(), flush=True)
  return Result(model._replace(params=jax.device_get(loop.state["params"])), before, after,
                loop.history, finished)


def _check(t: ml_collections.ConfigDict) -> None:
  if t.batch_size % t.grad_accum:
    raise ValueError(f"train.batch_size={t.batch_size} is not divisible by "
                     f"train.grad_accum={t.grad_accum}")
  if t.eval_every < -1:
    raise ValueError(f"train.eval_every={t.eval_every}: use N > 0 (every N steps), 0 (before and "
                     "after training only) or -1 (every epoch)")


def _evaluation(eval_fn: common.EvalFn, held_out: common.Arrays, batch_size: int,
                params) -> dict[str, float]:
  with compile_lib.program("evaluate"):
    stats = common.evaluate(eval_fn, params, held_out, batch_size)
  hostmem.release()  # as the PPO run: the freed holes of a phase given back between phases
  return {f"eval/{k}": v for k, v in stats.items()}


@dataclasses.dataclass
class _Loop:
  """``fit``'s loop: what it steps with, the params and optimizer state, and where it writes
  (with a workdir: checkpoints and metrics)."""

  config: ml_collections.ConfigDict
  train: common.Arrays
  steps: int  # optimizer steps in all
  schedule: Callable[[int], Any]  # the learning rate by step
  eval_every: int
  train_step: Callable
  evaluation: Callable[[Any], dict[str, float]]  # params → "eval/..." statistics
  shown: tuple[str, ...]  # the metrics on the progress line
  state: dict | None = None  # {"params", "opt_state"}
  ckpt: checkpoint.Checkpointer | None = None
  writer: reporting.MetricWriter | None = None
  compiles: compile_lib.Compiles = dataclasses.field(default_factory=compile_lib.Compiles)
  fingerprint: dict | None = None  # saved with every checkpoint
  history: list[dict] = dataclasses.field(default_factory=list)
  start: int = 0  # the step resumed from
  last: int = 0  # the latest completed step
  unsaved: bool = False  # the latest completed step has no checkpoint
  progress: Progress | None = None

  def open(self, workdir, model: LoadedModel, tx) -> None:
    """The initial state; with a ``workdir``, resumed from its latest checkpoint, and the metric
    writer."""
    params = jax.tree.map(jnp.array, model.params)  # own buffers: the step donates them
    self.state = {"params": params, "opt_state": tx.init(params)}
    if not workdir:
      return
    self.fingerprint = resume.supervised_fingerprint(self.config, self.train)
    self.ckpt, self.state, self.start, self.history = _resume(
        self.config, pathlib.Path(workdir), self.state, self.fingerprint)
    self.last = self.start
    warning = checkpoint.disk_warning(
        shutil.disk_usage(workdir).free, checkpoint.nbytes(self.state),
        checkpoint.nbytes(self.state["params"]), self.ckpt.keep, self.ckpt.save_every,
        self.start, self.steps, len(self.ckpt.all_steps()))
    if warning:
      print(f"warning: {workdir}: {warning}", flush=True)
    wandb = self.config.get("wandb_project") or None
    self.writer = reporting.MetricWriter(
        str(workdir), wandb_project=wandb,
        wandb_config=self.config.to_dict() if wandb else None,
        resume_step=self.start if self.start else -1)  # -1: rows of no step

  def evaluate_before(self, info: dict[str, float] | None) -> dict[str, float]:
    """The held-out statistics before training, logged at step 0 with ``info`` (read back from
    the metric rows when resumed)."""
    if self.start == 0:
      self.log(0, {**(info or {}), **self.evaluation(self.state["params"])})
    before = _eval_stats(next((r for r in self.history if r["step"] == 0), {}))
    print(_summary("before training", before), flush=True)
    return before

  def run(self, stop_after: int | None, signals: StopSignals) -> None:
    """The steps after ``start`` up to ``steps`` (or a stop: ``stop_after``, a signal), each
    checkpointed when due and at the stop."""
    self.progress = Progress(self.steps, start=self.start)
    for i in range(self.start, self.steps):
      if signals.received:  # arrived after the previous step's save
        if self.unsaved:
          self.save(self.last, force=True)
        break
      self.step(i)
      it = self.last
      stop = it == self.steps or it == stop_after or signals.received is not None
      self.unsaved = not self.save(it, force=stop)
      if not self.unsaved:
        hostmem.release()
      if stop:
        break
    if signals.received:
      self.progress.write(f"\nstopped by {signals.received} after step {self.last}"
                          + (f"; checkpoint {self.last} saved: run the same command again to "
                             "resume" if self.ckpt and self.last > self.start else ""))

  def step(self, i: int) -> None:
    """Optimizer step ``i`` on its batch (``encoding.batch_indices``); its metrics logged every
    ``log_every`` steps and with each evaluation (every ``eval_every`` steps and the last)."""
    t, n = self.config.train, common.rows(self.train)
    batch = common.take(self.train, encoding.batch_indices(n, t.batch_size, self.config.seed, i))
    with compile_lib.program("train"):
      self.state["params"], self.state["opt_state"], metrics = hostmem.compiled_call(
          self.train_step, self.state["params"], self.state["opt_state"], batch)
    self.last = it = i + 1
    evaluate_now = it == self.steps or (self.eval_every and it % self.eval_every == 0)
    if it % t.log_every == 0 or evaluate_now:
      metrics = {f"train/{k}": float(v) for k, v in jax.device_get(metrics).items()}
      metrics.update(lr=float(self.schedule(i)), epoch=it * t.batch_size / n)
      if evaluate_now:
        metrics.update(self.evaluation(self.state["params"]))
      self.log(it, metrics)
      self.progress.update(it, {k: metrics[k] for k in self.shown if k in metrics})
      if evaluate_now and it < self.steps:  # the last one is printed after training
        self.progress.write(_summary(f"at step {it} (epoch {metrics['epoch']:.2f})",
                                     _eval_stats(metrics)))

  def log(self, step: int, metrics: dict) -> None:
    """``metrics`` into the history; into metrics.jsonl with this process's compiles so far
    (``time/compile/PROGRAM``, ``compile/count``: they differ between a run and its resume)."""
    self.history.append({"step": step, **metrics})
    if self.writer:
      self.writer.write(step, {**metrics, **compile_lib.since(self.compiles).metrics()})

  def save(self, step: int, force: bool) -> bool:
    return bool(self.ckpt) and self.ckpt.save(
        step, self.state, {"step": step, "fingerprint": self.fingerprint}, force=force)

  def close(self) -> None:
    for closing in (self.progress, self.ckpt, self.writer):
      if closing:
        closing.close()


def _resume(config, workdir: pathlib.Path, state: dict, fingerprint: dict):
  """(checkpointer, state, step, metric rows up to that step) of ``workdir``: its latest
  complete checkpoint's if there is one whose fingerprint matches (else ``ResumeError``),
  or the initial ``state``, step 0 and no rows."""
  workdir.mkdir(parents=True, exist_ok=True)
  ckpt = checkpoint.Checkpointer(workdir / "checkpoints", config.get("save_every", SAVE_EVERY),
                                 config.get("keep", KEEP))
  if ckpt.latest_step() is None:
    return ckpt, state, 0, []
  try:  # refuses another run's checkpoint; skips (and sets aside) corrupt ones
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    # the initial state (own buffers) goes before the checkpoint is read, once it is this run's
    state, meta = resume.restore(ckpt, abstract, fingerprint, config,
                                 functools.partial(trees.free, state))
  except BaseException:
    ckpt.close()
    raise
  step = int(meta["step"])
  print(f"resumed from {workdir / 'checkpoints'} at step {step}", flush=True)
  path = workdir / reporting.METRICS_FILE
  rows_ = reporting.read_metrics(str(path)) if path.exists() else []
  return ckpt, state, step, [compile_lib.without_compiles(r) for r in rows_ if r["step"] <= step]


def _eval_stats(row: dict) -> dict[str, float]:
  return {k: v for k, v in row.items() if k.startswith("eval/")}


def _summary(when: str, stats: dict[str, float]) -> str:
  shown = ", ".join(f"{k[5:]} {v:.4f}" for k, v in stats.items() if k != "eval/rows")
  return f"held-out ({int(stats.get('eval/rows', 0))} rows) {when}: {shown}"
