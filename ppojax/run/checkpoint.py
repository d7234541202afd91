"""Training checkpoints: a thin wrapper over orbax's ``CheckpointManager``.

One checkpoint per saved step, each a directory under ``directory``::

  <directory>/
    <step>/                         a complete (committed) checkpoint
      _CHECKPOINT_METADATA          orbax step metadata (commit timestamp)
      commit_success.txt
      state/                        the pytree's arrays (tensorstore, OCDBT) and tree metadata
      meta/metadata                 the caller's JSON ``meta`` dict
      manifest/metadata             JSON: path → shape / dtype (/ PRNG impl) of every leaf
    <step>.orbax-checkpoint-tmp/    a save in progress, or one cut short (ignored)

Atomicity: orbax (on local file systems its ``AtomicRenameTemporaryPath``) writes a step into
``<step>.orbax-checkpoint-tmp/`` (items into ``state.orbax-checkpoint-tmp/`` etc. inside it) and
renames it to ``<step>/`` only once everything is written, so a process killed mid-save leaves only
a tmp-suffixed directory. ``CheckpointManager`` lists only directories whose names carry no tmp
suffix, so ``latest_step``/``restore`` fall back to the last complete step. Old checkpoints are
retired the same way: renamed (atomically) into ``<directory>/.deleted/`` after the new one is
committed, and only then removed, so a step directory is always either complete or absent. A
``Checkpointer`` created on a local directory in a single process first removes whatever a killed
process left behind (tmp directories, ``.deleted/``); elsewhere orbax deletes leftover tmp
directories in the background before the first save. On GCS orbax instead writes in place and
marks completion with ``commit_success.txt``.

Saving is synchronous: ``save`` returns once the checkpoint is committed, so a process may exit
right after it. This costs the time of the write at each save; ``wait`` is kept for API symmetry.

A step that is listed but does not read back whole (a file truncated, deleted or corrupt: the
array data carries checksums, so a flipped byte fails too) is an error, never a silent load:
``restore_newest`` warns naming the step and its error, falls back to the next older step, and
sets the bad one aside as ``<step>.corrupt`` (kept, not deleted; orbax lists only integer
names), so the run saves that step again. A fallback needs ``keep`` >= 2.

What orbax's threads log about a save that ran out of disk or a step that does not read (their
tracebacks, ~100 lines) is not shown: the one error or warning above says it
(``files.quiet_if``); orbax's records about anything else are.

Typed PRNG keys (``jax.random.key``) are stored as their ``key_data`` (uint32) and re-wrapped with
the same implementation on restore. Every leaf is restored with the dtype and sharding of the
corresponding leaf of the caller's target.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import warnings
from typing import Any, Callable

import jax
import orbax.checkpoint as ocp

from ppojax.infra import files
from ppojax.run import checkpoint_leaves as leaves

_STATE, _META, _MANIFEST = "state", "meta", "manifest"
_MAX_REPORTED = 20  # mismatching leaves listed in an error message
_TMP = ".orbax-checkpoint-tmp"  # in the name of a step directory not yet committed
_TRASH = ".deleted"  # retired checkpoints are renamed into this subdirectory, then removed
_CORRUPT = ".corrupt"  # an unreadable step directory is renamed <step>.corrupt (never deleted)


class CheckpointMismatchError(ValueError):
  """The checkpoint's leaves differ from the restore target's (another model or optimizer)."""


class CorruptCheckpointError(RuntimeError):
  """No listed checkpoint reads back whole (or one is unreadable where it cannot be set aside)."""


class CheckpointWarning(UserWarning):
  """A checkpoint was skipped or set aside; the message names it and why."""


def _skipped(error: BaseException) -> bool:
  """Whether ``restore_newest`` skips a step that raised ``error`` (warning of it): anything but
  a mismatch, which is another run's checkpoint, not a corrupt one."""
  return not isinstance(error, CheckpointMismatchError)


def remove_leftovers(directory: str | os.PathLike) -> list[str]:
  """Deletes what a killed process can leave in a local checkpoint directory: uncommitted
  ``<step>.orbax-checkpoint-tmp*`` directories and retired checkpoints in ``.deleted/``.
  Returns the names removed. Only for a directory no other process is writing to."""
  root = pathlib.Path(directory)
  if not root.is_dir():
    return []
  removed = []
  for path in root.iterdir():
    if path.is_dir() and (_TMP in path.name or path.name == _TRASH):
      shutil.rmtree(path, ignore_errors=True)
      removed.append(path.name)
  return sorted(removed)


def _short(error: BaseException, limit: int = 300) -> str:
  """``Type: first line of the message``, at most ``limit`` characters (tensorstore's run long)."""
  lines = str(error).strip().splitlines()
  text = f"{type(error).__name__}: {lines[0] if lines else ''}"
  return text if len(text) <= limit else text[:limit - 3] + "..."


def nbytes(tree) -> int:
  """The bytes of a tree's arrays (typed PRNG keys: their key data)."""
  return sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(tree))


def saves_left(start: int, steps: int, save_every: int) -> int:
  """Checkpoints a run from step ``start`` to ``steps`` writes: every ``save_every``-th step and
  the last one."""
  due = steps // save_every - start // save_every
  return due + (steps > start and steps % save_every != 0)


def disk_warning(free: int, size: int, export: int, keep: int, save_every: int, start: int,
                 steps: int, held: int) -> str | None:
  """A warning when a run from step ``start`` to ``steps`` may fill the disk, else None. It
  needs, for checkpoints of ``size`` bytes (the arrays uncompressed: an upper bound), ``held``
  of them there already, and an export of ``export`` bytes at the end:

      (min(keep + 1, held + saves) − held) · size + export

  (a new checkpoint is written before the oldest of ``keep`` goes)."""
  written = max(min(keep + 1, held + saves_left(start, steps, save_every)) - held, 0)
  need = written * size + (export if steps > start else 0)
  if need <= free:
    return None
  text = files.size_text
  return (f"{text(free)} free on disk, and this run may write {text(need)}: "
          f"{written} checkpoint(s) of up to {text(size)} (keep={keep}, save_every={save_every}) "
          f"and the exported model ({text(export)}). Free space, or lower --config.keep or raise "
          "--config.save_every, or the run will stop at a save with 'No space left on device'")


class Checkpointer:
  """Saves every ``save_every`` steps and keeps the newest ``keep`` complete checkpoints."""

  def __init__(self, directory: str | os.PathLike, save_every: int, keep: int):
    if save_every < 1 or keep < 1:
      raise ValueError(f"save_every and keep must be >= 1, got {save_every} and {keep}")
    directory = os.fspath(directory)
    self.directory = directory if "://" in directory else os.path.abspath(directory)  # gs://...
    self.save_every = save_every
    self.keep = keep
    # a local directory written by this process alone: we clean up ourselves, synchronously
    self._local = "://" not in directory and jax.process_count() == 1
    if self._local:
      remove_leftovers(self.directory)
    options = ocp.CheckpointManagerOptions(
        enable_async_checkpointing=False,
        preservation_policy=ocp.checkpoint_managers.LatestN(n=keep),
        cleanup_tmp_directories=True,  # delete saves cut short by a crash
        todelete_subdir=_TRASH if self._local else None,
        create=True)
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    """The newest complete checkpoint's step, or None."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    """The steps of all complete checkpoints, ascending."""
    return sorted(self._manager.all_steps())

  def save(self, step: int, state, meta: dict | None = None, force: bool = False) -> bool:
    """Saves when step % save_every == 0 or force; meta is a JSON-serialisable dict (e.g. the data
    position, the config) saved alongside. Returns whether it saved. Keeps the newest `keep`.
    Blocks until the checkpoint is committed. Raises ValueError if `step` is not larger than the
    latest saved step (checkpoints are never overwritten)."""
    step = int(step)
    if not force and step % self.save_every:
      return False
    meta = {} if meta is None else meta
    json.dumps(meta)  # fail before writing anything if meta is not JSON-serialisable
    latest = self.latest_step()
    if latest is not None and step <= latest:
      raise ValueError(f"cannot save step {step}: {self.directory} already holds step {latest} "
                       "(saved steps must increase; use another directory to branch a run)")
    args = ocp.args.Composite(**{
        _STATE: ocp.args.StandardSave(leaves.unwrap_keys(state)),
        _META: ocp.args.JsonSave(meta),
        _MANIFEST: ocp.args.JsonSave({"leaves": leaves.manifest(state)}),
    })
    try:
      with files.quiet_if(files.is_disk_full):  # orbax's writer threads log tracebacks
        saved = bool(self._manager.save(step, args=args, force=True))
    except Exception as e:
      if not files.is_disk_full(e):
        raise
      self._abandon()
      raise files.disk_full(f"the checkpoint of step {step}", self.directory, (
          "free disk space, or lower --config.keep or raise --config.save_every, and run the "
          f"same command again: it resumes from step {latest}" if latest is not None else
          "free disk space and run the same command again")) from e
    if self._local:
      shutil.rmtree(os.path.join(self.directory, _TRASH), ignore_errors=True)
    return saved

  def restore(self, target, step: int | None = None) -> tuple[Any, dict]:
    """Restores (state, meta) from `step` (default: latest complete) into the structure, dtypes
    and shardings of `target` (a pytree of arrays or jax.ShapeDtypeStruct with .sharding).
    Raises FileNotFoundError with a clear message when there is no checkpoint; a
    CheckpointMismatchError (a ValueError) naming the checkpoint directory and the mismatching
    leaf path(s) when structure/shapes don't match target; orbax's or tensorstore's error when
    a file of the step is missing or corrupt."""
    steps = self.all_steps()
    if step is None:
      if not steps:
        raise FileNotFoundError(f"no complete checkpoint in {self.directory} (incomplete saves, "
                                "left as *.orbax-checkpoint-tmp directories, are ignored)")
      step = steps[-1]
    elif step not in steps:
      raise FileNotFoundError(f"no complete checkpoint for step {step} in {self.directory}; "
                              f"complete steps: {steps}")
    step_dir = os.path.join(self.directory, str(step))
    saved = self._manager.restore(step, args=ocp.args.Composite(
        **{_MANIFEST: ocp.args.JsonRestore()}))[_MANIFEST]["leaves"]
    problems = leaves.mismatches(saved, leaves.manifest(target))
    if problems:
      more = len(problems) - _MAX_REPORTED
      raise CheckpointMismatchError(
          f"checkpoint {step_dir} does not match the restore target:\n  "
          + "\n  ".join(problems[:_MAX_REPORTED])
          + (f"\n  ... and {more} more" if more > 0 else ""))
    abstract = jax.tree.map(leaves.abstract_leaf, target)
    restored = self._manager.restore(step, args=ocp.args.Composite(**{
        _STATE: ocp.args.StandardRestore(abstract),
        _META: ocp.args.JsonRestore(),
    }))
    state = jax.tree.map(leaves.rewrap_key, target, restored[_STATE])
    return state, dict(restored[_META] or {})

  def read_meta(self, step: int) -> dict:
    """The ``meta`` dict saved with ``step`` (no arrays are read)."""
    restored = self._manager.restore(step, args=ocp.args.Composite(
        **{_META: ocp.args.JsonRestore()}))[_META]
    return dict(restored or {})

  def restore_newest(self, target, check: Callable[[int, dict], None] | None = None
                     ) -> tuple[Any, dict, int]:
    """(state, meta, step) from the newest checkpoint that reads back whole, as ``restore``.

    A newer step that fails to read is skipped with a ``CheckpointWarning`` naming it and its
    error and, once an older one has restored, renamed to ``<step>.corrupt``. ``check(step,
    meta)`` runs on a step's meta before its arrays are read: its exceptions, like a
    ``CheckpointMismatchError``, propagate (a different run is not a corrupt checkpoint).
    Raises FileNotFoundError when there is no checkpoint, and ``CorruptCheckpointError`` naming
    every step and its error when none restores (nothing is renamed then)."""
    steps = self.all_steps()
    if not steps:
      raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
    failed: list[tuple[int, str]] = []
    for step in reversed(steps):
      try:
        with files.quiet_if(_skipped):
          meta = self.read_meta(step)
      except Exception as e:  # pylint: disable=broad-exception-caught
        self._skip(step, e, failed)
        continue
      if check is not None:
        check(step, meta)
      try:
        with files.quiet_if(_skipped):
          state, meta = self.restore(target, step)
      except CheckpointMismatchError:
        raise
      except Exception as e:  # pylint: disable=broad-exception-caught
        self._skip(step, e, failed)
        continue
      if failed:
        self._set_aside([bad for bad, _ in failed], step)
      return state, meta, step
    listed = "\n  ".join(f"step {s}: {why}" for s, why in failed)
    raise CorruptCheckpointError(
        f"no checkpoint in {self.directory} can be restored:\n  {listed}\nNothing was changed. "
        "Move the broken step directories away to start afresh, or use another --workdir.")

  def _skip(self, step: int, error: Exception, failed: list[tuple[int, str]]) -> None:
    failed.append((step, _short(error)))
    warnings.warn(f"checkpoint {os.path.join(self.directory, str(step))} cannot be restored "
                  f"({failed[-1][1]}); trying the previous one", CheckpointWarning, stacklevel=3)

  def _set_aside(self, steps: list[int], restored: int) -> None:
    """Renames unreadable step directories to ``<step>.corrupt`` (``.corrupt.1``, ...) so that
    the run can save those steps again; where that is not safe (several processes, a remote
    file system) raises ``CorruptCheckpointError`` asking the user to move them."""
    dirs = [os.path.join(self.directory, str(s)) for s in steps]
    if not self._local:
      raise CorruptCheckpointError(
          f"checkpoint(s) {', '.join(dirs)} cannot be restored; step {restored} can. Move the "
          "broken step directories out of the checkpoint directory and rerun to resume from "
          f"step {restored}.")
    for path in dirs:
      aside, n = path + _CORRUPT, 0
      while os.path.exists(aside):
        n += 1
        aside = f"{path}{_CORRUPT}.{n}"
      os.rename(path, aside)
      warnings.warn(f"resuming from step {restored}: the unreadable checkpoint {path} is kept as "
                    f"{aside}", CheckpointWarning, stacklevel=3)
    self._manager.reload()

  def _abandon(self) -> None:
    """After a failed save: orbax's writers finished (their errors are the save's), and the
    partial step's directory gone (``remove_leftovers``)."""
    try:
      self._manager.wait_until_finished()
    except Exception:  # pylint: disable=broad-except
      pass
    if self._local:
      remove_leftovers(self.directory)

  def wait(self) -> None:
    """Blocks until any save in progress is committed (saves are synchronous: a no-op)."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending work (e.g. deleting old checkpoints) and releases resources."""
    self._manager.close()

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
