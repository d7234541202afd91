"""The training CLI end to end: a tiny transformer learns the count task, every output lands in
the workdir, and a run stopped and resumed from its checkpoint equals an uninterrupted run."""

import json
import pathlib
import shutil
import stat
import subprocess
import sys

import jax
import pytest
from conftest import runtime_env
from test_step import toy_config

from ppojax.infra.signals import StopSignals
from ppojax.run import build as build_lib
from ppojax.run import loop_state, reporting, runner

ROOT = pathlib.Path(__file__).parents[1]
VOLATILE = ("time/", "eps", "memory/", "compile/")  # differ between runs and processes


def _stable(rows):
  return [{k: v for k, v in row.items() if not k.startswith(VOLATILE)} for row in rows]


def test_cli_learns_the_count_task_and_writes_its_outputs(tmp_path):
  """Through ``python -m ppojax.train`` with the default config cut to 60 of its 150
  iterations: the mean score rises from ~0.07 (random tiny transformer) to > 0.4 (measured 0.91
  at iteration 60 on 2026-12-01, at XLA's -O0, -O1 and -O3 alike)."""
  command = [sys.executable, "-m", "ppojax.train", "--config", str(ROOT / "configs" / "toy.py"),
             "--workdir", str(tmp_path), "--config.num_iterations=60", "--config.sample_every=30"]
  result = subprocess.run(["bash", "-c", 'umask 027 && exec "$@"', "bash", *command],
                          cwd=ROOT, env=runtime_env(), capture_output=True, text=True,
                          timeout=600)  # 60 iterations: optimised code (conftest)
  assert result.returncode == 0, result.stderr[-3000:]
  out = result.stdout
  assert "batch_size: 128" in out  # the resolved config is printed
  assert "samples at iteration 30" in out and "score" in out
  rows = reporting.read_metrics(str(tmp_path / "metrics.jsonl"))
  first, last = rows[0]["objective/scores"], rows[-1]["objective/scores"]
  assert first < 0.15 and last > 0.4, (first, last)
  assert rows[-1]["step"] == 60 and rows[-1]["episode"] == 60 * 128
  for name in ("objective/kl", "policy/clipfrac_avg", "val/num_stopped", "lr", "eps",
               "time/iteration", "time/train_s", "memory/peak_rss_mb"):
    assert name in rows[-1], name
  assert json.loads((tmp_path / "config.json").read_text())["rl"]["batch_size"] == 128
  for path in ("samples.jsonl", "curves.png", "policy/config.json", "policy/model.safetensors",
               "checkpoints/60", "tensorboard"):
    assert (tmp_path / path).exists(), path
  assert f"score: {first:.3f} -> {last:.3f} (iterations 1-60, logged every 10)" in out
  # What the run writes (orbax's checkpoints aside) has the umask's modes: another user of the
  # group, or a serving process, can read the exported policy (mkstemp/mkdtemp would give 0600).
  for path in tmp_path.rglob("*"):
    if "checkpoints" not in path.relative_to(tmp_path).parts:
      assert stat.S_IMODE(path.stat().st_mode) == (0o750 if path.is_dir() else 0o640), path


def _config():
  return toy_config(num_iterations=6, save_every=2, log_every=1, sample_every=0)


def _read(workdir):
  return reporting.read_metrics(str(pathlib.Path(workdir) / "metrics.jsonl"))


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
  """An uninterrupted run of ``_config()``: (its workdir, its history)."""
  workdir = tmp_path_factory.mktemp("whole")
  return workdir, runner.run(_config(), str(workdir)).history


def test_stopped_and_resumed_run_equals_an_uninterrupted_run(whole, tmp_path):
  workdir, history = whole
  assert runner.run(_config(), str(tmp_path), stop_after=3).history[-1]["iteration"] == 3
  assert not (tmp_path / "policy").exists()  # not finished: no export yet
  resumed = runner.run(_config(), str(tmp_path)).history
  assert resumed[0]["iteration"] == 4
  assert _stable(_read(workdir)) == _stable(_read(tmp_path))
  assert [r["step"] for r in _read(tmp_path)] == [1, 2, 3, 4, 5, 6]
  assert _stable(history)[3:] == _stable(resumed)


def test_resume_from_an_earlier_checkpoint_drops_the_lost_rows(whole, tmp_path):
  """A run that died after iteration 3 with its last checkpoint at 2: the rerun restarts at 3
  and metrics.jsonl holds each iteration once, as in an uninterrupted run."""
  runner.run(_config(), str(tmp_path), stop_after=2)
  with open(tmp_path / "metrics.jsonl", "a") as f:  # iteration 3, never saved
    f.write(json.dumps({"step": 3, "objective/scores": -1.0}) + "\n")
  assert runner.run(_config(), str(tmp_path)).history[0]["iteration"] == 3
  rows = _read(tmp_path)
  assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
  assert _stable(rows) == _stable(_read(whole[0])) and len(whole[1]) == 6


@pytest.mark.parametrize("iterations, end, log_every, said", [
    ([142, 150], 150, 10, "iterations 142-150, logged every 10"),  # resumed, every 10th logged
    ([1], 150, 10, "iteration 1, logged every 10"),  # stopped after 9: 2-9 unlogged
    ([1, 2], 2, 10, "iterations 1-2"),  # every iteration logged
    (list(range(1, 21)), 20, 1, "iterations 1-20")])
def test_the_score_line_says_which_iterations_it_reads(iterations, end, log_every, said):
  rows = [{"iteration": i, "objective/scores": i / 1000} for i in iterations]
  line = reporting.score_line(rows, end, log_every)
  assert line == f"score: {iterations[0] / 1000:.3f} -> {iterations[-1] / 1000:.3f} ({said})"


def test_a_resume_frees_the_initial_state_before_reading_the_checkpoint(whole, tmp_path):
  """Once the checkpoint is this run's, the initial state's buffers go before it is read, as the
  first step's donation takes them in a fresh run (a resumed run held both: one state more for
  its whole length); the reference, a copy, stays. A refused resume leaves them as they were."""
  def opened(config):
    r = build_lib.build(config)
    loop = loop_state.LoopState(r, r.state, StopSignals(), {})
    return r, loop
  workdir = shutil.copytree(whole[0], tmp_path / "run")  # its checkpoint of iteration 6
  r, loop = opened(_config())
  loop.open(workdir)
  loop.close()
  assert loop.start == 6
  initial = jax.tree.leaves(loop_state.saved(r.state))
  assert initial and all(x.is_deleted() for x in initial if not _is_key(x))
  assert not any(x.is_deleted() for x in jax.tree.leaves((loop.state, r.frozen)))
  r, loop = opened(_config().copy_and_resolve_references())
  loop.r.config.seed += 1  # another run's config: refused before any array is read
  with pytest.raises(ValueError, match="seed"):
    loop.open(workdir)
  assert not any(x.is_deleted() for x in jax.tree.leaves(r.state))


def _is_key(x):
  return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__]))
