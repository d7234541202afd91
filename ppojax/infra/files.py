"""Writing a run's files: atomically, and with the permissions the user's umask gives.

Every file ppojax writes whole (JSON, JSONL, the curves picture, the exported model, the cached
GGUF) goes through :func:`atomic_write`: a new temporary file next to the target, renamed onto it
once complete, so a reader (or a run killed mid-write) sees the old file or the whole new one.

The temporary file is created with mode 0666, which the umask trims as ``open()`` would: not
with ``tempfile.mkstemp``, whose files are owner-only (0600) whatever the umask, so that a model
exported for a serving process or another user could not be read. Directories made by
``tempfile.mkdtemp`` (and files that libraries write into them) get the same treatment from
:func:`ordinary_permissions`: 0666 for files and 0777 for directories, minus the umask.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import uuid
from typing import IO, Iterator


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
