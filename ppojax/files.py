"""Files a run writes get the permissions the user's umask gives, as ``open()`` would.

Atomic writes go through temporary files and directories (``tempfile.mkstemp`` / ``mkdtemp``),
which are created owner-only (0600 / 0700) whatever the umask; renamed into place they would
keep that, so another user or a serving process could not read an exported model. These
helpers put the ordinary mode back: 0666 for files and 0777 for directories, minus the umask.
"""

from __future__ import annotations

import os
import pathlib
import re


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
