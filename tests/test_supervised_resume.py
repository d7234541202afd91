"""SFT and reward-model training checkpoint and resume as the PPO run does
(ppojax/supervised/loop.py ``fit``, ppojax/run/resume.py): a run stopped in the middle, or
SIGKILLed on the command line (in the middle of a checkpoint save after a number of steps drawn
at random for each run), resumes from its latest complete checkpoint and ends with the
metrics.jsonl rows and the exported weights of an uninterrupted run, byte for byte; a corrupt latest checkpoint falls back
to the one before; a rerun with another config or training data is refused and changes nothing.

Each stage's uninterrupted run is made once (a module fixture); the configs come from
``supervised_defaults()`` with the tiny model of tests/test_supervised.py.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
from test_supervised import (
  ROOT,
  TINY,
  _config,
  preference_records,
  sft_records,
  tokenizer_dir,  # noqa: F401  (tokenizer_dir: a fixture)
)

from ppojax.data import records as records_lib
from ppojax.infra import compile as compile_lib
from ppojax.run import reporting, resume
from ppojax.run.checkpoint import CheckpointWarning
from ppojax.supervised import sft, train_rm

STAGES = {  # stage: (module, records, exported directory, command)
    "sft": (sft, sft_records, "policy", "ppojax.supervised.sft"),
    "rm": (train_rm, preference_records, "reward_model", "ppojax.supervised.train_rm"),
}
STEPS = 12  # 48 rows, batches of 8, 2 epochs
SAVING = '  c.save_every = 1\n  c.keep = 2\n  c.resume_allow_changes = ""\n'
RUN = dict(n_train=48, n_eval=9, extra=SAVING, train__batch_size=8, train__num_epochs=2.0,
           train__eval_every=4)
TMP = ".orbax-checkpoint-tmp"


def _stage_config(stage: str, tokenizer, tmp_path, **overrides):
  return _config(None, tokenizer, tmp_path, STAGES[stage][1], **{**RUN, **overrides})


def _rows(workdir: pathlib.Path) -> list[dict]:
  return [compile_lib.without_compiles(row)
          for row in reporting.read_metrics(str(workdir / "metrics.jsonl"))]


def _weights(workdir: pathlib.Path, stage: str) -> bytes:
  return (workdir / STAGES[stage][2] / "model.safetensors").read_bytes()


def _files(workdir: pathlib.Path) -> dict[str, bytes]:
  return {str(p.relative_to(workdir)): p.read_bytes()
          for p in sorted(workdir.rglob("*")) if p.is_file()}


def _steps(workdir: pathlib.Path) -> list[int]:
  ckpts = workdir / "checkpoints"
  return sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit()) if ckpts.exists() \
      else []


@pytest.fixture(scope="module", params=list(STAGES))
def reference(request, tokenizer_dir, tmp_path_factory):  # noqa: F811
  """(stage, its data directory, the workdir of an uninterrupted run, its Result)."""
  stage = request.param
  where = tmp_path_factory.mktemp(stage)
  result = STAGES[stage][0].run(_stage_config(stage, tokenizer_dir, where), where / "run")
  assert result.finished and [r["step"] for r in _rows(where / "run")] == list(range(STEPS + 1))
  return stage, where, where / "run", result


def test_a_run_stopped_in_the_middle_resumes_to_the_uninterrupted_result(reference,
                                                                         tokenizer_dir):  # noqa: F811
  stage, where, done, want = reference
  module, config = STAGES[stage][0], _stage_config(stage, tokenizer_dir, where)
  work = where / "stopped"
  stopped = module.run(config, work, stop_after=5)
  assert not stopped.finished and stopped.after == {}
  assert _steps(work) == [4, 5] and not (work / STAGES[stage][2]).exists()
  assert [r["step"] for r in _rows(work)] == [0, 1, 2, 3, 4, 5]
  result = module.run(config, work)
  assert result.finished and result.history == want.history
  assert (result.before, result.after) == (want.before, want.after)
  assert _rows(work) == _rows(done)
  assert _weights(work, stage) == _weights(done, stage)
  assert _steps(work) == [11, 12]


@pytest.mark.parametrize("reference", ["rm"], indirect=True)  # the loop is fit's, as for sft
def test_a_corrupt_latest_checkpoint_falls_back_to_the_one_before(reference,
                                                                   tokenizer_dir):  # noqa: F811
  stage, where, done, _ = reference
  module, config = STAGES[stage][0], _stage_config(stage, tokenizer_dir, where)
  work = where / "corrupt"
  module.run(config, work, stop_after=6)
  data_file = max((work / "checkpoints" / "6" / "state" / "d").iterdir(),
                  key=lambda p: p.stat().st_size)
  data_file.write_bytes(data_file.read_bytes()[:data_file.stat().st_size // 2])
  with pytest.warns(CheckpointWarning) as warned:
    module.run(config, work)
  bad = work / "checkpoints" / "6"
  messages = [str(w.message) for w in warned]
  assert any(m.startswith(f"checkpoint {bad} cannot be restored (ValueError: ") for m in messages)
  assert f"resuming from step 5: the unreadable checkpoint {bad} is kept as {bad}.corrupt" \
      in messages
  assert _rows(work) == _rows(done) and _weights(work, stage) == _weights(done, stage)
  assert sorted(os.listdir(work / "checkpoints")) == ["11", "12", "6.corrupt"]


def test_a_rerun_with_another_config_or_data_is_refused_and_changes_nothing(
    reference, tokenizer_dir, tmp_path):  # noqa: F811
  stage, where, done, _ = reference
  module = STAGES[stage][0]
  work = pathlib.Path(shutil.copytree(done, tmp_path / "run"))
  before = _files(work)
  with pytest.raises(resume.ResumeError, match=r"\n  seed: 0 -> 1\n"):
    module.run(_stage_config(stage, tokenizer_dir, where, seed=1), work)
  other = tmp_path / "data"  # other training rows under the same config
  other.mkdir()
  config = _stage_config(stage, tokenizer_dir, other)
  records_lib.write_jsonl(STAGES[stage][1](7, 48), config.data.train)
  with pytest.raises(resume.ResumeError, match=r"\n  data\.train_rows: [0-9a-f]{16}… -> "
                     r"[0-9a-f]{16}… \(sha256 of the encoded training rows\)\n"):
    module.run(config, work)
  assert _files(work) == before
  # allowed: another data path with the same rows, evaluating more often (nothing to train)
  moved = tmp_path / "moved.jsonl"
  shutil.copy(where / "train.jsonl", moved)
  config = _stage_config(stage, tokenizer_dir, where, train__eval_every=2)
  config.data.train = str(moved)
  with warnings.catch_warnings():
    warnings.simplefilter("error", resume.ResumeWarning)
    result = module.run(config, work)
  assert result.finished and _weights(work, stage) == _weights(done, stage)


# ---------------------------------------------------------------------------------------------
# The command line, SIGKILLed
# ---------------------------------------------------------------------------------------------


def _cli(stage: str, tokenizer, where: pathlib.Path, workdir: pathlib.Path, env, log):
  """``python -m ppojax.sft`` / ``ppojax.supervised.train_rm`` with the reference's config, its output to
  ``log``."""
  config = where / "defaults.py"  # written by _stage_config: supervised_defaults() + SAVING
  flags = {**TINY, **{k: v for k, v in RUN.items() if "__" in k},
           "model__tokenizer": tokenizer, "data__train": where / "train.jsonl",
           "data__eval": where / "eval.jsonl"}
  command = [sys.executable, "-m", STAGES[stage][3], "--config", str(config),
             f"--workdir={workdir}"]
  command += [f"--config.{k.replace('__', '.')}={v}" for k, v in flags.items()]
  with open(log, "w") as out:
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def _wait(proc, ready, timeout=300.0) -> bool:
  """Polls ``ready()`` every millisecond until true (True) or the process ends (False)."""
  end = time.monotonic() + timeout
  while time.monotonic() < end:
    if ready():
      return True
    if proc.poll() is not None:
      return False
    time.sleep(0.001)
  proc.kill()
  pytest.fail("timed out")


@pytest.mark.parametrize("reference", ["sft"], indirect=True)  # the loop is fit's, as for rm
def test_sigkill_in_the_middle_loses_nothing(reference, tokenizer_dir, tmp_path):  # noqa: F811
  """A kill in the middle of a checkpoint save after a number of steps drawn at random for each
  run (2 to 5; named in every failure message), with the step's metrics row written and its
  checkpoint not; the rerun removes what the kill left, drops the row and ends with the
  uninterrupted run's metrics and weights."""
  stage, where, done, _ = reference
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(where / "cache"),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  work = tmp_path / "run"
  ckpts = work / "checkpoints"
  after = int(np.random.default_rng().integers(2, 6))  # the kill: in a save from this step on
  drawn = f"the kill from step {after} on (drawn for this run)"

  def leftovers() -> list[str]:
    return [n for n in os.listdir(ckpts) if TMP in n] if ckpts.exists() else []

  log = tmp_path / "log_killed.txt"
  proc = _cli(stage, tokenizer_dir, where, work, env, log)
  assert _wait(proc, lambda: (work / "metrics.jsonl").exists() and len(_rows(work)) > after), \
      (drawn, log.read_text()[-3000:])
  assert _wait(proc, lambda: bool(leftovers())), (drawn, log.read_text()[-3000:])
  proc.send_signal(signal.SIGKILL)
  assert proc.wait(timeout=60) == -signal.SIGKILL, drawn
  steps, rows, cut_short = _steps(work), len(_rows(work)), leftovers()
  assert cut_short and steps and after - 1 <= steps[-1] < STEPS - 1, (drawn, steps, cut_short)
  assert rows == steps[-1] + 2, (drawn, rows)  # steps 0 … latest + the row of the step saved
  log = tmp_path / "log_final.txt"
  proc = _cli(stage, tokenizer_dir, where, work, env, log)
  assert proc.wait(timeout=300) == 0, (drawn, log.read_text()[-3000:])
  assert f"resumed from {ckpts} at step {steps[-1]}" in log.read_text(), drawn
  assert leftovers() == [], drawn
  assert _rows(work) == _rows(done), drawn
  assert _weights(work, stage) == _weights(done, stage), drawn
