"""ppojax.infra.hostmem: the entry points restart once with glibc's huge-page tunable, never loop, and
leave the process alone where it cannot help or is turned off; with the tunable, glibc's malloc
really advises the kernel to back a large block with huge pages.

Where huge pages are unavailable (no glibc >= 2.35, or transparent huge pages "never") no restart
happens with or without the switches under test, so those tests would prove nothing: they skip,
saying why."""

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from ppojax.infra import hostmem
from ppojax.run import build as build_lib

ROOT = pathlib.Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent("""
    import ctypes, os, sys
    print("start", flush=True)  # printed once per process image
    from ppojax.infra import hostmem
    hostmem.reexec_with_huge_pages()
    print("args", sys.argv[1:], flush=True)
    print("tunables", os.environ.get("GLIBC_TUNABLES", ""), flush=True)
    print("active", hostmem.huge_pages_active(), flush=True)
    # a 64 MiB malloc, as XLA:CPU's temporaries: its own mapping; VmFlags "hg" = MADV_HUGEPAGE
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    block = libc.malloc(ctypes.c_size_t(64 << 20))
    ctypes.memset(block, 1, 64 << 20)
    inside = False
    for line in open("/proc/self/smaps"):
      head = line.split()[0]
      if "-" in head and ":" not in head:
        lo, hi = (int(x, 16) for x in head.split("-"))
        inside = lo <= block < hi
      elif inside and head == "VmFlags:":
        print("advised", "hg" in line.split()[1:], flush=True)
      elif inside and head == "AnonHugePages:":
        print("huge_kb", line.split()[1], flush=True)
""")


THP = pathlib.Path(hostmem._THP)  # pylint: disable=protected-access


def _thp() -> str:
  """The kernel's transparent-huge-page setting, e.g. "always [madvise] never"."""
  try:
    return THP.read_text().strip()
  except OSError as e:
    return f"unreadable ({e})"


@pytest.fixture
def huge_pages():
  """Skips, saying why, where ``reexec_with_huge_pages`` never restarts; else the THP mode
  ("always" or "madvise"). glibc's tunable acts only in "madvise" mode (in "always" the kernel
  backs large blocks with huge pages anyway)."""
  thp = _thp()
  if not hostmem.huge_pages_available():
    import platform  # pylint: disable=import-outside-toplevel
    pytest.skip(f"no huge pages to ask for here: {THP} is {thp!r}, libc is "
                f"{' '.join(platform.libc_ver())} (needs glibc >= 2.35 and THP not 'never')")
  return thp[thp.find("[") + 1:thp.find("]")]


def _run(tmp_path, env_changes):
  script = tmp_path / "probe.py"
  script.write_text(SCRIPT)
  env = {k: v for k, v in os.environ.items()
         if k not in ("GLIBC_TUNABLES", "PPOJAX_HUGE_PAGES", "LD_PRELOAD")}
  env.update(env_changes)
  out = subprocess.run([sys.executable, str(script), "--flag", "x y"], env=env, check=True,
                       capture_output=True, text=True, timeout=120).stdout
  return out.splitlines()


def test_restarts_once_with_the_tunable_and_the_same_arguments(tmp_path, huge_pages):
  lines = _run(tmp_path, {"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"})
  assert lines.count("start") == 2, lines  # the first image, then the restarted one: no loop
  assert "args ['--flag', 'x y']" in lines
  assert "tunables glibc.malloc.arena_max=4:glibc.malloc.hugetlb=1" in lines  # kept, extended
  assert "active True" in lines
  if huge_pages == "madvise":  # what the tunable does: malloc asks for huge pages
    assert "advised True" in lines, lines


@pytest.mark.parametrize("env", [{"PPOJAX_HUGE_PAGES": "0"},
                                 {"GLIBC_TUNABLES": hostmem.TUNABLE},
                                 {"LD_PRELOAD": "libc.so.6"}])  # stands for tcmalloc & co.
def test_no_restart_when_off_already_set_or_another_allocator(tmp_path, huge_pages, env):
  lines = _run(tmp_path, env)
  assert lines.count("start") == 1, lines
  tunable = env.get("GLIBC_TUNABLES") == hostmem.TUNABLE
  assert ("active True" in lines) == tunable
  if huge_pages == "madvise":  # advised exactly where the process started with the tunable
    assert (f"advised {tunable}") in lines, lines


def test_without_the_tunable_malloc_does_not_advise(tmp_path, huge_pages):
  """The control for the test above: the same probe, started the way the restart is skipped."""
  if huge_pages != "madvise":
    pytest.skip(f"transparent huge pages are {huge_pages!r} here: glibc's tunable only acts "
                "in 'madvise' mode")
  lines = _run(tmp_path, {"PPOJAX_HUGE_PAGES": "0"})
  assert "advised False" in lines and "huge_kb 0" in lines, lines


def test_cli_results_do_not_depend_on_huge_pages(tmp_path, huge_pages):
  """The training CLI restarted with the tunable (the default) writes the same metrics, bit for
  bit, as with PPOJAX_HUGE_PAGES=0: only the page size of host buffers changes. A
  sitecustomize.py logs each interpreter start's GLIBC_TUNABLES: the default run really ran
  under the tunable, the other never did."""
  from ppojax.run import reporting  # pylint: disable=import-outside-toplevel
  del huge_pages
  root = pathlib.Path(__file__).parents[1]
  site = tmp_path / "site"
  site.mkdir()
  (site / "sitecustomize.py").write_text(
      "import os\nwith open(os.environ['PROBE_STARTS'], 'a') as f:\n"
      "  f.write(repr(os.environ.get('GLIBC_TUNABLES', '')) + '\\n')\n")
  rows, starts = {}, {}
  for pages in ("1", "0"):
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "LD_PRELOAD")}
    env.update(PPOJAX_HUGE_PAGES=pages, PROBE_STARTS=str(tmp_path / f"starts_{pages}"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")])))
    workdir = tmp_path / pages
    result = subprocess.run(
        [sys.executable, "-m", "ppojax.train", "--config", str(root / "configs" / "toy.py"),
         "--workdir", str(workdir), "--config.num_iterations=4", "--config.log_every=1",
         "--config.sample_every=0"],
        cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows[pages] = [{k: v for k, v in row.items()
                    if not k.startswith(("time/", "eps", "memory/", "compile/"))}
                   for row in reporting.read_metrics(str(workdir / "metrics.jsonl"))]
    starts[pages] = (tmp_path / f"starts_{pages}").read_text().splitlines()
  assert starts["1"] == ["''", repr(hostmem.TUNABLE)], starts  # restarted once, with it
  assert starts["0"] == ["''"], starts
  assert len(rows["1"]) == 4 and rows["1"] == rows["0"]


def test_peak_rss_of_a_child_counts_the_child_only():
  """A child of a large process: ``ru_maxrss`` reports at least the parent's resident set at
  the fork (Linux folds the copied map's high-water mark in at execve); ``peak_rss_mb``
  (VmHWM) counts the child's own program."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  if not pathlib.Path("/proc/self/status").exists():
    pytest.skip("VmHWM is Linux's")
  ballast = np.ones(600 * 2**20 // 8)  # 600 MB resident in this process
  script = ("import resource; from ppojax.infra import hostmem; "
            "print(hostmem.peak_rss_mb(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)")
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       check=True).stdout.split()
  ours, maxrss = float(out[0]), float(out[1])
  assert ballast.sum() > 0
  assert ours < 400 < 600 <= maxrss, (ours, maxrss)


RELEASE_SCRIPT = textwrap.dedent("""
    import ctypes, json
    from ppojax.infra import hostmem
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    def rss():
      for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
          return int(line.split()[1]) // 1024
    # 256 MiB in 64 KiB blocks (under glibc's mmap threshold: they live in the heap), touched,
    # then all freed but the last, which pins the heap's top so glibc cannot shrink it itself
    blocks = [libc.malloc(64 << 10) for _ in range(4096)]
    for b in blocks:
      libc.memset(b, 1, 64 << 10)
    before = rss()
    for b in blocks[:-1]:
      libc.free(b)
    freed = rss()
    released = hostmem.release()
    print(json.dumps({"before": before, "freed": freed, "after": rss(), "released": released}))
""")


def _release_run(env_extra: dict) -> dict:
  out = subprocess.run([sys.executable, "-c", RELEASE_SCRIPT], capture_output=True, text=True,
                       env={**os.environ, **env_extra}, check=True)
  return __import__("json").loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not hostmem._load_libc(), reason="hostmem.release needs glibc")
def test_release_returns_the_heaps_free_pages():
  r = _release_run({})
  assert r["released"] is True
  assert r["freed"] - r["before"] > -64, r  # glibc keeps the freed blocks resident itself
  assert r["freed"] - r["after"] > 200, r  # ... until release gives them back (256 MiB freed)


def test_release_can_be_turned_off():
  r = _release_run({"PPOJAX_RELEASE_MEMORY": "0"})
  assert r["released"] is False
  assert r["freed"] - r["after"] < 32, r



def test_each_step_function_compiles_once_apart_from_its_first_call(monkeypatch):
  """``runner.iteration`` compiles a step function before its first call with given shapes and
  hands the heap back before the call (``hostmem.compiled_call``); the call then finds the
  executable in JAX's cache: one backend compile per function, each followed by a release."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax._src import monitoring  # pylint: disable=import-outside-toplevel

  from ppojax.run import runner  # pylint: disable=import-outside-toplevel
  events = []
  monkeypatch.setattr(hostmem, "release", lambda: events.append("release") or True)

  def on_event(name, *_, **__):
    if name == "/jax/core/compile/backend_compile_duration":
      events.append("compile")

  r = build_lib.build(build_lib.load_config(ROOT / "configs" / "toy.py", rl__batch_size=4,
                                      num_iterations=3))
  assert r.policy.params is None  # the state holds the weights, the run no second copy
  prompts, state = r.source.batch(0).prompts, r.state
  seen = []
  jax.monitoring.register_event_duration_secs_listener(on_event)
  try:
    for phase_timing in (False, False, True, True):
      events.clear()
      state, metrics, _, _ = runner.iteration(r, state, prompts, phase_timing=phase_timing)
      assert np.isfinite(metrics["loss/policy_avg"])
      seen.append(list(events))
  finally:
    monitoring.unregister_event_duration_listener(on_event)
  fused, fused_again, phases, phases_again = seen
  assert fused == ["compile", "release", "release"]  # compile, release, run, the iteration's own
  assert phases == ["compile", "release"] * 2 + ["release"] + ["compile", "release", "release"]
  assert fused_again == ["release"] and phases_again == ["release", "release"]  # cached
