"""Where the suite's time goes, per test: hooks (imported by conftest.py) that add up JAX's own
monitoring events (tracing, lowering to MLIR, XLA's backend compile, persistent-cache reads)
during each test's setup, call and teardown and append one JSON line per test to a file.

    python -m pytest -n 2 --compile-profile runs/compile_profile.jsonl

Each line: the test's node id, its wall seconds, and per event its seconds and count; the
backend compiles also split at 0.5 s (JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS: the shorter
ones are never cached). Under xdist each worker appends its own lines. Sort by
``compile_s`` to find the tests that compile the most; time the rest of ``wall_s`` went to
running programs, Python, subprocesses or I/O (the events of a child process are not counted).
"""

from __future__ import annotations

import collections
import json
import pathlib
import time

import pytest

EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",
    "/jax/compilation_cache/cache_retrieval_time_sec": "cache_read",
}
_totals: collections.Counter = collections.Counter()


def _listen(event: str, duration: float, **_) -> None:
  name = EVENTS.get(event)
  if name is None:
    return
  _totals[f"{name}_s"] += duration
  _totals[f"{name}_n"] += 1
  if name == "compile":
    size = "short" if duration < 0.5 else "long"
    _totals[f"compile_{size}_s"] += duration
    _totals[f"compile_{size}_n"] += 1


def pytest_addoption(parser):
  parser.addoption("--compile-profile", default=None, metavar="PATH",
                   help="append each test's JAX tracing / lowering / compile seconds to PATH "
                        "as JSON lines (tests/compile_profile.py)")


def pytest_configure(config):
  if config.getoption("--compile-profile"):
    from jax._src import monitoring  # pylint: disable=import-outside-toplevel
    monitoring.register_event_duration_secs_listener(_listen)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  del nextitem
  path = item.config.getoption("--compile-profile")
  _totals.clear()
  start = time.perf_counter()
  yield
  if not path:
    return
  row = {"test": item.nodeid, "wall_s": round(time.perf_counter() - start, 3),
         **{k: round(v, 3) if k.endswith("_s") else v for k, v in sorted(_totals.items())}}
  with open(pathlib.Path(path), "a", encoding="utf-8") as f:
    f.write(json.dumps(row) + "\n")
