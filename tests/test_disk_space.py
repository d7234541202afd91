"""A full disk: the start-of-run warning that a run's checkpoints and export may not fit, and
the one clear error (``files.DiskFullError``) a save or the export raises when they do not,
leaving no partial directory behind."""

import asyncio
import errno
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import logging as absl_logging
from ml_collections import ConfigDict

from ppojax.infra import cli, files
from ppojax.learner.state import TrainState
from ppojax.models import CausalLM, ModelConfig, hf, init_params
from ppojax.run import checkpoint, loop_state


def _brute_saves(start, iterations, save_every):
  return sum(1 for it in range(start + 1, iterations + 1)
             if it % save_every == 0 or it == iterations)


@pytest.mark.parametrize("iterations", [1, 2, 7, 50, 101])
@pytest.mark.parametrize("save_every", [1, 2, 3, 50])
def test_saves_left_counts_every_due_iteration_and_the_last(iterations, save_every):
  for start in range(iterations + 1):
    assert checkpoint.saves_left(start, iterations, save_every) == _brute_saves(
        start, iterations, save_every)


def _state(base=None):
  mb = np.zeros(250_000, np.float32)  # 1 MB
  return TrainState(actor={"w": mb}, critic={"w": mb}, actor_opt=(mb, mb), critic_opt=(mb, mb),
                    kl=np.zeros((), np.float32), step=np.zeros((), np.int32),
                    key=np.zeros(2, np.uint32), base=base)


def _config(iterations=2, save_every=1, keep=2):
  return ConfigDict({"num_iterations": iterations, "save_every": save_every, "keep": keep})


def test_no_warning_when_the_checkpoints_and_the_export_fit():
  # 2 saves of ~6 MB each (keep 2: both stay) and a 1 MB policy: ~13 MB
  assert loop_state.disk_warning(_state(), _config(), 0, 0, free=14_000_000) is None


def test_warns_with_the_numbers_and_the_remedies():
  warning = loop_state.disk_warning(_state(), _config(), 0, 0, free=12_000_000)
  assert "12.0 MB free" in warning and "may write 13.0 MB" in warning
  assert "2 checkpoint(s) of up to 6.0 MB" in warning and "exported model (1.0 MB)" in warning
  assert "--config.keep" in warning and "--config.save_every" in warning


def test_one_checkpoint_more_than_keep_at_most_while_saving():
  # 10 saves, keep 2: the third is written before the first goes, so 3 at the peak
  need_3 = 3 * 6_000_016 + 1_000_000
  config = _config(iterations=10)
  assert loop_state.disk_warning(_state(), config, 0, 0, free=need_3) is None
  assert loop_state.disk_warning(_state(), config, 0, 0, free=need_3 - 1) is not None


def test_held_checkpoints_and_a_finished_run_count():
  config = _config(iterations=10)
  # 2 held, 5 saves left: the peak adds one checkpoint and the export
  assert loop_state.disk_warning(_state(), config, 5, 2, free=7_000_024) is None
  assert loop_state.disk_warning(_state(), config, 5, 2, free=7_000_015) is not None
  assert loop_state.disk_warning(_state(), config, 10, 2, free=0) is None  # nothing left to do


def test_lora_exports_the_merged_base():
  base = {"w": np.zeros(2_500_000, np.float32)}  # 10 MB, not checkpointed
  state = _state(base=base)
  assert loop_state.disk_warning(state, _config(), 0, 0, free=2 * 6_000_016 + 10_000_000) is None
  assert loop_state.disk_warning(state, _config(), 0, 0, free=2 * 6_000_016 + 9_999_999)


FULL = "Failed to write 294377 bytes to file 23: No space left on device [os_error_code='28']"


def test_a_full_disk_is_recognised_through_wrapping_errors():
  assert files.is_disk_full(OSError(errno.ENOSPC, "no room"))
  assert files.is_disk_full(ValueError(f"RESOURCE_EXHAUSTED: {FULL}"))
  try:
    try:
      raise OSError(errno.ENOSPC, "no room")
    except OSError as inner:
      raise RuntimeError("saving failed") from inner
  except RuntimeError as outer:
    assert files.is_disk_full(outer)
  assert not files.is_disk_full(OSError(errno.EACCES, "Permission denied"))
  assert not files.is_disk_full(ValueError("shape mismatch"))


def _full_disk_save(directory):
  """An orbax save that leaves a partial step directory and fails as tensorstore does."""
  def save(step, *args, **kwargs):
    del args, kwargs
    os.makedirs(os.path.join(directory, f"{step}.orbax-checkpoint-tmp", "state"))
    raise ValueError(f"RESOURCE_EXHAUSTED: Error writing in OCDBT database: {FULL}")
  return save


def test_a_save_on_a_full_disk_is_one_error_and_leaves_no_partial_step(tmp_path, monkeypatch):
  state = {"w": jnp.ones(4), "step": jnp.zeros((), jnp.int32)}
  with checkpoint.Checkpointer(tmp_path / "ckpt", save_every=1, keep=2) as ckpt:
    assert ckpt.save(1, state)
    manager = ckpt._manager  # pylint: disable=protected-access
    monkeypatch.setattr(manager, "save", _full_disk_save(ckpt.directory))
    with pytest.raises(files.DiskFullError, match="checkpoint of step 2") as raised:
      ckpt.save(2, state)
    message = str(raised.value)
    assert "free" in message and "--config.keep" in message and "resumes from step 1" in message
    assert raised.value.errno == errno.ENOSPC
    assert sorted(os.listdir(ckpt.directory)) == ["1"]  # the partial step 2 removed
    assert ckpt.latest_step() == 1
  assert "ppojax.infra.files:DiskFullError" in cli.INPUT_ERRORS  # one message at the CLI


class _LateCallback:
  """Dies as a tensorstore write's callback does after orbax gave up on the save: its call into
  the closed event loop raises where nothing catches it (``sys.unraisablehook``)."""

  def __del__(self):
    loop = asyncio.new_event_loop()
    loop.close()
    loop.call_soon_threadsafe(print)


def _noisy_save(error):
  def save(step, *args, **kwargs):
    del step, args, kwargs
    absl_logging.error("_SignalingThread.run() raised an exception: %s", error)
    _LateCallback()
    raise ValueError(f"RESOURCE_EXHAUSTED: {error}")
  return save


def test_a_full_disk_is_one_message_without_the_writer_threads_tracebacks(
    tmp_path, monkeypatch, caplog):
  """orbax's threads log an error each and tensorstore's leftover writes die on the closed
  event loop (~250 lines on the toy's CLI before the one-line error): a full disk drops them,
  also those that come after the save gave up."""
  unraisable = []  # what would be printed (pytest's own hook turns them into warnings)
  monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
  with checkpoint.Checkpointer(tmp_path / "ckpt", save_every=1, keep=2) as ckpt:
    monkeypatch.setattr(ckpt._manager, "save", _noisy_save(FULL))  # pylint: disable=protected-access
    with pytest.raises(files.DiskFullError):
      ckpt.save(1, {"w": jnp.ones(4)})
    _LateCallback()
  assert not [r for r in caplog.records if "_SignalingThread" in r.getMessage()]
  assert not unraisable


def test_another_failure_shows_what_orbax_logged(tmp_path, monkeypatch, caplog):
  unraisable = []
  monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
  with checkpoint.Checkpointer(tmp_path / "ckpt", save_every=1, keep=2) as ckpt:
    monkeypatch.setattr(ckpt._manager, "save", _noisy_save("shape mismatch"))  # pylint: disable=protected-access
    with pytest.raises(ValueError, match="shape mismatch"):
      ckpt.save(1, {"w": jnp.ones(4)})
    _LateCallback()
  assert [r for r in caplog.records if "_SignalingThread" in r.getMessage()]
  # the one during the save is dropped (never the error itself), the one after it shown
  assert [str(u.exc_value) for u in unraisable] == ["Event loop is closed"]


def test_an_export_on_a_full_disk_is_one_error_and_leaves_nothing(tmp_path, monkeypatch):
  import safetensors.numpy  # pylint: disable=import-outside-toplevel

  def full(*args, **kwargs):
    del args, kwargs
    raise RuntimeError("Error while serializing: I/O error: No space left on device (os "
                       "error 28)")  # safetensors raises a plain Exception subclass
  monkeypatch.setattr(safetensors.numpy, "save_file", full)
  cfg = ModelConfig(model_type="llama", vocab_size=16, hidden_size=16, intermediate_size=32,
                    num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                    max_position_embeddings=32, norm_eps=1e-5, tie_word_embeddings=False)
  params = init_params(CausalLM(cfg), jax.random.key(0))
  with pytest.raises(files.DiskFullError, match="the exported model"):
    hf.save_pretrained(tmp_path / "policy", cfg, params)
  assert os.listdir(tmp_path) == []  # no temporary directory, no half-written model


def test_the_byte_form_serves_any_loop():
  """``checkpoint.disk_warning`` in bytes (the supervised loop's call): 100 steps saved every 50
  from step 0, keep 2, none held: 2 checkpoints and the export."""
  args = dict(size=1_000_000, export=500_000, keep=2, save_every=50, start=0, steps=100, held=0)
  assert checkpoint.disk_warning(2_500_000, **args) is None
  assert "2 checkpoint(s) of up to 1.0 MB" in checkpoint.disk_warning(2_499_999, **args)
  assert checkpoint.nbytes({"a": np.zeros(3, np.float32), "b": None}) == 12
