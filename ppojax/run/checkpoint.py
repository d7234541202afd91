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
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec

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


def _is_key(x) -> bool:
  dtype = getattr(x, "dtype", None)
  return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _key_impl_name(x) -> str:
  """The PRNG implementation name of a typed key array or ShapeDtypeStruct ("threefry2x32")."""
  if isinstance(x, jax.Array):
    return str(jax.random.key_impl(x))
  impls = []
  jax.eval_shape(lambda k: impls.append(str(jax.random.key_impl(k))),
                 jax.ShapeDtypeStruct(x.shape, x.dtype))
  return impls[0]


def _path_str(path) -> str:
  return jax.tree_util.keystr(path, simple=True, separator="/") or "<root>"


def _shape_dtype(x) -> tuple[tuple[int, ...], np.dtype]:
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return tuple(x.shape), x.dtype
  return np.shape(x), np.result_type(x)


def _manifest(tree) -> dict[str, dict]:
  """Shape and dtype (and PRNG impl for typed keys) of every leaf, by path."""
  leaves = {}
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    shape, dtype = _shape_dtype(x)
    if _is_key(x):
      leaves[_path_str(path)] = {"shape": list(shape), "dtype": "key", "impl": _key_impl_name(x)}
    else:
      leaves[_path_str(path)] = {"shape": list(shape), "dtype": str(np.dtype(dtype))}
  return leaves


def _unwrap_keys(tree):
  return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


def _default_sharding() -> jax.sharding.Sharding:
  """Where a target leaf without a sharding goes: JAX's default device, replicated if multi-host."""
  if jax.process_count() == 1:
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return NamedSharding(jax.sharding.Mesh(np.asarray(jax.devices()), ("all",)), PartitionSpec())


def _abstract_leaf(x) -> jax.ShapeDtypeStruct:
  """What orbax restores a target leaf into (typed keys: their uint32 key data)."""
  sharding = getattr(x, "sharding", None) or _default_sharding()
  if _is_key(x):
    data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
    return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)
  shape, dtype = _shape_dtype(x)
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def _rewrap_key(target_leaf, restored):
  """A restored leaf, wrapped back into a typed key if the target's leaf is one. (JAX itself writes
  a replicated key array's spec as P(None,): equivalent to, but not equal to, a target's P().)"""
  if not _is_key(target_leaf):
    return restored
  return jax.random.wrap_key_data(restored, impl=_key_impl_name(target_leaf))


def _mismatches(saved: dict[str, dict], wanted: dict[str, dict]) -> list[str]:
  """Human-readable differences between a checkpoint's manifest and the target's."""
  problems = [f"{p}: in the checkpoint but not in the target" for p in saved if p not in wanted]
  problems += [f"{p}: in the target but not in the checkpoint" for p in wanted if p not in saved]
  for p in saved.keys() & wanted.keys():
    s, w = saved[p], wanted[p]
    if s["shape"] != w["shape"]:
      problems.append(f"{p}: shape {tuple(s['shape'])} in the checkpoint, "
                      f"{tuple(w['shape'])} in the target")
    elif (s["dtype"] == "key") != (w["dtype"] == "key") or s.get("impl") != w.get("impl"):
      problems.append(f"{p}: {s.get('impl', s['dtype'])} in the checkpoint, "
                      f"{w.get('impl', w['dtype'])} in the target")
  return sorted(problems)


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
        _STATE: ocp.args.StandardSave(_unwrap_keys(state)),
        _META: ocp.args.JsonSave(meta),
        _MANIFEST: ocp.args.JsonSave({"leaves": _manifest(state)}),
    })
    saved = bool(self._manager.save(step, args=args, force=True))
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
    problems = _mismatches(saved, _manifest(target))
    if problems:
      more = len(problems) - _MAX_REPORTED
      raise CheckpointMismatchError(
          f"checkpoint {step_dir} does not match the restore target:\n  "
          + "\n  ".join(problems[:_MAX_REPORTED])
          + (f"\n  ... and {more} more" if more > 0 else ""))
    abstract = jax.tree.map(_abstract_leaf, target)
    restored = self._manager.restore(step, args=ocp.args.Composite(**{
        _STATE: ocp.args.StandardRestore(abstract),
        _META: ocp.args.JsonRestore(),
    }))
    state = jax.tree.map(_rewrap_key, target, restored[_STATE])
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
        meta = self.read_meta(step)
      except Exception as e:  # pylint: disable=broad-exception-caught
        self._skip(step, e, failed)
        continue
      if check is not None:
        check(step, meta)
      try:
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
