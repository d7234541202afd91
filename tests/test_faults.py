"""Reliability: bad input fails early with a clear error, and faults lose nothing.

  data      a bad data file fails ``build_lib.build`` naming file, line and field, before anything
            compiles; so do a tokenizer without a chat template and a too-long prompt with
            ``data.truncate="error"``
  models    truncated, corrupt, incomplete or mismatched safetensors and GGUF files: the error
            names the file and the tensor (and the shapes)
  numerics  an iteration with NaN/Inf is skipped (parameters, optimizer states, KL controller and
            step unchanged, the key advanced) and counted; ``rl.max_bad_steps`` in a row stop the
            run with ``NonFiniteError`` after saving a checkpoint that restores and resumes
  signals   SIGTERM / SIGINT stop the CLI after the current iteration with a checkpoint and exit 0;
            a second signal aborts at once; the handlers are restored after ``runner.run``
  SIGKILL   six kills at random moments of one run's life (start-up, compile, iterations,
            checkpoint saves), each followed by a rerun that resumes: no half-written checkpoint
            is ever listed, and metrics.jsonl and the exported policy equal an uninterrupted run's

The CLI runs share a persistent compilation cache (``JAX_COMPILATION_CACHE_DIR``), so only the
first process of a test session compiles.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from test_step import toy_config

from ppojax.data.records import DataError
from ppojax.models import CausalLM, LoadedModel, hf, init_params, load_model, save_model
from ppojax.run import build as build_lib
from ppojax.run import models as run_models
from ppojax.run import held_out, reporting, runner
from ppojax.run.checkpoint import Checkpointer
from ppojax.tasks import count

ROOT = pathlib.Path(__file__).parents[1]
VOLATILE = ("time/", "eps", "memory/", "compile/")  # differ between runs and processes
KILLS = 3  # one in each of the three ways of choosing the moment (test_sigkill_...)
N = 10  # iterations of the CLI runs: the kills must land before a run reaches N (six kills of
# one run here left it at 3 rows: a kill lands before, during or just after one iteration)
CLI = [sys.executable, "-m", "ppojax.train", "--config", str(ROOT / "configs" / "toy.py"),
       f"--config.num_iterations={N}", "--config.save_every=1", "--config.keep=2",
       "--config.rl.batch_size=16", "--config.log_every=1", "--config.sample_every=0"]
TMP = ".orbax-checkpoint-tmp"


def _stable(rows):
  return [{k: v for k, v in row.items() if not k.startswith(VOLATILE)} for row in rows]


def _init(cfg, seed: int):
  """Random parameters of a tiny CausalLM."""
  return init_params(CausalLM(cfg), jax.random.key(seed))


def _rows(workdir) -> list[dict]:
  path = pathlib.Path(workdir) / "metrics.jsonl"
  return reporting.read_metrics(str(path)) if path.exists() else []


# =============================================================================================
# Data: errors at build time, before anything compiles
# =============================================================================================


@pytest.fixture(scope="module")
def text_policy(char_tokenizer, tmp_path_factory):
  """A tiny random policy with the character tokenizer, as a Hugging Face directory (loading
  it compiles nothing), and a copy of the tokenizer without a chat template."""
  tiny = toy_config().model.tiny
  cfg = run_models.tiny_model_config(ml_collections.ConfigDict(
      dict(tiny.to_dict(), vocab_size=len(char_tokenizer))))
  cfg = cfg.replace(bos_token_id=None, eos_token_id=1, pad_token_id=0)
  params = _init(cfg, 0)
  root = tmp_path_factory.mktemp("text_policy")
  policy = save_model(root / "policy", LoadedModel(cfg, jax.device_get(params), char_tokenizer,
                                                   "lm"))
  char_tokenizer.save_pretrained(str(root / "plain"))
  plain = json.loads((root / "plain" / "tokenizer_config.json").read_text())
  plain.pop("chat_template", None)
  (root / "plain" / "tokenizer_config.json").write_text(json.dumps(plain))
  for name in root.joinpath("plain").glob("chat_template.*"):
    name.unlink()
  return policy, root / "plain"


def _file_config(policy, path, **changes):
  return toy_config(**{"model.policy": str(policy), "data.task": "file", "data.path": str(path),
                       "data.max_prompt_len": 24, "reward.kind": "text",
                       "reward.fn": "ppojax.tasks.arith:reward", **changes})


@pytest.fixture
def no_compiling(monkeypatch):
  """Fails the test if anything compiles or the PPO step is built while it is active."""
  compiled = []

  def listener(event, duration, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
      compiled.append(event)

  monkeypatch.setattr(build_lib.step_lib, "make_step",
                      lambda *a, **k: pytest.fail("the PPO step was built"))
  _, _ = jax.random.split(jax.random.key(0))  # what build does first, compiled once per process
  jax.monitoring.register_event_duration_secs_listener(listener)
  yield compiled
  jax.monitoring.unregister_event_duration_listener(listener)
  assert not compiled, f"{len(compiled)} compilations"


@pytest.mark.parametrize("lines, message", [
    (['{"prompt": "1+1"}', '{"prompt": "2+2"', '{"prompt": "3+3"}'],
     r"train\.jsonl:2: not a JSON object"),
    (['{"prompt": "1+1"}', '{"prompt": "2+2"}', '{"question": "3+3"}'],
     r"train\.jsonl:3: record has no field 'prompt' \(fields: 'question'\)"),
    (['{"prompt": "1+1"}', '{"prompt": 7}'],
     r"train\.jsonl:2: field 'prompt' must be a string or a list of chat messages"),
])
def test_a_bad_data_file_fails_build_naming_file_and_line(text_policy, tmp_path, no_compiling,
                                                          lines, message):
  path = tmp_path / "train.jsonl"
  path.write_text("\n".join(lines) + "\n")
  with pytest.raises(DataError, match=message) as e:
    build_lib.build(_file_config(text_policy[0], path))
  assert str(path) in str(e.value)


def test_an_empty_data_file_fails_build(text_policy, tmp_path, no_compiling):
  path = tmp_path / "train.jsonl"
  path.write_text("\n\n")
  with pytest.raises(DataError, match=r"train\.jsonl contains no records"):
    build_lib.build(_file_config(text_policy[0], path))


def test_no_chat_template_and_too_long_prompts_fail_build(text_policy, tmp_path, no_compiling):
  policy, plain = text_policy
  path = tmp_path / "train.jsonl"
  path.write_text("".join(json.dumps({"prompt": f"What is {i} + {i}?"}) + "\n" for i in range(20)))
  with pytest.raises(DataError, match="the tokenizer has no chat template; set "
                     "data.chat_template=False"):
    build_lib.build(_file_config(policy, path, **{"model.tokenizer": str(plain)}))
  with pytest.raises(DataError, match=r"has \d+ tokens, more than the limit of 8"):
    build_lib.build(_file_config(policy, path, **{"data.max_prompt_len": 8,
                                               "data.truncate": "error"}))


# =============================================================================================
# Model files: the error names the file and the tensor
# =============================================================================================


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
  """A tiny Llama policy saved as a Hugging Face directory (one model.safetensors)."""
  cfg = run_models.tiny_model_config(toy_config().model.tiny)
  params = jax.device_get(_init(cfg, 1))
  return save_model(tmp_path_factory.mktemp("tiny_hf") / "model",
                    LoadedModel(cfg, params, None, "lm"))


@pytest.fixture
def model_copy(tiny_hf, tmp_path):
  import shutil  # pylint: disable=import-outside-toplevel
  target = tmp_path / "model"
  shutil.copytree(tiny_hf, target)
  return target


def _edit_tensors(directory, edit):
  from safetensors.numpy import load_file, save_file  # pylint: disable=import-outside-toplevel
  path = directory / "model.safetensors"
  tensors = load_file(str(path))
  edit(tensors)
  save_file(tensors, str(path), metadata={"format": "pt"})
  return path


def test_the_intact_copy_loads(model_copy):
  assert load_model(model_copy).cfg.num_layers == 2


@pytest.mark.parametrize("cut", [1, 100, 0.5])
def test_truncated_safetensors(model_copy, cut):
  path = model_copy / "model.safetensors"
  data = path.read_bytes()
  path.write_bytes(data[:int(len(data) * cut) if isinstance(cut, float) else len(data) - cut])
  with pytest.raises(hf.CheckpointError, match=rf"cannot read .*{path}.*truncated or corrupt"):
    load_model(model_copy)


def test_garbage_header(model_copy):
  path = model_copy / "model.safetensors"
  path.write_bytes(b"\xff" * 8 + b"not a header" * 100)
  with pytest.raises(hf.CheckpointError, match=rf"cannot read .*{path}"):
    load_model(model_copy)


def test_tensor_with_the_wrong_shape_names_tensor_file_and_shapes(model_copy):
  name = "model.layers.1.mlp.up_proj.weight"
  path = _edit_tensors(model_copy, lambda t: t.update({name: t[name][:-8]}))
  with pytest.raises(hf.CheckpointError, match=(
      rf"tensor 'layers\.1\.mlp\.up_proj\.weight' \({name} in {path}\) has shape \(120, 64\), "
      r"but the config implies \(128, 64\)")):
    load_model(model_copy)


def test_missing_tensor_names_tensor_and_file(model_copy):
  path = _edit_tensors(model_copy, lambda t: t.pop("model.layers.0.input_layernorm.weight"))
  with pytest.raises(hf.CheckpointError, match=(
      r"tensor 'layers\.0\.input_layernorm\.weight' is missing from the checkpoint \(no "
      rf"'model\.layers\.0\.input_layernorm\.weight' in {path}\)")):
    load_model(model_copy)


def test_nan_in_a_tensor_names_tensor_and_file(model_copy):
  name = "model.norm.weight"

  def poison(t):
    t[name] = t[name].copy()
    t[name][3] = np.nan
  path = _edit_tensors(model_copy, poison)
  with pytest.raises(hf.CheckpointError,
                     match=rf"tensor '{name}' in {path} holds NaN or Inf values \(1 of 64\)"):
    load_model(model_copy)


def _shard(directory):
  """Splits model.safetensors into two shards with an index, as save_pretrained does."""
  from safetensors.numpy import load_file, save_file  # pylint: disable=import-outside-toplevel
  tensors = load_file(str(directory / "model.safetensors"))
  (directory / "model.safetensors").unlink()
  names = sorted(tensors)
  shards = {"model-00001-of-00002.safetensors": names[::2],
            "model-00002-of-00002.safetensors": names[1::2]}
  for file, part in shards.items():
    save_file({k: tensors[k] for k in part}, str(directory / file), metadata={"format": "pt"})
  weight_map = {k: file for file, part in shards.items() for k in part}
  (directory / "model.safetensors.index.json").write_text(json.dumps(
      {"metadata": {}, "weight_map": weight_map}))
  return weight_map


def test_sharded_checkpoint_faults(model_copy):
  weight_map = _shard(model_copy)
  assert load_model(model_copy).cfg.num_layers == 2  # intact shards load
  index = model_copy / "model.safetensors.index.json"
  moved = dict(weight_map)
  name = sorted(moved)[0]
  moved[name] = "model-00002-of-00002.safetensors"  # the index points to the wrong shard
  index.write_text(json.dumps({"weight_map": moved}))
  with pytest.raises(hf.CheckpointError, match=(
      rf"index\.json places tensor '{name}' in model-00002-of-00002\.safetensors, but it is in "
      r".*model-00001-of-00002\.safetensors")):
    load_model(model_copy)
  index.write_text('{"weight_map": {')
  with pytest.raises(hf.CheckpointError, match=r"index\.json is not a valid safetensors index"):
    load_model(model_copy)
  index.write_text(json.dumps({"weight_map": weight_map}))
  (model_copy / "model-00002-of-00002.safetensors").unlink()
  with pytest.raises(hf.CheckpointError,
                     match=r"shard .*model-00002-of-00002\.safetensors listed in the index is "
                     "missing"):
    load_model(model_copy)


def test_gguf_faults_name_file_and_tensor(tmp_path):
  from test_gguf import _tiny_hf_weights, write_tiny_gguf  # pylint: disable=import-outside-toplevel

  from ppojax.models import gguf as gg  # pylint: disable=import-outside-toplevel

  weights = _tiny_hf_weights(np.random.default_rng(0), True)
  good = write_tiny_gguf(tmp_path / "good.gguf", weights)
  data = good.read_bytes()
  for name, blob in [("cut.gguf", data[:len(data) // 2]), ("tail.gguf", data[:-1]),
                     ("empty.gguf", b"")]:
    (tmp_path / name).write_bytes(blob)
    with pytest.raises(gg.GGUFError, match=rf"{name} is not a readable GGUF file"):
      load_model(tmp_path / name)
  wrong = dict(weights)
  wrong["model.layers.1.mlp.up_proj.weight"] = weights["model.layers.1.mlp.up_proj.weight"][:-32]
  path = write_tiny_gguf(tmp_path / "shape.gguf", wrong)
  with pytest.raises(gg.GGUFError, match=(
      rf"{path}: tensor blk\.1\.ffn_up\.weight \(F16\) has shape \(96, 64\), but the file's "
      r"llama\.\* metadata implies \(128, 64\)")):
    load_model(path)
  poisoned = dict(weights)
  poisoned["model.norm.weight"] = np.full_like(weights["model.norm.weight"], np.inf)
  path = write_tiny_gguf(tmp_path / "inf.gguf", poisoned)
  with pytest.raises(gg.GGUFError, match=rf"{path}: tensor output_norm\.weight \(F32\) holds "
                     "NaN or Inf"):
    load_model(path)


# =============================================================================================
# Numerics: non-finite iterations are skipped, counted, and N in a row stop the run
# =============================================================================================

NAN_AT: set[int] = set()  # reward calls (0-based) that return a NaN score
CALLS = [0]


def flaky_reward(rollout):
  """The count task's reward, with one NaN score in the calls listed in ``NAN_AT``."""
  scores = count.count_reward_numpy(rollout).astype(np.float32)
  if CALLS[0] in NAN_AT:
    scores[3] = np.nan
  CALLS[0] += 1
  return scores


def nan_rule(prompts, prompt_mask, responses, mask):
  """A jnp reward that is +Inf for every sequence."""
  return jnp.full(prompts.shape[:1], jnp.inf)


def _flaky_config(nan_at, **changes):
  NAN_AT.clear()
  NAN_AT.update(nan_at)
  CALLS[0] = 0
  return toy_config(**{"reward.kind": "python", "reward.fn": "test_faults:flaky_reward",
                       "save_every": 1, "keep": 10, "log_every": 1,
                       "sample_every": 0, **changes})


def _same(a, b) -> bool:
  return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("single_pass", [False, True])
def test_a_nonfinite_step_changes_nothing_but_the_key(single_pass):
  """The fused step (a jnp reward that returns Inf): parameters, optimizer states, KL state and
  step stay; the key moves on; the metrics say what was non-finite. Both with minibatches (a
  select after the update) and in the single-pass update (a cond around the optimizer step)."""
  one = {"rl.num_epochs": 1, "rl.num_minibatches": 1} if single_pass else {}
  r = build_lib.build(toy_config(**{"reward.fn": "test_faults:nan_rule", **one}))
  before = jax.device_get(r.state)
  state, metrics, _, _ = runner.iteration(r, r.state, r.source.batch(0).prompts)
  after = jax.device_get(state)
  for field in ("actor", "critic", "actor_opt", "critic_opt", "kl", "step"):
    assert _same(getattr(after, field), getattr(before, field)), field
  assert not np.array_equal(jax.random.key_data(after.key), jax.random.key_data(before.key))
  assert metrics["skipped/nonfinite"] == 1.0 and metrics["nonfinite/scores"] == 1.0
  assert metrics["nonfinite/advantages"] == 1.0


def test_nonfinite_iterations_are_skipped_counted_and_n_in_a_row_stop_the_run(tmp_path):
  """NaN scores at iterations 2-3 (skipped, the run goes on) and 5-7 (three in a row: the run
  saves its last good state, which restores, and stops)."""
  config = _flaky_config({1, 2, 4, 5, 6}, num_iterations=8, **{"rl.max_bad_steps": 3})
  previous = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
  with pytest.raises(runner.NonFiniteError, match=(
      r"3 PPO iterations in a row \(5 to 7\) had non-finite scores, advantages, loss, grad_norm "
      r"and were skipped \(rl\.max_bad_steps=3\); the last good state is saved as checkpoint 7 "
      rf"in {tmp_path / 'checkpoints'}")):
    runner.run(config, str(tmp_path))
  assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == previous
  rows = _rows(tmp_path)
  assert [r["skipped/nonfinite"] for r in rows] == [0, 1, 1, 0, 1, 1, 1]
  assert [r["nonfinite/scores"] for r in rows] == [0, 1, 1, 0, 1, 1, 1]
  assert [r["skipped/nonfinite_total"] for r in rows] == [0, 1, 2, 2, 3, 4, 5]
  assert np.isfinite(rows[3]["loss/policy_avg"]) and np.isnan(rows[4]["loss/policy_avg"])

  target = build_lib.build(config).state
  with Checkpointer(tmp_path / "checkpoints", 1, 10) as ckpt:
    assert ckpt.all_steps() == list(range(1, 8))
    states = {it: ckpt.restore(target, step=it) for it in range(1, 8)}
  meta = {it: m for it, (_, m) in states.items()}
  states = {it: s for it, (s, _) in states.items()}
  trained = lambda s: (s.actor, s.critic, s.actor_opt, s.critic_opt, s.kl, s.step)  # noqa: E731
  for a, b in ((1, 2), (1, 3), (4, 5), (4, 7)):  # skipped: nothing trained ...
    assert _same(trained(states[a]), trained(states[b])), (a, b)
  for a, b in ((1, 2), (2, 3), (5, 6)):  # ... but new samples each time
    assert not _same(states[a].key, states[b].key), (a, b)
  assert not _same(states[3].actor, states[4].actor)  # the good iteration 4 trained
  assert [int(states[i].step) for i in range(1, 8)] == [1, 1, 1, 2, 2, 2, 2]
  assert (meta[7]["nonfinite_total"], meta[7]["nonfinite_streak"]) == (5, 3)



# =============================================================================================
# The CLI under signals and SIGKILL
# =============================================================================================


@pytest.fixture(scope="module")
def cli_env(tmp_path_factory):
  cache = tmp_path_factory.mktemp("jax_cache")
  return dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(cache),
              JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
              JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


class Cli:
  """``python -m ppojax.train`` on the toy config in ``workdir``, output to a log file."""

  def __init__(self, workdir, env, log):
    self.log = pathlib.Path(log)
    with open(self.log, "w") as out:
      self.proc = subprocess.Popen(CLI + [f"--workdir={workdir}"], cwd=ROOT, env=env,
                                   stdout=out, stderr=subprocess.STDOUT)
    self.started = time.monotonic()

  def text(self) -> str:
    return self.log.read_text(errors="replace")

  def iterations(self) -> int:
    """Iterations this process has finished (its progress-bar lines)."""
    return len(re.findall(rf"\s\d+/{N}\s", self.text()))

  def wait_for(self, ready, timeout=240.0, poll=0.01) -> bool:
    """Polls ``ready()`` until true (True) or the process ends (False)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
      if ready():
        return True
      if self.proc.poll() is not None:
        return bool(ready())
      time.sleep(poll)
    pytest.fail(f"timed out; log:\n{self.text()[-3000:]}")

  def finish(self, timeout=240) -> int:
    try:
      return self.proc.wait(timeout=timeout)
    finally:
      if self.proc.poll() is None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def reference(cli_env, tmp_path_factory):
  """An uninterrupted CLI run: its metrics rows and exported policy weights."""
  work = tmp_path_factory.mktemp("reference")
  cli = Cli(work / "run", cli_env, work / "log.txt")
  assert cli.finish() == 0, cli.text()[-3000:]
  rows = _rows(work / "run")
  assert [r["step"] for r in rows] == list(range(1, N + 1))
  return _stable(rows), (work / "run" / "policy" / "model.safetensors").read_bytes()


def _assert_equals_reference(workdir, reference):
  rows, weights = reference
  got = _stable(_rows(workdir))
  assert [r["step"] for r in got] == list(range(1, N + 1))
  for want, row in zip(rows, got):
    assert row == want, row["step"]
  assert (pathlib.Path(workdir) / "policy" / "model.safetensors").read_bytes() == weights


def _checkpoint_dir_is_sound(ckpts: pathlib.Path) -> list[int]:
  """Every listed step directory is a complete checkpoint; returns the steps."""
  steps = sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit()) if ckpts.exists() \
      else []
  for step in steps:
    for marker in ("_CHECKPOINT_METADATA", "commit_success.txt", "state", "meta", "manifest"):
      assert (ckpts / str(step) / marker).exists(), (step, marker)
  return steps


def _latest(ckpts: pathlib.Path) -> int | None:
  with Checkpointer(ckpts, 1, 2) as ckpt:
    return ckpt.latest_step()


def _leftovers(ckpts: pathlib.Path) -> list[str]:
  return sorted(p.name for p in ckpts.iterdir() if TMP in p.name or p.name == ".deleted") \
      if ckpts.exists() else []


def test_sigkill_at_random_moments_loses_nothing(cli_env, reference, tmp_path):
  """Three SIGKILLs (KILLS), each of a fresh process resuming the same workdir, at moments
  drawn from a seeded RNG in three ways by turns: a random time after start (start-up,
  compile, first iterations), a random time after the next iteration's metrics row (inside an
  iteration or its checkpoint save), and the moment a checkpoint's tmp directory appears (in
  the middle of a save); more, by turns, until one has landed in the middle of a save. Then one
  rerun to the end equals the uninterrupted run."""
  work, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
  rng = np.random.default_rng(20240611)
  kills, mid_save, first_row_after = [], 0, []  # first_row_after: seconds start → iteration
  attempt = 0
  while len(kills) < KILLS or not mid_save:
    attempt += 1
    assert attempt <= 4 * KILLS, (
        f"{attempt - 1} attempts: kills {kills}, {mid_save} of them mid-save")
    rows_before = len(_rows(work))
    stale = set(_leftovers(ckpts))  # what earlier kills left: removed when the run starts
    cli = Cli(work, cli_env, tmp_path / f"log{attempt}.txt")
    mode = ("time", "row", "save")[attempt % 3]
    if mode == "time":  # start-up, compile, the first iterations
      span = (np.median(first_row_after) if first_row_after else 8.0) + 0.5
      delay = rng.uniform(0.0, span)
      cli.wait_for(lambda: time.monotonic() - cli.started >= delay)  # noqa: B023
    elif mode == "row":  # inside the next iteration or its checkpoint save
      if cli.wait_for(lambda: cli.iterations() > 0):  # noqa: B023
        first_row_after.append(time.monotonic() - cli.started)
      time.sleep(rng.uniform(0.0, 0.3))
    else:
      cli.wait_for(lambda: not stale & set(_leftovers(ckpts)), poll=0.001)  # noqa: B023
      cli.wait_for(lambda: any(TMP in n for n in _leftovers(ckpts)), poll=0.001)  # noqa: B023
    if cli.proc.poll() is None:
      cli.proc.send_signal(signal.SIGKILL)
      assert cli.finish() == -signal.SIGKILL
      leftovers = _leftovers(ckpts)
      mid_save += mode == "save" and any(TMP in n for n in leftovers)
      kills.append((mode, round(time.monotonic() - cli.started, 2), rows_before,
                    len(_rows(work)), leftovers))
    else:
      assert cli.finish() == 0, cli.text()[-3000:]
    steps = _checkpoint_dir_is_sound(ckpts)
    assert not steps or len(_rows(work)) >= steps[-1]
  print("kills (mode, seconds after start, rows before, rows after, leftovers):",
        *kills, sep="\n  ")
  assert mid_save >= 1, kills  # at least one kill landed in the middle of a checkpoint save
  cli = Cli(work, cli_env, tmp_path / "log_final.txt")
  assert cli.finish() == 0, cli.text()[-3000:]
  assert _leftovers(ckpts) == []  # the rerun removed what the kills left behind
  _assert_equals_reference(work, reference)


def test_sigterm_and_sigint_stop_after_the_iteration_with_a_checkpoint(cli_env, reference,
                                                                        tmp_path):
  work, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
  stopped = 0
  for sig, at in ((signal.SIGTERM, 2), (signal.SIGINT, 5)):
    at = max(at, stopped + 1)
    cli = Cli(work, cli_env, tmp_path / f"log_{sig.name}.txt")
    cli.wait_for(lambda: len(_rows(work)) >= at)  # noqa: B023
    cli.proc.send_signal(sig)
    assert cli.finish() == 0, cli.text()[-3000:]  # a clean exit
    text = cli.text()
    assert f"{sig.name}: stopping after the current iteration" in text
    line = next(ln for ln in text.splitlines() if ln.startswith(f"stopped by {sig.name}"))
    it = int(line.split("after iteration ")[1].split(";")[0])
    assert at <= it < N and stopped < it
    assert f"checkpoint {it} saved: run the same command again to resume" in line
    assert _latest(ckpts) == it == len(_rows(work))
    assert not (work / "policy").exists()  # not finished
    stopped = it
  # A second signal aborts at once, here while the run is still being built (the first one
  # would have let it stop before its first iteration), without a checkpoint.
  cli = Cli(work, cli_env, tmp_path / "log_abort.txt")
  cli.wait_for(lambda: "wandb_project:" in cli.text())  # the config is printed, run() starts
  time.sleep(0.3)
  cli.proc.send_signal(signal.SIGINT)
  cli.wait_for(lambda: "SIGINT: stopping after the current iteration" in cli.text())
  cli.proc.send_signal(signal.SIGINT)
  assert cli.finish(timeout=30) == 128 + signal.SIGINT, cli.text()[-3000:]
  assert "SIGINT again: aborting now" in cli.text()
  assert _latest(ckpts) == stopped
  cli = Cli(work, cli_env, tmp_path / "log_final.txt")
  assert cli.finish() == 0, cli.text()[-3000:]
  _assert_equals_reference(work, reference)
  # Killed after its last checkpoint but before the export: a rerun only exports.
  for name in ("policy", "curves.png"):
    (work / name).rename(tmp_path / name)
  cli = Cli(work, cli_env, tmp_path / "log_export.txt")
  assert cli.finish() == 0, cli.text()[-3000:]
  assert f"resumed from {ckpts} at iteration {N}" in cli.text()
  _assert_equals_reference(work, reference)
  assert (work / "curves.png").exists()


def test_a_cut_short_evaluation_is_redone_once(tmp_path):
  """A held-out evaluation writes its metrics row, then eval.json (its commit); a run killed
  in between evaluates again on resume, and the stale row goes first."""
  path = tmp_path / "metrics.jsonl"
  rows = [{"step": 0, "eval/score": 0.1}, {"step": 1, "objective/kl": 0.0},
          {"step": 2, "objective/kl": 0.1}, {"step": 2, "eval/score": 0.5}]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  held_out.drop_eval_rows(path, [2])
  assert _rows(tmp_path) == rows[:3]
  held_out.drop_eval_rows(path, [0])
  assert _rows(tmp_path) == rows[1:3]


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-v", "-s"]))
