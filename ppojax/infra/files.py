"""Writing a run's files: atomically, and with the permissions the user's umask gives.

Every file ppojax writes whole (JSON, JSONL, the curves picture, the exported model, the cached
GGUF) goes through :func:`atomic_write`: a new temporary file next to the target, renamed onto it
once complete, so a reader (or a run killed mid-write) sees the old file or the whole new one.

The temporary file is created with mode 0666, which the umask trims as ``open()`` would: not
with ``tempfile.mkstemp``, whose files are owner-only (0600) whatever the umask, so that a model
exported for a serving process or another user could not be read. Directories made by
``tempfile.mkdtemp`` (and files that libraries write into them) get the same treatment from
:func:`ordinary_permissions`: 0666 for files and 0777 for directories, minus the umask.

A full disk is one :class:`DiskFullError` saying what did not fit, how much is free and what to
do (:func:`disk_full`); :func:`quiet_if` keeps the writer threads' own tracebacks about it (and
about a checkpoint that does not read back) from burying that message.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import pathlib
import shutil
import re
import sys
import uuid
from typing import IO, Callable, Iterator


class DiskFullError(OSError):
  """No space was left on the device for a file a run writes (a checkpoint, the export)."""


def is_disk_full(error: BaseException) -> bool:
  """Whether ``error`` (or one it was raised from) reports a full disk (ENOSPC): OSError's
  errno, or the message of a library that wraps it (tensorstore, safetensors)."""
  while error is not None:
    if getattr(error, "errno", None) == errno.ENOSPC or "No space left on device" in str(error):
      return True
    error = error.__cause__ or error.__context__
  return False


class _Held(logging.Filter):
  """Keeps a logger's records instead of letting them through."""

  def __init__(self):
    super().__init__()
    self.records: list[logging.LogRecord] = []

  def filter(self, record: logging.LogRecord) -> bool:
    self.records.append(record)
    return False


def _closed_loop_noise(unraisable) -> bool:
  """The RuntimeError of a callback that reaches an event loop already closed: tensorstore's
  writes still in flight when orbax abandons a save report back that way."""
  error = unraisable.exc_value
  return isinstance(error, RuntimeError) and "Event loop is closed" in str(error)


@contextlib.contextmanager
def quiet_if(reported: Callable[[BaseException], bool],
             logger: str = "absl") -> Iterator[None]:
  """Holds back ``logger``'s records (orbax logs through absl's) while the block runs and lets
  them through after it, unless it raised an error that ``reported(error)`` says the caller
  reports itself (a full disk: :func:`is_disk_full`; an unreadable checkpoint): then they are
  dropped, so one clear message stands for what would be ~100 lines of tracebacks from orbax's
  threads. Any other outcome shows every record, in order. The RuntimeErrors of callbacks into
  a closed event loop (tensorstore's reads or writes that outlive an abandoned save or restore,
  never the error itself) are dropped while the block runs and, after a reported error, from
  then on."""
  held, log = _Held(), logging.getLogger(logger)
  previous = sys.unraisablehook
  sys.unraisablehook = lambda u: None if _closed_loop_noise(u) else previous(u)
  log.addFilter(held)
  dropped = False
  try:
    yield
  except BaseException as e:
    dropped = reported(e)
    raise
  finally:
    log.removeFilter(held)
    if not dropped:
      sys.unraisablehook = previous
      for record in held.records:
        log.handle(record)


def size_text(n: float) -> str:
  """Bytes as "3.2 GB", "640.0 MB" or "12.0 kB" (powers of 1000)."""
  unit = next((u for u in ("GB", "MB") if n >= {"GB": 1e9, "MB": 1e6}[u]), "kB")
  return f"{n / {'GB': 1e9, 'MB': 1e6, 'kB': 1e3}[unit]:.1f} {unit}"


def disk_full(what: str, path: str | os.PathLike, remedy: str) -> DiskFullError:
  """The error for ``what`` not fitting at ``path``: how much is free there, and ``remedy``."""
  probe = pathlib.Path(path)
  while not probe.exists() and probe != probe.parent:
    probe = probe.parent
  free = shutil.disk_usage(probe).free
  return DiskFullError(errno.ENOSPC, f"no space left on device for {what} in {path} "
                       f"({size_text(free)} free): {remedy}")


def umask() -> int:
  """The process's umask, read without changing it where Linux allows (``/proc``)."""
  try:
    status = pathlib.Path("/proc/self/status").read_text()
    found = re.search(r"^Umask:\s*([0-7]+)", status, re.MULTILINE)
    if found:
      return int(found.group(1), 8)
  except OSError:
    pass
  mask = os.umask(0o022)  # elsewhere: the only portable way to read it is to set it
  os.umask(mask)
  return mask


def default_mode(is_dir: bool) -> int:
  """0666 (files) or 0777 (directories) minus the umask: what ``open`` / ``mkdir`` create."""
  return (0o777 if is_dir else 0o666) & ~umask()


def ordinary_permissions(path: str | os.PathLike) -> None:
  """Gives ``path`` (and, for a directory, everything under it) the umask's default mode."""
  path = pathlib.Path(path)
  file_mode, dir_mode = default_mode(False), default_mode(True)
  if path.is_dir():
    for root, dirs, names in os.walk(path):
      for d in dirs:
        os.chmod(os.path.join(root, d), dir_mode)
      for n in names:
        os.chmod(os.path.join(root, n), file_mode)
  path.chmod(dir_mode if path.is_dir() else file_mode)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w") -> Iterator[IO]:
  """Opens a new hidden file next to ``path`` (``mode`` "w" for UTF-8 text, "wb" for bytes);
  when the block ends without an exception it is flushed to disk and renamed onto ``path``,
  otherwise removed, leaving any old ``path`` as it was. Creates parent directories."""
  if mode not in ("w", "wb"):
    raise ValueError(f"atomic_write mode must be 'w' or 'wb', got {mode!r}")
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
  fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies
  try:
    with os.fdopen(fd, mode, **({"encoding": "utf-8"} if mode == "w" else {})) as f:
      yield f
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    tmp.unlink(missing_ok=True)
    raise
