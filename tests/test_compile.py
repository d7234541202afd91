"""Compiling as a measured, bounded cost (``ppojax.infra.compile``): compiles counted and timed
by program, a training run's rows and summary, no recompiles at fixed shapes, the persistent
cache across processes, and a start on the CPU without libtpu's TPU probing."""

import os
import pathlib
import re
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_step import toy_config

from ppojax.infra import compile as compile_lib
from ppojax.run import reporting, runner

ROOT = pathlib.Path(__file__).parents[1]
# the toy config made quicker to compile: one epoch of one minibatch, three new tokens
QUICK = {"rl.num_epochs": 1, "rl.num_minibatches": 1, "sampling.max_new_tokens": 3}
SUMMARY = re.compile(r"compiled (\d+) XLA programs in ([\d.]+) s.*; (\d+) read from the "
                     r"persistent cache")


def test_the_recorder_counts_and_names_compiles():
  """One jitted function at two shapes is two compiles of its program; a call at a shape seen
  before is none; a compile outside every ``program`` (here in another thread) is "other"."""
  f = jax.jit(lambda x: jnp.tanh(x) * 3.0 + x.sum())
  a, b = np.ones(3, np.float32), np.ones((2, 5), np.float32)
  before = compile_lib.start()
  with compile_lib.program("tiny"):
    f(a).block_until_ready()
    f(b).block_until_ready()
    f(a).block_until_ready()  # in memory already
  thread = threading.Thread(target=lambda: jax.jit(lambda x: x * 7.0 - 1.0)(a).block_until_ready())
  thread.start()
  thread.join()
  got = compile_lib.since(before)
  assert got.counts == {"tiny": 2, "other": 1}, got
  assert got.seconds["tiny"] > 0 and got.count == 3
  metrics = got.metrics()
  assert metrics["compile/count"] == 3 and metrics["time/compile/tiny"] == got.seconds["tiny"]
  assert "compile/cache_hits" in metrics
  assert SUMMARY.search(got.summary()) and "tiny" in got.summary()
  assert compile_lib.since(compile_lib.start()).count == 0


def test_the_cache_directory_comes_from_the_flag_then_the_environment(tmp_path):
  home = {"XDG_CACHE_HOME": str(tmp_path)}
  assert compile_lib.cache_dir(None, home) == str(tmp_path / "ppojax" / "xla")
  jax_dir = {**home, "JAX_COMPILATION_CACHE_DIR": "/j"}
  assert compile_lib.cache_dir(None, jax_dir) == "/j"
  assert compile_lib.cache_dir(None, {**jax_dir, "PPOJAX_COMPILE_CACHE": "/p"}) == "/p"
  assert compile_lib.cache_dir(None, {**jax_dir, "PPOJAX_COMPILE_CACHE": "off"}) is None
  assert compile_lib.cache_dir("/f", {**jax_dir, "PPOJAX_COMPILE_CACHE": "/p"}) == "/f"
  assert compile_lib.cache_dir("OFF", {**jax_dir, "PPOJAX_COMPILE_CACHE": "/p"}) is None


def test_a_run_reports_its_compiles_and_compiles_nothing_after_the_first_iteration(
    tmp_path, capsys):
  config = toy_config(num_iterations=3, log_every=1, sample_every=0, **QUICK)
  history = runner.run(config, str(tmp_path)).history
  rows = reporting.read_metrics(str(tmp_path / "metrics.jsonl"))
  assert [r["step"] for r in rows] == [1, 2, 3] and len(history) == 3
  for row in rows:
    assert row["time/compile/step"] > 0 and row["time/compile/build"] > 0, row
    assert row["compile/count"] >= 2 and "compile/cache_hits" in row
  # fixed shapes: the step compiled once, in the first iteration, and nothing since
  assert [r["compile/count"] for r in rows] == [rows[0]["compile/count"]] * 3
  assert [r["time/compile/step"] for r in rows] == [rows[0]["time/compile/step"]] * 3
  summary = SUMMARY.search(capsys.readouterr().out)
  assert summary and int(summary.group(1)) >= rows[-1]["compile/count"], summary


def _train(workdir: pathlib.Path, cache: pathlib.Path) -> tuple[int, float, int]:
  """A one-iteration toy run in a fresh process: its summary's (count, seconds, cache hits)."""
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("JAX_PERSISTENT_CACHE_MIN", "PPOJAX_COMPILE_CACHE"))}
  command = [sys.executable, "-m", "ppojax.train", "--config", str(ROOT / "configs" / "toy.py"),
             "--config.num_iterations=1", "--config.rl.batch_size=16", "--config.sample_every=0",
             *(f"--config.{k}={v}" for k, v in QUICK.items()), f"--compile_cache={cache}",
             "--workdir", str(workdir)]
  result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  found = SUMMARY.search(result.stdout)
  assert found, result.stdout[-2000:]
  return int(found.group(1)), float(found.group(2)), int(found.group(3))


def test_a_second_run_reads_every_program_from_the_persistent_cache(tmp_path):
  cache = tmp_path / "cache"
  count, _, hits = _train(tmp_path / "first", cache)
  assert count > 0 and hits == 0 and any(cache.iterdir())
  again, _, hits = _train(tmp_path / "second", cache)
  assert again == count and hits == count, (count, again, hits)
  rows = reporting.read_metrics(str(tmp_path / "second" / "metrics.jsonl"))
  assert rows[-1]["compile/cache_hits"] == rows[-1]["compile/count"] > 0


def test_platforms_without_a_tpu_leave_the_tpu_out():
  if compile_lib.tpu_attached() or not compile_lib.libtpu_installed():
    assert compile_lib.choose_platforms({}) is None  # nothing probes, or a TPU is here
    return
  environ = {}
  chosen = compile_lib.choose_platforms(environ)
  assert chosen == environ["JAX_PLATFORMS"] and chosen.split(",")[-1] == "cpu"
  assert "tpu" not in chosen
  assert compile_lib.choose_platforms({"JAX_PLATFORMS": ""}) is None  # the user's choice


def test_a_start_without_jax_platforms_prints_no_tpu_errors():
  """With libtpu installed and no TPU attached, importing ppojax and starting JAX says nothing
  of TPUs on stderr (``choose_platforms``)."""
  if compile_lib.tpu_attached():
    pytest.skip("a TPU is attached here: JAX is right to start it")
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  script = ("import os, ppojax, jax; print(os.environ['JAX_PLATFORMS'], "
            "jax.numpy.ones(2).sum(), jax.devices()[0].platform)")
  result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  noise = [line for line in result.stderr.splitlines() if re.search("tpu", line, re.IGNORECASE)]
  assert not noise, noise
  assert result.stdout.split()[-1] in ("cpu", "gpu")
