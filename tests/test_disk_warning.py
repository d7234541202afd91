"""The start-of-run warning that a run's checkpoints and export may not fit on the disk."""

import numpy as np
import pytest
from ml_collections import ConfigDict

from ppojax.learner.state import TrainState
from ppojax.run import loop_state


def _brute_saves(start, iterations, save_every):
  return sum(1 for it in range(start + 1, iterations + 1)
             if it % save_every == 0 or it == iterations)


@pytest.mark.parametrize("iterations", [1, 2, 7, 50, 101])
@pytest.mark.parametrize("save_every", [1, 2, 3, 50])
def test_saves_left_counts_every_due_iteration_and_the_last(iterations, save_every):
  for start in range(iterations + 1):
    assert loop_state.saves_left(start, iterations, save_every) == _brute_saves(
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
  assert "0.0 GB free" in warning and "2 checkpoint(s)" in warning
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
