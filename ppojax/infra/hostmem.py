"""Host memory for XLA:CPU: back large buffers with transparent huge pages (glibc), give the C
heap's free pages back between phases (``release``), and compile a step apart from its first
call (``compiled_call``).

XLA:CPU takes the temporaries of a compiled program from ``malloc`` as one block per call (6.2 GB
for the SmolLM2 PPO step of ``benchmarks/ppo_step.py``) and frees it on return. glibc serves such
a block with a fresh ``mmap``, so every call touches it page by page again: 16 million 4 KiB page
faults in that benchmark's run (108 s of system time in a 220 s run). The glibc tunable
``glibc.malloc.hugetlb=1`` (glibc ≥ 2.35) makes malloc ask for transparent huge pages
(``madvise(MADV_HUGEPAGE)``): 16 M → 0.5 M faults, and 15.6 → 12.4 s per iteration in that
benchmark (same code, one run each). Results are bit-identical; only the page size changes.

glibc reads tunables once, when a process starts, so ``reexec_with_huge_pages`` restarts the
current command with the tunable set (once: the new process finds it set and carries on). The
entry points call it first thing (``python -m ppojax.train`` / ``sft`` / ``train_rm`` and the
benchmarks); research code can start Python with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``.
It does nothing where it cannot help: not Linux/glibc ≥ 2.35, transparent huge pages off
(``/sys/kernel/mm/transparent_hugepage/enabled`` = never), an allocator preloaded through
``LD_PRELOAD``, or ``PPOJAX_HUGE_PAGES=0``.
"""

from __future__ import annotations

import os
import platform
import sys

TUNABLE = "glibc.malloc.hugetlb=1"
_THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def huge_pages_available() -> bool:
  """True where glibc ≥ 2.35 and the kernel's transparent huge pages are not off."""
  if platform.system() != "Linux":
    return False
  libc, version = platform.libc_ver()
  try:
    if libc != "glibc" or tuple(int(x) for x in version.split(".")[:2]) < (2, 35):
      return False
    with open(_THP, encoding="ascii") as f:
      return "[never]" not in f.read()
  except (OSError, ValueError):
    return False


def huge_pages_active() -> bool:
  """True when this process started with the tunable set."""
  return TUNABLE in os.environ.get("GLIBC_TUNABLES", "").split(":")


def reexec_with_huge_pages(argv: list[str] | None = None) -> None:
  """Replace this process by the same command started with ``GLIBC_TUNABLES`` extended by
  ``glibc.malloc.hugetlb=1``, where that helps (see the module docstring); otherwise return.

  ``argv``: the command after the interpreter; default: this one's (``-m pkg.mod`` and its
  arguments for a module run with ``python -m``, else ``sys.argv``). Call it before any work:
  whatever ran before runs again in the new process.
  """
  if (os.environ.get("PPOJAX_HUGE_PAGES", "1") == "0" or huge_pages_active()
      or os.environ.get("LD_PRELOAD") or not huge_pages_available()):
    return
  env = dict(os.environ)
  env["GLIBC_TUNABLES"] = ":".join(filter(None, [env.get("GLIBC_TUNABLES"), TUNABLE]))
  args = list(_own_argv() if argv is None else argv)
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, [sys.executable, *args], env)


def _own_argv() -> list[str]:
  """This process's command after the interpreter: ``-m`` and the module's name for a module
  run with ``python -m`` (whose ``sys.argv[0]`` is the module's file), else ``sys.argv``."""
  spec = getattr(sys.modules.get("__main__"), "__spec__", None)
  if spec is not None and spec.name:
    return ["-m", spec.name.removesuffix(".__main__"), *sys.argv[1:]]
  return list(sys.argv)


def release() -> bool:
  """Give the C heap's free pages back to the operating system (glibc's ``malloc_trim(0)``);
  False where there is no glibc. Called between the phases of a run (after loading, after every
  iteration, evaluation and save).

  glibc keeps freed blocks of under 32 MiB in its heaps (and one heap per thread: orbax's and
  XLA's thread pools each get one) for the next ``malloc``; it returns memory on its own only
  from the top of a heap. Loading a model, every iteration's smaller buffers and every
  checkpoint's writer threads leave such holes, so without this the resident set grows from
  phase to phase and the next compiled program's temporaries come on top. Three iterations
  of the quickstart with a save (``python benchmarks/memory.py --ab``) peaked at 6.80 GiB
  without this and 4.96 GiB with it for GRPO (``configs/grpo_arith.py``: 2.0 GiB of
  parameters, optimizer state and reference, 1.3 GiB of XLA temporaries), 9.70 and 7.52 GiB
  for PPO."""
  global _LIBC
  if os.environ.get("PPOJAX_RELEASE_MEMORY", "1") == "0":  # for A/B measurements
    return False
  if _LIBC is None:
    _LIBC = _load_libc()
  if not _LIBC:
    return False
  _LIBC.malloc_trim(0)
  return True


_LIBC = None


def _load_libc():
  """glibc through ctypes, or False (another C library, or none found)."""
  if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
    return False
  import ctypes  # pylint: disable=import-outside-toplevel
  try:
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    return libc
  except (OSError, AttributeError):
    return False


def peak_rss_mb() -> float:
  """This process's peak resident set in MiB: ``VmHWM`` of /proc/self/status (Linux), else
  ``ru_maxrss``.

  ``ru_maxrss`` is wrong for a process started by another large one: Linux folds the memory
  map's high-water mark into it at ``execve``, and a forked child's map starts as a copy of
  the parent's, so the child reports at least the parent's resident set at the fork (a
  benchmark's child run after the parent's own work reported exactly the parent's peak).
  ``VmHWM`` belongs to the memory map that ``execve`` creates, so it counts this program only."""
  try:
    with open("/proc/self/status", encoding="ascii") as f:
      for line in f:
        if line.startswith("VmHWM:"):
          return int(line.split()[1]) / 1024  # kB
  except (OSError, ValueError, IndexError):
    pass
  import resource  # pylint: disable=import-outside-toplevel
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
  return rss / (2**20 if sys.platform == "darwin" else 2**10)


_COMPILED: set = set()  # (id of a jitted function, its arguments' shapes) seen by compiled_call


def compiled_call(fn, *args):
  """``fn(*args)`` for a jitted ``fn``, compiled apart on its first call with these argument
  shapes, with ``release`` between the compile and the call.

  XLA's compiler frees its working memory into the C heap, where the call's buffers (large
  blocks, mapped afresh) do not reuse it, so a compile inside the call added it to the call's
  own peak. Compiled first and the heap handed back, the call finds the executable in JAX's
  cache, and the process's peak is the larger of the two, not their sum (the SmolLM2 LoRA PPO
  step, ``benchmarks/ppo_step.py --lora 16 --remat``: 0.9 GB of compile against 1.0 GB of
  step, on 1.7 GB held). The training loops call their steps through it (``runner.iteration``,
  ``supervised.train``). A plain function is just called. (An id that a new function reuses
  after the old one is gone only skips the compile apart: the call then compiles as usual.)"""
  if not hasattr(fn, "lower"):
    return fn(*args)
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  leaves, tree = jax.tree.flatten(args)
  key = (id(fn), tree, tuple((np.shape(x), str(getattr(x, "dtype", type(x)))) for x in leaves))
  if key not in _COMPILED:
    fn.lower(*args).compile()
    release()
    _COMPILED.add(key)
  return fn(*args)
