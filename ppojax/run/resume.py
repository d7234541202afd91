"""Resume only the run that wrote the checkpoint.

Every checkpoint's meta holds a *fingerprint* of the run: its resolved config, flattened to
``"section.field" -> value``, and of its data (``data_fingerprint``). A rerun in the same workdir
compares its own fingerprint with the checkpoint's, field by field, before any array is read:

- fields in ``ALLOWED`` may change freely (how long to train, how often to log, save and
  evaluate, where things are, memory options that give the same numbers);
- any other difference stops the run with a ``ResumeError`` that lists each field as
  ``checkpoint -> now`` and the override that accepts them deliberately:
  ``--config.resume_allow_changes=seed,rl.batch_size`` (comma-separated names; a section name
  such as ``ppo`` accepts all of its fields). Accepted changes are warned about, and the next
  checkpoint holds the new fingerprint. Nothing in the workdir is changed by a refusal;
- a checkpoint without a fingerprint (written before ppojax stored one) resumes with a warning;
  fields known to only one side (options added or removed between ppojax versions) too.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import warnings
from typing import Any, Callable

import numpy as np

from ppojax.core import algorithms

OVERRIDE = "resume_allow_changes"
# Fields (or whole sections) that may differ from the checkpoint's without a refusal.
ALLOWED = (
    "num_iterations",  # train longer (or stop earlier); the lr schedule spans the new length
    "log_every", "sample_every", "sample_table_rows", "save_every", "keep", "phase_timing",
    "wandb_project", "distributed", "coordinator_address", "num_processes", "process_id",
    OVERRIDE,
    "eval",  # held-out evaluation and monitoring
    "data.path",  # the file may move: its contents are fingerprinted (data.contents)
    "data.eval_path", "data.eval_per_digits", "data.eval_size",  # held-out data only
    # memory and speed options that give the same numbers (up to float rounding)
    "mesh.shape", "model.remat", "model.remat_policy", "data.shared_prefix", "data.prompt_bucket",
    "rl.grad_accum", "rl.forward_micro_batches", "rl.reuse_update_forward",
    "rl.max_bad_steps", "model.attention", "model.decode_attention",
    "sampling.decode_layers",
    # the supervised stages (ppojax.supervised.common): how long to train, logging and evaluation,
    # micro-batches (exact accumulation), and data sources whose training rows are
    # fingerprinted (data.train_rows)
    "train.num_epochs", "train.log_every", "train.eval_every", "train.eval_batch_size",
    "train.grad_accum", "data.train", "data.eval", "data.eval_split", "data.eval_size",
)
_HASH_CHARS = 16  # of a sha256 shown in a message
DATA_FIELDS = {  # the data fingerprint's fields (data_fingerprint), compared as config fields
    "data.first_batch": "sha256 of the first batch's prompt tokens",
    "data.contents": "sha256 of data.path's bytes",
    "data.train_rows": "sha256 of the encoded training rows",
}


class ResumeError(ValueError):
  """The workdir's checkpoint was written by a run with another config or data."""


class ResumeWarning(UserWarning):
  """Resuming although something could not be checked, or with accepted changes."""


# ---------------------------------------------------------------------------------------------
# Fingerprints
# ---------------------------------------------------------------------------------------------


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
  """``{"rl": {"batch_size": 16}}`` -> ``{"rl.batch_size": 16}``, values as JSON gives them
  back (tuples become lists; anything else JSON cannot hold, its repr)."""
  flat = {}
  for key, value in tree.items():
    name = f"{prefix}{key}"
    if isinstance(value, dict) and value:
      flat.update(flatten(value, name + "."))
    else:
      flat[name] = value
  return json.loads(json.dumps(flat, default=repr))


def rows_sha256(tokens: np.ndarray, mask: np.ndarray) -> str:
  """sha256 of each row's real (masked) tokens: independent of the padded width."""
  h = hashlib.sha256()
  for row, keep in zip(np.asarray(tokens), np.asarray(mask, bool)):
    real = row[keep].astype("<i8")
    h.update(np.int64(real.size).tobytes())
    h.update(real.tobytes())
  return h.hexdigest()


def path_sha256(path: str | os.PathLike) -> str:
  """sha256 of a file's bytes, or of every file under a directory (relative names and bytes,
  in sorted order)."""
  root = pathlib.Path(path)
  files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
  h = hashlib.sha256()
  for f in files:
    if root.is_dir():
      h.update(str(f.relative_to(root)).encode() + b"\0")
    with open(f, "rb") as stream:
      for chunk in iter(lambda: stream.read(1 << 20), b""):
        h.update(chunk)
  return h.hexdigest()


def data_fingerprint(config, source) -> dict[str, str]:
  """What the config alone cannot tell about the data: ``data.first_batch``, the sha256 of the
  first batch's prompt tokens (catches another tokenizer, chat template or task generator; it
  also follows every config field that shapes the batch, such as seed and rl.batch_size), and
  for ``data.task="file"`` ``data.contents``, the sha256 of ``data.path``'s bytes (the file
  edited or replaced under the same name)."""
  prompts = source.batch(0).prompts
  prints = {"data.first_batch": rows_sha256(prompts.tokens, prompts.mask)}  # DATA_FIELDS
  if config.data.task == "file":
    prints["data.contents"] = path_sha256(config.data.path)
  return prints


def fingerprint(config, source) -> dict[str, dict]:
  """The fingerprint saved in every checkpoint's meta: ``{"config": flat, "data": {...}}``, of
  the config with its algorithm's defaults filled in (``algorithms.resolve``: the same run
  whether a field was left to the algorithm or set to its value)."""
  config = algorithms.resolve(config)
  return {"config": flatten(config.to_dict()), "data": data_fingerprint(config, source)}


def supervised_fingerprint(config, train: dict[str, np.ndarray]) -> dict[str, dict]:
  """The fingerprint of a supervised stage (``ppojax.supervised.loop.fit``): its flat config and
  ``data.train_rows``, the sha256 of the training set's real tokens, array by array in name
  order (each ``NAME`` with its ``NAME_mask``: ``rows_sha256``, independent of the padded
  width). It catches another data file or contents, tokenizer, chat template or generator."""
  h = hashlib.sha256()
  for name in sorted(k for k in train if f"{k}_mask" in train):
    h.update(name.encode() + b"\0" + rows_sha256(train[name], train[f"{name}_mask"]).encode())
  return {"config": flatten(config.to_dict()), "data": {"data.train_rows": h.hexdigest()}}


# ---------------------------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------------------------


def _covers(names, field: str) -> bool:
  """Whether ``field`` is one of ``names`` or inside a section named there."""
  return any(field == n or field.startswith(n + ".") for n in names)


def accepted(config) -> tuple[str, ...]:
  """The field names of ``config.resume_allow_changes`` ("seed, rl.batch_size")."""
  return tuple(n.strip() for n in str(config.get(OVERRIDE, "") or "").split(",") if n.strip())


def _show(name: str, value) -> str:
  if name in DATA_FIELDS and isinstance(value, str):
    return value[:_HASH_CHARS] + "…"
  return json.dumps(value)


def _line(name: str, old, new) -> str:
  why = f" ({DATA_FIELDS[name]})" if name in DATA_FIELDS else ""
  return f"{name}: {_show(name, old)} -> {_show(name, new)}{why}"


def _fields(print_: dict) -> dict[str, Any]:
  return {**print_.get("config", {}), **print_.get("data", {})}


def differences(saved: dict, current: dict) -> list[tuple[str, Any, Any]]:
  """(field, checkpoint's value, current value) of the fields both know that differ and are
  not in ``ALLOWED``, sorted by name."""
  old, new = _fields(saved), _fields(current)
  return [(name, old[name], new[name]) for name in sorted(old.keys() & new.keys())
          if old[name] != new[name] and not _covers(ALLOWED, name)]


def check(meta: dict, current: dict, config, where: str) -> None:
  """Raises ``ResumeError`` when the checkpoint ``where`` (its meta ``meta``) was written with
  another config or data than ``current`` (``fingerprint``) in a field neither ``ALLOWED`` nor
  accepted by ``config.resume_allow_changes``; warns about what it cannot check or accepts."""
  saved = meta.get("fingerprint")
  if not saved:
    warnings.warn(f"checkpoint {where} holds no config fingerprint (written before ppojax "
                  "stored one): resuming without checking that it comes from this config",
                  ResumeWarning, stacklevel=2)
    return
  diffs = differences(saved, current)
  allowed_now = accepted(config)
  refused = [d for d in diffs if not _covers(allowed_now, d[0])]
  if refused:
    lines = "\n".join(f"  {_line(*d)}" for d in refused)
    names = ",".join(n for n, _, _ in diffs)
    raise ResumeError(
        f"the checkpoint {where} was written by a run with another config or data; these "
        f"fields differ (checkpoint -> now):\n{lines}\n"
        "Resuming would silently continue that run with other settings. Start a new run with "
        "another --workdir, restore the checkpoint's values, or accept the changes "
        f"deliberately with --config.{OVERRIDE}={names}\n(num_iterations and the logging, "
        "saving, evaluation and memory options may always change: ppojax.run.resume.ALLOWED). "
        "Nothing in the workdir was changed.")
  if diffs:
    warnings.warn(f"resuming from {where} with changes accepted by {OVERRIDE}: "
                  + "; ".join(_line(*d) for d in diffs),
                  ResumeWarning, stacklevel=2)
  unknown = sorted(_fields(saved).keys() ^ _fields(current).keys())
  if unknown:
    warnings.warn(f"fields only the checkpoint {where} or only this config knows (another "
                  f"ppojax version?), not compared: {', '.join(unknown)}", ResumeWarning,
                  stacklevel=2)


def restore(ckpt, target, current: dict, config,
            accepted: Callable[[], None] | None = None) -> tuple[Any, dict]:
  """(state, meta) of the newest readable checkpoint of ``ckpt`` (``Checkpointer``) after
  ``check`` passed on its meta; corrupt newer steps are skipped and set aside with a warning
  (``Checkpointer.restore_newest``). ``accepted()`` runs once a step's meta passed, before its
  arrays are read (where the caller frees the state they replace); a refusal runs none."""
  def checked(step: int, meta: dict) -> None:
    check(meta, current, config, os.path.join(ckpt.directory, str(step)))
    if accepted is not None:
      accepted()
  state, meta, _ = ckpt.restore_newest(target, checked)
  return state, meta
