"""Compiling as a measured, bounded cost: which platforms JAX starts, the persistent compilation
cache, and the seconds and count of XLA's compiles by program (docs/performance/compiling.md).

- ``choose_platforms``: with ``JAX_PLATFORMS`` unset and no TPU attached, JAX is kept from
  probing one (an installed libtpu otherwise prints initialisation errors on every start); the
  GPU platforms whose device and plugin are here and the CPU stay available. ``ppojax`` calls it
  on import, before JAX starts a back end.
- ``use_cache``: the persistent compilation cache (the command lines turn it on; ``cache_dir``
  says where: ``--compile_cache``, ``PPOJAX_COMPILE_CACHE``, ``JAX_COMPILATION_CACHE_DIR``, else
  ``$XDG_CACHE_HOME/ppojax/xla``).
- ``RECORDER``: listens to ``jax.monitoring``'s compile events; ``program(name)`` names the
  compiles made inside it, ``start`` and ``since`` give a run's ``Compiles``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import importlib.metadata
import importlib.util
import os
import pathlib
import pkgutil
import sys
import threading
from collections.abc import Iterator, Mapping

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # XLA's compile (or cache load)
CACHE_HIT = "/jax/compilation_cache/cache_hits"  # an executable read from the persistent cache
OTHER = "other"  # the program of a compile made outside every ``program``
CACHE_ENV = "PPOJAX_COMPILE_CACHE"
OFF = ("off", "none", "false", "0")
TPU_DEVICES = ("/dev/accel*", "/dev/vfio/*")  # how a TPU VM shows its chips
GPU_DEVICES = {"cuda": "/dev/nvidia[0-9]*", "rocm": "/dev/kfd"}


# ---- platforms -----------------------------------------------------------------------------

def tpu_attached() -> bool:
  """Whether a TPU chip shows as a device file (``/dev/accel*``, ``/dev/vfio/*``)."""
  return any(glob.glob(pattern) for pattern in TPU_DEVICES)


def libtpu_installed() -> bool:
  """Whether the libtpu package (what probes for a TPU when JAX starts) is installed."""
  return importlib.util.find_spec("libtpu") is not None


def _plugin_names() -> list[str]:
  """The installed JAX PJRT plugins' names (``jax_plugins.*`` modules and entry points)."""
  names = [e.name for e in importlib.metadata.entry_points(group="jax_plugins")]
  spec = importlib.util.find_spec("jax_plugins")
  if spec is not None and spec.submodule_search_locations:
    names += [m.name for m in pkgutil.iter_modules(spec.submodule_search_locations)]
  return names


def platforms_without_tpu() -> str:
  """``JAX_PLATFORMS`` without the TPU: each GPU platform whose device file and plugin are
  here, then "cpu" (e.g. "cuda,cpu"; "cpu" on a machine without accelerators)."""
  plugins = _plugin_names()
  gpus = [p for p, pattern in GPU_DEVICES.items()
          if glob.glob(pattern) and any(p in name for name in plugins)]
  return ",".join([*gpus, "cpu"])


def choose_platforms(environ: dict | None = None) -> str | None:
  """Sets ``JAX_PLATFORMS`` to ``platforms_without_tpu()`` when it is unset, libtpu is installed
  and no TPU is attached, and returns it; None (nothing changed) otherwise. A JAX already imported with its
  back ends not yet started gets the same through ``jax.config``."""
  environ = os.environ if environ is None else environ
  if "JAX_PLATFORMS" in environ or tpu_attached() or not libtpu_installed():
    return None  # without libtpu nothing probes for a TPU: JAX's own choice stands
  chosen = environ["JAX_PLATFORMS"] = platforms_without_tpu()
  jax = sys.modules.get("jax")
  if jax is not None and environ is os.environ:
    from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
    if not xla_bridge.backends_are_initialized():
      jax.config.update("jax_platforms", chosen)
  return chosen


# ---- the persistent cache ------------------------------------------------------------------

def default_cache_dir(environ: Mapping[str, str] | None = None) -> pathlib.Path:
  """``$XDG_CACHE_HOME/ppojax/xla``, or ``~/.cache/ppojax/xla``."""
  environ = os.environ if environ is None else environ
  root = environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
  return pathlib.Path(root) / "ppojax" / "xla"


def cache_dir(flag: str | None = None, environ: Mapping[str, str] | None = None) -> str | None:
  """Where the persistent cache lives; None: off. The first given of ``flag``
  (``--compile_cache``), ``PPOJAX_COMPILE_CACHE``, ``JAX_COMPILATION_CACHE_DIR``, else
  ``default_cache_dir``; "off" (or "none", "false", "0") in the flag or ``PPOJAX_COMPILE_CACHE``
  turns it off."""
  environ = os.environ if environ is None else environ
  for given in (flag, environ.get(CACHE_ENV)):
    if given:
      return None if given.strip().lower() in OFF else os.path.expanduser(given)
  return environ.get("JAX_COMPILATION_CACHE_DIR") or str(default_cache_dir(environ))


def use_cache(directory: str | None, environ: Mapping[str, str] | None = None) -> str | None:
  """Turns JAX's persistent compilation cache on in ``directory`` (made if missing), caching
  every program however small or quick to compile (unless ``JAX_PERSISTENT_CACHE_MIN_*`` say
  otherwise), or off for None; returns ``directory``. Call it before the first compile."""
  import jax  # pylint: disable=import-outside-toplevel
  from jax._src import compilation_cache  # pylint: disable=import-outside-toplevel
  environ = os.environ if environ is None else environ
  if any(getattr(compilation_cache, name, True) for name in ("_cache_initialized",
                                                             "_cache_checked")):
    compilation_cache.reset_cache()  # a cache opened (or found absent) before is forgotten
  if directory is None:
    jax.config.update("jax_enable_compilation_cache", False)
    return None
  pathlib.Path(directory).mkdir(parents=True, exist_ok=True)
  jax.config.update("jax_enable_compilation_cache", True)
  jax.config.update("jax_compilation_cache_dir", str(directory))
  if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in environ:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  if "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES" not in environ:
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # no size limit
  return str(directory)


# ---- the recorder --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Compiles:
  """XLA's compiles so far (or between two snapshots): seconds and count by program, and how
  many of them were read from the persistent cache (a hit's seconds are the cache's load)."""

  seconds: Mapping[str, float] = dataclasses.field(default_factory=dict)
  counts: Mapping[str, int] = dataclasses.field(default_factory=dict)
  cache_hits: int = 0

  @property
  def count(self) -> int:
    return sum(self.counts.values())

  def __sub__(self, before: Compiles) -> Compiles:
    names = [p for p in self.counts if self.counts[p] > before.counts.get(p, 0)]
    return Compiles({p: self.seconds[p] - before.seconds.get(p, 0.0) for p in names},
                    {p: self.counts[p] - before.counts.get(p, 0) for p in names},
                    self.cache_hits - before.cache_hits)

  def metrics(self) -> dict[str, float | int]:
    """``time/compile/PROGRAM`` (seconds), ``compile/count``, ``compile/cache_hits``."""
    return {**{f"time/compile/{p}": s for p, s in sorted(self.seconds.items())},
            "compile/count": self.count, "compile/cache_hits": self.cache_hits}

  def summary(self) -> str:
    """One line: "compiled 42 programs in 28.1 s (step 25.2 s, ...); 0 from the cache"."""
    parts = ", ".join(f"{p} {s:.1f} s" for p, s in sorted(self.seconds.items(),
                                                           key=lambda kv: -kv[1]))
    return (f"compiled {self.count} XLA programs in {sum(self.seconds.values()):.1f} s"
            f"{f' ({parts})' if parts else ''}; {self.cache_hits} read from the persistent cache")


class Recorder:
  """Counts XLA's compiles by program from ``jax.monitoring``'s events (``install`` once). A
  compile belongs to the innermost ``program`` open in the thread that compiles (JAX compiles
  in the calling thread), else to "other"."""

  def __init__(self):
    self._lock = threading.Lock()
    self._local = threading.local()
    self._seconds: dict[str, float] = {}
    self._counts: dict[str, int] = {}
    self._hits = 0
    self._installed = False

  def install(self) -> Recorder:
    """Registers the listeners (once; JAX has no way to remove them)."""
    with self._lock:
      if not self._installed:
        from jax import monitoring  # pylint: disable=import-outside-toplevel
        monitoring.register_event_duration_secs_listener(self._on_duration)
        monitoring.register_event_listener(self._on_event)
        self._installed = True
    return self

  @contextlib.contextmanager
  def program(self, name: str) -> Iterator[None]:
    """Compiles inside belong to program ``name``."""
    stack = self._local.__dict__.setdefault("names", [])
    stack.append(name)
    try:
      yield
    finally:
      stack.pop()

  def _current(self) -> str:
    stack = getattr(self._local, "names", None)
    return stack[-1] if stack else OTHER

  def _on_duration(self, event: str, duration: float, **_) -> None:
    if event == BACKEND_COMPILE:
      name = self._current()
      with self._lock:
        self._seconds[name] = self._seconds.get(name, 0.0) + duration
        self._counts[name] = self._counts.get(name, 0) + 1

  def _on_event(self, event: str, **_) -> None:
    if event == CACHE_HIT:
      with self._lock:
        self._hits += 1

  def snapshot(self) -> Compiles:
    """The totals so far (since ``install``)."""
    with self._lock:
      return Compiles(dict(self._seconds), dict(self._counts), self._hits)


RECORDER = Recorder()
program = RECORDER.program


def without_compiles(row: Mapping) -> dict:
  """A metrics row without its compile keys (``Compiles.metrics``: they differ between a run and
  its resume, which compiles again)."""
  return {k: v for k, v in row.items() if not k.startswith(("compile/", "time/compile/"))}


def start() -> Compiles:
  """Installs the recorder and returns the totals so far (to subtract: ``since``)."""
  return RECORDER.install().snapshot()


def since(before: Compiles) -> Compiles:
  """The compiles since the snapshot ``before``."""
  return RECORDER.snapshot() - before
