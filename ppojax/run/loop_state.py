"""The training loop's state (``runner.run``): the ``TrainState``, the counters a checkpoint
carries beside it (iteration, non-finite skips, training seconds) and, with a workdir, the run's
files: checkpoints (resume, ``ppojax.run.resume``), config.json and the metric writer.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import shutil
from typing import Any

from ppojax.infra import compile as compile_lib
from ppojax.infra import files, trees
from ppojax.infra.signals import StopSignals
from ppojax.learner import update as update_lib
from ppojax.run import held_out, reporting
from ppojax.run.build import Run, _abstract


@dataclasses.dataclass
class LoopState:
  """A run's loop: the train state, the counters a checkpoint carries beside it, and where the
  run writes (with a workdir: checkpoints, metrics, eval.json)."""

  r: Run
  state: Any
  signals: StopSignals
  evals: dict[str, dict]  # held-out summaries by phase (Result.evals)
  workdir: pathlib.Path | None = None
  ckpt: Any = None  # checkpoint.Checkpointer
  writer: reporting.MetricWriter | None = None
  fingerprint: dict | None = None  # saved with every checkpoint
  start: int = 0  # the iteration resumed from
  last: int = 0  # the latest completed iteration
  unsaved: bool = False  # the latest completed iteration has no checkpoint
  skipped: bool = False  # the latest iteration had non-finite values (its update skipped)
  nonfinite_total: int = 0  # skipped iterations: all of them,
  nonfinite_streak: int = 0  # the latest run of them,
  nonfinite: set[str] = dataclasses.field(default_factory=set)  # and what, over that run
  train_s: float = 0.0  # seconds in iterations so far (held-out evaluations and saves not counted)
  # the process's XLA compiles at the run's start (the rows report those since)
  compiles: compile_lib.Compiles = dataclasses.field(default_factory=compile_lib.Compiles)

  def open(self, workdir: pathlib.Path) -> None:
    """The checkpointer (resuming from the latest checkpoint), config.json, the metric writer
    (from the iteration resumed on) and the redo of a cut-short evaluation."""
    from ppojax.run import checkpoint, resume  # pylint: disable=import-outside-toplevel
    config = self.r.config
    self.workdir = workdir
    workdir.mkdir(parents=True, exist_ok=True)
    self.ckpt = checkpoint.Checkpointer(workdir / "checkpoints", config.save_every, config.keep)
    self.fingerprint = resume.fingerprint(config, self.r.source)
    if self.ckpt.latest_step() is not None:
      self._resume()
    warning = disk_warning(self.state, config, self.start, len(self.ckpt.all_steps()),
                           shutil.disk_usage(workdir).free)
    if warning:
      print(f"warning: {workdir}: {warning}", flush=True)
    _write_json(workdir / "config.json", config.to_dict())  # this invocation's resolved config
    held_out.redo_cut_short(workdir, config, self.start, self.evals)
    wandb = config.get("wandb_project") or None
    self.writer = reporting.MetricWriter(str(workdir), wandb_project=wandb,
                                         wandb_config=config.to_dict() if wandb else None,
                                         resume_step=self.start)

  def _resume(self) -> None:
    from ppojax.run import resume  # pylint: disable=import-outside-toplevel
    target = saved(_abstract(self.state, self.r.state_shardings))
    # once the checkpoint is this run's, the initial state goes before it is read, as the first
    # step's donation would take it (else a resumed run held both: +1 state on the device)
    initial = saved(self.state)
    free = functools.partial(trees.free, initial, keep=(self.r.frozen, self.state.base))
    try:  # refuses another run's checkpoint; skips (and sets aside) corrupt ones
      state, meta = resume.restore(self.ckpt, target, self.fingerprint, self.r.config, free)
      self.state = state._replace(base=self.r.state.base)  # LoRA's base is not in checkpoints
    except BaseException:
      self.ckpt.close()
      raise
    self.start = self.last = int(meta["iteration"])
    self.nonfinite_total = int(meta.get("nonfinite_total", 0))
    self.nonfinite_streak = int(meta.get("nonfinite_streak", 0))
    self.train_s = float(meta.get("train_seconds", 0.0))
    print(f"resumed from {self.workdir / 'checkpoints'} at iteration {self.start}", flush=True)

  def count(self, metrics: dict) -> None:
    """Counts an iteration's skip (non-finite values) and what was non-finite in the streak."""
    self.skipped = metrics.get("skipped/nonfinite", 0.0) > 0
    self.nonfinite_total += self.skipped
    self.nonfinite_streak = self.nonfinite_streak + 1 if self.skipped else 0
    self.nonfinite = self.nonfinite | nonfinite(metrics) if self.skipped else set()

  def save(self, it: int, force: bool) -> bool:
    """Checkpoints the state as iteration ``it`` when due (``force``: always); whether it did."""
    return bool(self.ckpt) and self.ckpt.save(it, saved(self.state), {
        "iteration": it, "data_position": it, "nonfinite_total": self.nonfinite_total,
        "nonfinite_streak": self.nonfinite_streak, "fingerprint": self.fingerprint,
        "train_seconds": self.train_s}, force=force)

  def evaluate(self, phase: str, it: int, say=print, instruction: str | None = None) -> None:
    """The held-out evaluation ``phase`` of the current state, at iteration ``it`` (its compiles:
    the program "evaluate")."""
    with compile_lib.program("evaluate"):
      self.evals[phase] = held_out.evaluate(self.r, self.state, phase, self.workdir,
                                            self.writer, it, say=say, instruction=instruction)

  def close(self) -> None:
    """Waits for the checkpoints and closes the files."""
    if self.ckpt:
      self.ckpt.wait()
      self.ckpt.close()
    if self.writer:
      self.writer.close()


def nonfinite(metrics: dict) -> set[str]:
  """Which of the checked quantities were non-finite in an iteration's metrics."""
  return {k for k in update_lib.NONFINITE_CHECKS if metrics.get(f"nonfinite/{k}")}


def saved(state):
  """What a checkpoint holds: the state without LoRA's frozen base (the config names it)."""
  return state._replace(base=None)


def disk_warning(state, config, start: int, held: int, free: int) -> str | None:
  """``checkpoint.disk_warning`` for an RL run from iteration ``start``: checkpoints of the state
  (LoRA's frozen base excluded) and the exported policy (with LoRA the merged base's size)."""
  from ppojax.run import checkpoint  # pylint: disable=import-outside-toplevel
  return checkpoint.disk_warning(
      free, checkpoint.nbytes(saved(state)),
      checkpoint.nbytes(state.actor if state.base is None else state.base), config.keep,
      config.save_every, start, config.num_iterations, held)


def _write_json(path: pathlib.Path, obj) -> None:
  with files.atomic_write(path) as f:
    f.write(json.dumps(obj, indent=1))
