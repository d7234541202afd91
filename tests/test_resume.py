"""Resume refuses the wrong run: a rerun of a workdir with another seed, batch size, model or data
stops with an error naming each differing field and the override, and changes nothing; raising
num_iterations, or a change accepted by ``resume_allow_changes``, resumes; a corrupt latest
checkpoint resumes from the previous one with a warning (ppojax/run/resume.py, checkpoint.py).

Only the fixture's run, the run that trains longer and the one that falls back compile the step;
a refused rerun stops before anything compiles.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import warnings

import pytest
from test_step import toy_config

from ppojax.run import build as build_lib
from ppojax.run import reporting, resume, runner
from ppojax.run.checkpoint import Checkpointer, CheckpointWarning

ROOT = pathlib.Path(__file__).parents[1]
RUN = dict(num_iterations=2, save_every=1, keep=2, log_every=1, sample_every=0)
VOLATILE = ("time/", "eps", "memory/", "compile/")  # differ between runs and processes


def _stable(rows):
  return [{k: v for k, v in row.items() if not k.startswith(VOLATILE)} for row in rows]


def _files(workdir: pathlib.Path) -> dict[str, bytes]:
  return {str(p.relative_to(workdir)): p.read_bytes()
          for p in sorted(workdir.rglob("*")) if p.is_file()}


def _metrics(workdir: pathlib.Path) -> list[dict]:
  return reporting.read_metrics(str(workdir / "metrics.jsonl"))


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> pathlib.Path:
  """A finished 2-iteration toy run with checkpoints 1 and 2."""
  workdir = tmp_path_factory.mktemp("finished") / "run"
  runner.run(toy_config(**RUN), str(workdir))
  assert sorted(os.listdir(workdir / "checkpoints")) == ["1", "2"]
  return workdir


@pytest.fixture
def rerun(finished, tmp_path) -> pathlib.Path:
  """A copy of the finished run's workdir to rerun in."""
  return pathlib.Path(shutil.copytree(finished, tmp_path / "run"))


@pytest.mark.parametrize("change, line", [
    ({"seed": 1}, "seed: 0 -> 1"),
    ({"rl.batch_size": 32}, "rl.batch_size: 16 -> 32"),
    ({"model.tiny.hidden_size": 32}, "model.tiny.hidden_size: 64 -> 32"),  # another model
    ({"data.prompt_len": 5}, "data.prompt_len: 6 -> 5"),  # other data
])
def test_a_rerun_with_another_config_is_refused_and_changes_nothing(rerun, change, line):
  before = _files(rerun)
  with pytest.raises(resume.ResumeError) as e:
    runner.run(toy_config(**{**RUN, **change}), str(rerun))
  message = str(e.value)
  assert f"the checkpoint {rerun / 'checkpoints' / '2'} was written by a run with another " \
         "config or data" in message
  assert f"\n  {line}\n" in message
  override = re.search(r"--config\.resume_allow_changes=(\S+)\n", message)
  assert override and line.split(":")[0] in override.group(1).split(",")
  assert "another --workdir" in message and "Nothing in the workdir was changed" in message
  assert _files(rerun) == before  # checkpoints, metrics, config.json: all as they were


def test_raising_num_iterations_resumes_and_saves_the_new_fingerprint(rerun, finished):
  with warnings.catch_warnings():
    warnings.simplefilter("error", resume.ResumeWarning)
    history = runner.run(toy_config(**{**RUN, "num_iterations": 3}), str(rerun)).history
  assert [row["iteration"] for row in history] == [3]
  assert _stable(_metrics(rerun))[:2] == _stable(_metrics(finished))
  with Checkpointer(rerun / "checkpoints", 1, 2) as ckpt:
    assert ckpt.read_meta(3)["fingerprint"]["config"]["num_iterations"] == 3


def test_the_override_accepts_the_named_changes(rerun):
  changed = {**RUN, "seed": 1, "rl.kl_coef": 0.1}
  with pytest.raises(resume.ResumeError) as e:  # accepting only some: the others are named
    runner.run(toy_config(**changed, resume_allow_changes="seed"), str(rerun))
  assert "rl.kl_coef: 0.01 -> 0.1" in str(e.value) and "seed: 0" not in str(e.value)
  assert "--config.resume_allow_changes=data.first_batch,rl.kl_coef,seed" in str(e.value)
  with pytest.warns(resume.ResumeWarning, match=r"resuming from .*checkpoints/2 with changes "
                    r"accepted by resume_allow_changes: data\.first_batch: .*; "
                    r"rl\.kl_coef: 0\.01 -> 0\.1; seed: 0 -> 1"):
    result = runner.run(toy_config(**changed, resume_allow_changes="seed,data, rl"),
                        str(rerun))  # a section ("data", "rl") accepts all of its fields
  assert result.history == []  # resumed at iteration 2 of 2: nothing left to train
  assert json.loads((rerun / "config.json").read_text())["seed"] == 1


def test_a_corrupt_latest_checkpoint_resumes_from_the_previous_one(rerun, finished, capsys):
  """Checkpoint 2's array data truncated: the rerun warns naming it, sets it aside, resumes from
  checkpoint 1 and trains iteration 2 again, exactly as the first time."""
  data = max((rerun / "checkpoints" / "2" / "state" / "d").iterdir(),
             key=lambda p: p.stat().st_size)
  data.write_bytes(data.read_bytes()[:data.stat().st_size // 2])
  with pytest.warns(CheckpointWarning) as warned:
    history = runner.run(toy_config(**RUN), str(rerun)).history
  bad = rerun / "checkpoints" / "2"
  messages = [str(w.message) for w in warned]
  assert any(m.startswith(f"checkpoint {bad} cannot be restored (ValueError: ") for m in messages)
  assert any(f"resuming from step 1: the unreadable checkpoint {bad} is kept as {bad}.corrupt"
             in m for m in messages)
  assert "resumed from" in capsys.readouterr().out
  assert [row["iteration"] for row in history] == [2]
  assert _stable(_metrics(rerun)) == _stable(_metrics(finished))
  assert (rerun / "policy" / "model.safetensors").read_bytes() == (
      finished / "policy" / "model.safetensors").read_bytes()
  assert sorted(os.listdir(rerun / "checkpoints")) == ["1", "2", "2.corrupt"]


def test_an_old_checkpoint_without_a_fingerprint_resumes_with_a_warning(rerun):
  meta = rerun / "checkpoints" / "2" / "meta" / "metadata"
  old = json.loads(meta.read_text())
  del old["fingerprint"]
  meta.write_text(json.dumps(old))
  with pytest.warns(resume.ResumeWarning, match="holds no config fingerprint"):
    runner.run(toy_config(**{**RUN, "seed": 5}), str(rerun))


# ---------------------------------------------------------------------------------------------
# Data files: their contents are fingerprinted, their path is not
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def file_run(char_tokenizer, tmp_path):
  """A file-task config (tiny policy, character tokenizer) and a workdir whose checkpoint 1 and
  metrics are those of its run (written by hand as the runner writes them: nothing compiles)."""
  char_tokenizer.save_pretrained(str(tmp_path / "tokenizer"))
  path = tmp_path / "train.jsonl"
  path.write_text("".join(json.dumps({"prompt": f"{i}+1", "answer": str(i + 1)}) + "\n"
                          for i in range(20)))
  config = toy_config(**{**RUN, "num_iterations": 1, "data.task": "file",
                         "model.tokenizer": str(tmp_path / "tokenizer"), "data.path": str(path),
                         "data.max_prompt_len": 24, "reward.kind": "text",
                         "reward.fn": "ppojax.tasks.arith:reward"})
  r = build_lib.build(config)
  with Checkpointer(tmp_path / "run" / "checkpoints", 1, 2) as ckpt:
    ckpt.save(1, r.state, {"iteration": 1, "data_position": 1, "nonfinite_total": 0,
                           "nonfinite_streak": 0,
                           "fingerprint": resume.fingerprint(config, r.source)})
  (tmp_path / "run" / "metrics.jsonl").write_text(json.dumps(  # what the curves plot reads
      {"step": 1, "objective/scores": 0.0, "objective/kl": 0.0}) + "\n")
  return config, path, tmp_path / "run"


def test_a_data_file_changed_under_the_same_name_is_refused(file_run):
  config, path, workdir = file_run
  path.write_text(path.read_text().replace('"1+1"', '"1+2"'))
  before = _files(workdir)
  with pytest.raises(resume.ResumeError, match=r"\n  data\.contents: [0-9a-f]{16}… -> "
                     r"[0-9a-f]{16}… \(sha256 of data\.path's bytes\)\n"):
    runner.run(config, str(workdir))
  assert _files(workdir) == before


def test_a_data_file_moved_with_the_same_contents_resumes(file_run, tmp_path):
  config, path, workdir = file_run
  moved = config.copy_and_resolve_references()
  moved.data.path = str(shutil.move(path, tmp_path / "elsewhere.jsonl"))
  with warnings.catch_warnings():
    warnings.simplefilter("error", resume.ResumeWarning)
    runner.run(moved, str(workdir))
  assert (workdir / "policy" / "model.safetensors").exists()


# ---------------------------------------------------------------------------------------------
# The comparison itself, and the command line
# ---------------------------------------------------------------------------------------------


def _fingerprint(**fields):
  config = {"seed": 0, "num_iterations": 2, "rl.batch_size": 16, "eval.metrics.score": "f"}
  return {"config": {**config, **fields}, "data": {"data.first_batch": "a" * 64}}


def test_allowed_fields_change_silently_and_unknown_ones_are_warned_about():
  config = toy_config()
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    resume.check({"fingerprint": _fingerprint()},
                 _fingerprint(**{"num_iterations": 9, "eval.metrics.score": "g"}), config, "c")
  assert resume.differences(_fingerprint(), _fingerprint(seed=1)) == [("seed", 0, 1)]
  saved = _fingerprint()
  del saved["config"]["rl.batch_size"]
  with pytest.warns(resume.ResumeWarning, match="only the checkpoint c or only this config "
                    r"knows \(another ppojax version\?\), not compared: rl\.batch_size"):
    resume.check({"fingerprint": saved}, _fingerprint(), config, "c")


def test_the_cli_refuses_with_the_message_and_accepts_the_override(rerun):
  command = [sys.executable, "-m", "ppojax.train", "--config", str(ROOT / "configs" / "toy.py"),
             f"--workdir={rerun}", "--config.rl.batch_size=16", "--config.num_iterations=2",
             "--config.save_every=1", "--config.sample_every=0", "--config.seed=3"]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  refused = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300)
  assert refused.returncode == 2 and "Traceback" not in refused.stderr
  assert "ppojax.train: error: " in refused.stderr and "  seed: 0 -> 3\n" in refused.stderr
  assert "--config.resume_allow_changes=data.first_batch,seed" in refused.stderr
  accepted = subprocess.run(command + ["--config.resume_allow_changes=data.first_batch,seed"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert accepted.returncode == 0, accepted.stderr[-3000:]
  assert "resumed from" in accepted.stdout and "seed: 0 -> 3" in accepted.stderr
