"""ppojax.hostmem: the entry points restart once with glibc's huge-page tunable, never loop, and
leave the process alone where it cannot help or is turned off."""

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from ppojax import hostmem

SCRIPT = textwrap.dedent("""
    import os, sys
    print("start", flush=True)  # printed once per process image
    from ppojax import hostmem
    hostmem.reexec_with_huge_pages()
    print("args", sys.argv[1:], flush=True)
    print("tunables", os.environ.get("GLIBC_TUNABLES", ""), flush=True)
    print("active", hostmem.huge_pages_active(), flush=True)
""")


def _run(tmp_path, env_changes):
  script = tmp_path / "probe.py"
  script.write_text(SCRIPT)
  env = {k: v for k, v in os.environ.items()
         if k not in ("GLIBC_TUNABLES", "PPOJAX_HUGE_PAGES", "LD_PRELOAD")}
  env.update(env_changes)
  out = subprocess.run([sys.executable, str(script), "--flag", "x y"], env=env, check=True,
                       capture_output=True, text=True, timeout=120).stdout
  return out.splitlines()


def test_restarts_once_with_the_tunable_and_the_same_arguments(tmp_path):
  if not hostmem.huge_pages_available():
    pytest.skip("no glibc >= 2.35 with transparent huge pages here")
  lines = _run(tmp_path, {"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"})
  assert lines.count("start") == 2, lines  # the first image, then the restarted one: no loop
  assert "args ['--flag', 'x y']" in lines
  assert "tunables glibc.malloc.arena_max=4:glibc.malloc.hugetlb=1" in lines  # kept, extended
  assert "active True" in lines


@pytest.mark.parametrize("env", [{"PPOJAX_HUGE_PAGES": "0"},
                                 {"GLIBC_TUNABLES": hostmem.TUNABLE},
                                 {"LD_PRELOAD": "libc.so.6"}])  # stands for tcmalloc & co.
def test_no_restart_when_off_already_set_or_another_allocator(tmp_path, env):
  lines = _run(tmp_path, env)
  assert lines.count("start") == 1, lines
  assert ("active True" in lines) == (env.get("GLIBC_TUNABLES") == hostmem.TUNABLE)


def test_cli_results_do_not_depend_on_huge_pages(tmp_path):
  """The training CLI restarted with the tunable (the default) writes the same metrics, bit for
  bit, as with PPOJAX_HUGE_PAGES=0: only the page size of host buffers changes."""
  from ppojax import reporting  # pylint: disable=import-outside-toplevel
  root = pathlib.Path(__file__).parents[1]
  rows = {}
  for pages in ("1", "0"):
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "LD_PRELOAD")}
    env["PPOJAX_HUGE_PAGES"] = pages
    workdir = tmp_path / pages
    result = subprocess.run(
        [sys.executable, "-m", "ppojax.train", "--config", str(root / "configs" / "toy.py"),
         "--workdir", str(workdir), "--config.num_iterations=4", "--config.log_every=1",
         "--config.sample_every=0"],
        cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows[pages] = [{k: v for k, v in row.items() if not k.startswith(("time/", "eps"))}
                   for row in reporting.read_metrics(str(workdir / "metrics.jsonl"))]
  assert len(rows["1"]) == 4 and rows["1"] == rows["0"]
