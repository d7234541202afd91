"""files.atomic_write: all or nothing, and the umask's permissions (not mkstemp's 0600)."""

import os
import stat

import pytest

from ppojax.infra import files


@pytest.fixture
def umask_027():
  old = os.umask(0o027)
  yield
  os.umask(old)


def _mode(path) -> int:
  return stat.S_IMODE(os.stat(path).st_mode)


def test_atomic_write_gives_the_umasks_mode_and_replaces_whole(tmp_path, umask_027):
  path = tmp_path / "sub" / "out.json"
  with files.atomic_write(path) as f:
    f.write("é\n")
  assert path.read_text(encoding="utf-8") == "é\n"
  assert _mode(path) == 0o640 == files.default_mode(is_dir=False)
  assert _mode(path.parent) == 0o750
  with files.atomic_write(path, "wb") as f:
    f.write(b"new")
  assert path.read_bytes() == b"new" and _mode(path) == 0o640
  assert sorted(p.name for p in path.parent.iterdir()) == ["out.json"]


def test_atomic_write_failure_keeps_the_old_file_and_leaves_nothing(tmp_path):
  path = tmp_path / "out.txt"
  path.write_text("old")
  with pytest.raises(RuntimeError, match="mid-write"):
    with files.atomic_write(path) as f:
      f.write("half")
      raise RuntimeError("mid-write")
  assert path.read_text() == "old"
  assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]
  with pytest.raises(ValueError, match="'w' or 'wb'"):
    with files.atomic_write(path, "a"):
      pass


def test_ordinary_permissions_opens_up_a_mkdtemp_tree(tmp_path, umask_027):
  import tempfile  # pylint: disable=import-outside-toplevel
  d = tempfile.mkdtemp(dir=tmp_path)
  fd, name = tempfile.mkstemp(dir=d)
  os.close(fd)
  assert _mode(d) == 0o700 and _mode(name) == 0o600
  files.ordinary_permissions(d)
  assert _mode(d) == 0o750 and _mode(name) == 0o640
  assert files.umask() == 0o027
