"""Checkpoints: round trips of a TrainState-like pytree (typed PRNG keys, optax states), save/keep
policy, errors, sharded restore, atomicity when the saving process is SIGKILLed mid-save, and the
fallback from a corrupt latest checkpoint to the previous complete one."""

from __future__ import annotations

import logging
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ppojax.run.checkpoint import (
  Checkpointer,
  CheckpointMismatchError,
  CheckpointWarning,
  CorruptCheckpointError,
)

TMP_SUFFIX = ".orbax-checkpoint-tmp"  # how orbax names a step directory before its commit
TX = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))


class KL(NamedTuple):
  beta: jax.Array
  value: jax.Array


class TrainState(NamedTuple):
  actor: dict
  critic: dict
  actor_opt: optax.OptState
  critic_opt: optax.OptState
  kl: KL
  step: jax.Array
  key: jax.Array


def make_state(seed: int = 0, impl: str = "threefry2x32", hidden: int = 8) -> TrainState:
  """A small TrainState with non-trivial values everywhere (optimiser states after one update)."""
  rng = np.random.default_rng(seed)

  def f(*shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)

  actor = {"embed": f(16, hidden), "layers": {"w": f(hidden, hidden), "b": f(hidden)}}
  critic = {"body": {"w": f(hidden, hidden)}, "head": f(hidden, 1)}

  def stepped_opt(params):
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), params)
    return TX.update(grads, TX.init(params), params)[1]

  return TrainState(actor=actor, critic=critic, actor_opt=stepped_opt(actor),
                    critic_opt=stepped_opt(critic),
                    kl=KL(beta=jnp.float32(0.1 + seed), value=jnp.float32(0.02)),
                    step=jnp.int32(3 + seed),
                    key=jax.random.fold_in(jax.random.key(seed, impl=impl), 1))


def is_key(x) -> bool:
  return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def assert_trees_equal(actual, expected):
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for x, y in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    assert x.dtype == y.dtype and x.shape == y.shape, (x.dtype, y.dtype, x.shape, y.shape)
    if is_key(y):
      assert str(jax.random.key_impl(x)) == str(jax.random.key_impl(y))
      x, y = jax.random.key_data(x), jax.random.key_data(y)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_round_trip(tmp_path, impl):
  state = make_state(0, impl)
  with Checkpointer(tmp_path, save_every=1, keep=3) as ckpt:
    assert ckpt.latest_step() is None and ckpt.all_steps() == []
    assert ckpt.save(10, state)
    assert ckpt.latest_step() == 10
  with Checkpointer(tmp_path, save_every=1, keep=3) as ckpt:  # a fresh process would see the same
    assert ckpt.latest_step() == 10
    unplaced = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    for target in (make_state(5, impl), abstract(make_state(5, impl)), unplaced):
      restored, meta = ckpt.restore(target)
      assert meta == {}
      assert_trees_equal(restored, state)
      assert {x.sharding for x in jax.tree.leaves(restored)} == {state.step.sharding}
  assert type(restored) is TrainState and type(restored.kl) is KL
  assert isinstance(restored.actor_opt[0], optax.EmptyState)
  assert restored.step.dtype == jnp.int32 and restored.actor_opt[1][0].count.dtype == jnp.int32
  assert int(restored.actor_opt[1][0].count) == 1
  assert restored.key.dtype == state.key.dtype and str(jax.random.key_impl(restored.key)) == impl
  # The restored key and optimiser state are usable and give the same results as the originals.
  np.testing.assert_array_equal(jax.random.normal(restored.key, (4,)),
                                jax.random.normal(state.key, (4,)))
  grads = jax.tree.map(jnp.ones_like, state.actor)
  expected = TX.update(grads, state.actor_opt, state.actor)
  assert_trees_equal(TX.update(grads, restored.actor_opt, restored.actor), expected)


def test_save_every_keep_and_force(tmp_path):
  state = make_state()
  ckpt = Checkpointer(tmp_path, save_every=2, keep=2)
  saved = [step for step in range(1, 8) if ckpt.save(step, state)]
  assert saved == [2, 4, 6]
  assert ckpt.all_steps() == [4, 6] and ckpt.latest_step() == 6
  assert ckpt.save(7, state, force=True)  # off-interval, e.g. the final step of a run
  assert ckpt.all_steps() == [6, 7]
  ckpt.close()
  assert sorted(p.name for p in tmp_path.iterdir()) == ["6", "7"]  # older ones deleted
  ckpt = Checkpointer(tmp_path, save_every=2, keep=2)
  assert ckpt.all_steps() == [6, 7] and ckpt.latest_step() == 7
  for step in (7, 5):  # never overwrites, never goes back
    with pytest.raises(ValueError, match=f"cannot save step {step}: .* already holds step 7"):
      ckpt.save(step, state, force=True)
  with pytest.raises(TypeError):  # not JSON: rejected before anything is written
    ckpt.save(8, state, meta={"bad": object()})
  assert ckpt.all_steps() == [6, 7] and sorted(p.name for p in tmp_path.iterdir()) == ["6", "7"]
  with pytest.raises(ValueError, match=">= 1"):
    Checkpointer(tmp_path, save_every=0, keep=2)
  ckpt.close()


def test_meta_round_trip(tmp_path):
  meta = {"data_position": 1234, "epoch": 2, "done": False, "note": None,
          "config": {"lr": 1e-3, "model": "smollm2", "mesh": [1, 2, 4]}}
  with Checkpointer(tmp_path, save_every=1, keep=5) as ckpt:
    ckpt.save(1, make_state(1), {"data_position": 1})
    ckpt.save(2, make_state(2), meta)
    state, restored_meta = ckpt.restore(make_state())
    assert restored_meta == meta
    assert_trees_equal(state, make_state(2))
    state, restored_meta = ckpt.restore(make_state(), step=1)
    assert restored_meta == {"data_position": 1}
    assert_trees_equal(state, make_state(1))


def test_restore_errors(tmp_path):
  ckpt = Checkpointer(tmp_path / "run", save_every=1, keep=2)
  with pytest.raises(FileNotFoundError, match="no complete checkpoint in .*run"):
    ckpt.restore(make_state())
  ckpt.save(1, make_state())
  with pytest.raises(FileNotFoundError, match=r"step 5 .*complete steps: \[1\]"):
    ckpt.restore(make_state(), step=5)

  bigger = make_state(hidden=6)  # every hidden-sized leaf has another shape
  with pytest.raises(ValueError, match="actor/layers/w: shape \\(8, 8\\) in the checkpoint, "
                     "\\(6, 6\\) in the target") as e:
    ckpt.restore(bigger)
  assert str(tmp_path / "run" / "1") in str(e.value)
  assert "actor_opt/1/0/mu/layers/b" in str(e.value) and "critic/head" in str(e.value)

  state = make_state()
  extra = state._replace(actor={**state.actor, "lm_head": jnp.zeros(3)})
  with pytest.raises(ValueError, match="actor/lm_head: in the target but not in the checkpoint"):
    ckpt.restore(extra)
  other_opt = state._replace(actor_opt=optax.adam(1e-3).init(state.actor))  # no clip in chain
  with pytest.raises(ValueError, match="actor_opt/0/count: in the target but not"):
    ckpt.restore(other_opt)
  with pytest.raises(ValueError, match="key: threefry2x32 in the checkpoint, rbg in the target"):
    ckpt.restore(make_state(impl="rbg"))
  ckpt.close()


def test_leftover_tmp_directory_is_ignored(tmp_path):
  state = make_state()
  with Checkpointer(tmp_path, save_every=1, keep=5) as ckpt:
    ckpt.save(1, state, {"step": 1})
  # What a save of step 3 cut short leaves behind; it even holds a commit marker inside.
  leftover = tmp_path / f"3{TMP_SUFFIX}"
  (leftover / f"state{TMP_SUFFIX}").mkdir(parents=True)
  (leftover / f"state{TMP_SUFFIX}" / "junk").write_bytes(b"\0" * 100)
  (leftover / "_CHECKPOINT_METADATA").write_text("{}")
  (leftover / "commit_success.txt").write_text("not really")
  with Checkpointer(tmp_path, save_every=1, keep=5) as ckpt:
    assert ckpt.latest_step() == 1 and ckpt.all_steps() == [1]
    restored, meta = ckpt.restore(make_state(7))
    assert_trees_equal(restored, state)
    assert meta == {"step": 1}
    with pytest.raises(FileNotFoundError):
      ckpt.restore(make_state(), step=3)
    assert ckpt.save(3, make_state(3))  # the next save of that step replaces the leftover
    assert ckpt.all_steps() == [1, 3]
    assert_trees_equal(ckpt.restore(make_state())[0], make_state(3))
  assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "3"]


def _state_data_file(step_dir: pathlib.Path) -> pathlib.Path:
  """The largest array data file of a step (OCDBT's ``state/d/*``, read on restore)."""
  return max((step_dir / "state" / "d").iterdir(), key=lambda p: p.stat().st_size)


def _truncate(path: pathlib.Path) -> None:
  path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


def _flip_a_byte(path: pathlib.Path) -> None:
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0xFF
  path.write_bytes(bytes(data))


CORRUPTIONS = {  # what a disk, a copy or a user can do to a step directory after its commit
    "array data truncated": lambda d: _truncate(_state_data_file(d)),
    "array data flipped": lambda d: _flip_a_byte(_state_data_file(d)),
    "array data deleted": lambda d: _state_data_file(d).unlink(),
    "tree metadata truncated": lambda d: _truncate(d / "state" / "_METADATA"),
    "tree metadata deleted": lambda d: (d / "state" / "_METADATA").unlink(),
    "meta deleted": lambda d: (d / "meta" / "metadata").unlink(),
    "manifest truncated": lambda d: _truncate(d / "manifest" / "metadata"),
    "emptied": lambda d: [shutil.rmtree(p) if p.is_dir() else p.unlink() for p in d.iterdir()],
}


@pytest.mark.parametrize("corrupt", CORRUPTIONS)
def test_a_corrupt_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, corrupt, caplog,
                                                                    monkeypatch):
  """The warnings name the step and its error; orbax's own errors and tracebacks about it (its
  log records, tensorstore's reads dying on the closed event loop) are not shown besides."""
  with Checkpointer(tmp_path, save_every=1, keep=3) as ckpt:
    for step in (1, 2, 3):
      ckpt.save(step, make_state(step), {"step": step})
  CORRUPTIONS[corrupt](tmp_path / "3")
  unraisable = []
  monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
  with Checkpointer(tmp_path, save_every=1, keep=3) as ckpt:
    assert ckpt.all_steps() == [1, 2, 3]  # still listed: orbax cannot tell
    checked = []
    with pytest.warns(CheckpointWarning) as warned:
      state, meta, step = ckpt.restore_newest(make_state(9), lambda s, m: checked.append(s))
    meta_unreadable = corrupt in ("meta deleted", "emptied")  # not even checked then
    assert (step, meta, checked) == (2, {"step": 2}, [2] if meta_unreadable else [3, 2])
    assert_trees_equal(state, make_state(2))
    messages = [str(w.message) for w in warned]
    assert any(f"checkpoint {tmp_path / '3'} cannot be restored (" in m for m in messages)
    assert any(f"resuming from step 2: the unreadable checkpoint {tmp_path / '3'} is kept as "
               f"{tmp_path / '3.corrupt'}" in m for m in messages), messages
    # set aside, not deleted; the run saves step 3 again
    assert ckpt.all_steps() == [1, 2] and ckpt.latest_step() == 2
    assert ckpt.save(3, make_state(4))
    assert_trees_equal(ckpt.restore_newest(make_state(9))[0], make_state(4))
  assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2", "3", "3.corrupt"]
  assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
  assert not [str(u.exc_value) for u in unraisable]


def test_no_restorable_checkpoint_is_a_clear_error_that_changes_nothing(tmp_path):
  with Checkpointer(tmp_path, save_every=1, keep=2) as ckpt:
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
      ckpt.restore_newest(make_state())
    ckpt.save(1, make_state(1))
    ckpt.save(2, make_state(2))
  _truncate(_state_data_file(tmp_path / "2"))
  (tmp_path / "1" / "meta" / "metadata").unlink()
  with Checkpointer(tmp_path, save_every=1, keep=2) as ckpt:
    with pytest.warns(CheckpointWarning), pytest.raises(CorruptCheckpointError) as e:
      ckpt.restore_newest(make_state())
    assert ckpt.all_steps() == [1, 2]
  message = str(e.value)
  assert f"no checkpoint in {tmp_path} can be restored" in message
  assert "step 2: ValueError: " in message and "step 1: FileNotFoundError: " in message
  assert "Nothing was changed" in message and "another --workdir" in message
  assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2"]


def test_a_refusal_or_mismatch_is_not_taken_for_corruption(tmp_path):
  """Errors of the caller's check and a target of another shape propagate at once: the older
  checkpoint is not tried and nothing is set aside."""
  with Checkpointer(tmp_path, save_every=1, keep=2) as ckpt:
    ckpt.save(1, make_state(1))
    ckpt.save(2, make_state(2))

    def refuse(step, meta):
      raise KeyError(f"not this run ({step})")

    with pytest.raises(KeyError, match=r"not this run \(2\)"):
      ckpt.restore_newest(make_state(), refuse)
    with pytest.raises(CheckpointMismatchError, match="actor/layers/w: shape"):
      ckpt.restore_newest(make_state(hidden=6))
    assert ckpt.all_steps() == [1, 2]
  assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2"]


KILL_CHILD = textwrap.dedent("""
    import sys
    import jax
    sys.path.insert(0, sys.argv[2])
    from test_checkpoint import make_state
    from ppojax.run.checkpoint import (Checkpointer, CheckpointMismatchError, CheckpointWarning,
                                       CorruptCheckpointError)

    ckpt = Checkpointer(sys.argv[1], save_every=1, keep=5)
    ckpt.save(1, make_state(0), {"step": 1})
    big = {"x": jax.random.normal(jax.random.key(0), (50_000_000,))}  # 200 MB of float32
    jax.block_until_ready(big)
    print("SAVING", flush=True)
    ckpt.save(2, big, {"step": 2})
    print("SAVED", flush=True)
""")


def test_sigkill_during_save_restores_last_complete(tmp_path):
  """A process SIGKILLed while writing step 2 leaves step 1 as the latest complete checkpoint."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  tests_dir = str(pathlib.Path(__file__).parent)
  landed = False
  for attempt, delay in enumerate((0.2, 0.05, 0.0, 0.5)):
    directory = tmp_path / f"run{attempt}"
    log = tmp_path / f"child{attempt}.log"
    with open(log, "w") as stderr:
      child = subprocess.Popen([sys.executable, "-c", KILL_CHILD, str(directory), tests_dir],
                               stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    try:
      assert child.stdout.readline().strip() == "SAVING", log.read_text()[-3000:]
      tmp_dir, start = directory / f"2{TMP_SUFFIX}", time.monotonic()
      while not tmp_dir.exists() and child.poll() is None and time.monotonic() - start < 30:
        time.sleep(0.002)
      time.sleep(delay)
      child.send_signal(signal.SIGKILL)
    finally:
      child.kill()
      child.wait(timeout=30)
      child.stdout.close()
    # Landed mid-save: the step's temporary directory is there and it was never committed.
    landed = tmp_dir.exists() and not (directory / "2").exists()
    if landed:
      break
  assert landed, "no SIGKILL landed during the save of step 2"
  assert (directory / "1").is_dir() and child.returncode == -signal.SIGKILL

  with Checkpointer(directory, save_every=1, keep=5) as ckpt:
    assert ckpt.latest_step() == 1 and ckpt.all_steps() == [1]
    restored, meta = ckpt.restore(make_state(9))
    assert_trees_equal(restored, make_state(0))
    assert meta == {"step": 1}
    assert ckpt.save(2, make_state(2), {"step": 2})  # the run resumes and saves step 2 again
    assert ckpt.latest_step() == 2
  assert sorted(p.name for p in directory.iterdir()) == ["1", "2"]  # the partial save is gone


SHARDED_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from ppojax.run.checkpoint import (Checkpointer, CheckpointMismatchError, CheckpointWarning,
                                       CorruptCheckpointError)

    assert jax.device_count() == 8, jax.devices()
    devices = np.asarray(jax.devices())
    mesh = Mesh(devices.reshape(2, 4), ("data", "model"))

    def put(x, mesh, *spec):
      return jax.device_put(x, NamedSharding(mesh, P(*spec)))

    params = {"w": put(jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16), mesh, "data", "model"),
              "b": put(jnp.arange(16, dtype=jnp.float32) - 3, mesh, "model")}
    tx = optax.adam(1e-3)
    grads = jax.tree.map(lambda p: p * 0.1 + 1, params)
    opt = jax.jit(tx.update)(grads, tx.init(params), params)[1]
    keys = put(jax.random.split(jax.random.key(0), 8), mesh, "data")
    state = {"params": params, "opt": opt, "step": put(jnp.int32(5), mesh), "keys": keys}
    assert opt[0].mu["w"].sharding.spec == P("data", "model"), opt[0].mu["w"].sharding

    ckpt = Checkpointer(DIRECTORY, save_every=1, keep=2)
    assert ckpt.save(1, state, {"mesh": [2, 4]})

    def check(target):
      restored, meta = ckpt.restore(target)
      assert meta == {"mesh": [2, 4]}
      flat = jax.tree_util.tree_flatten_with_path(target)[0]
      assert len(flat) == len(jax.tree.leaves(restored)) == len(jax.tree.leaves(state)) == 9
      for (path, t), x, y in zip(flat, jax.tree.leaves(restored), jax.tree.leaves(state)):
        assert x.dtype == y.dtype and x.shape == y.shape, (path, x.dtype, y.dtype)
        if jax.dtypes.issubdtype(y.dtype, jax.dtypes.prng_key):
          # JAX writes a replicated key array's spec as P(None,), never P().
          assert x.sharding.is_equivalent_to(t.sharding, x.ndim), (path, x.sharding)
          x, y = jax.random.key_data(x), jax.random.key_data(y)
        else:
          assert x.sharding == t.sharding, (path, x.sharding, t.sharding)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
      return restored

    # Fully replicated over the same 2x4 mesh: every device holds whole arrays.
    replicated = NamedSharding(mesh, P())
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
                          state)
    restored = check(target)
    w = restored["params"]["w"]
    assert len(w.addressable_shards) == 8 and w.addressable_shards[0].data.shape == (8, 16)

    # A 4x2 mesh with w's axes swapped, given as arrays already placed there.
    mesh42 = Mesh(devices.reshape(4, 2), ("data", "model"))
    specs = {"w": ("model", "data"), "b": ("data",)}
    target_params = {k: put(jnp.zeros_like(v), mesh42, *specs[k]) for k, v in params.items()}
    target_opt = tx.init(target_params)  # mu, nu: zeros placed like target_params
    target = {"params": target_params, "opt": target_opt, "step": put(jnp.int32(0), mesh42),
              "keys": put(jax.random.split(jax.random.key(1), 8), mesh42, "data")}
    restored = check(target)
    w = restored["params"]["w"]
    assert w.sharding.spec == P("model", "data")
    assert w.sharding.mesh.shape == {"data": 4, "model": 2}
    assert {s.data.shape for s in w.addressable_shards} == {(4, 4)}
    assert restored["opt"][0].mu["w"].sharding.spec == P("model", "data")
    assert restored["keys"].sharding.spec == P("data")
    assert restored["opt"][0].count.dtype == jnp.int32
    print("OK")
""")


def test_sharded_restore_into_other_shardings(tmp_path, run_on_8_cpu_devices):
  run_on_8_cpu_devices(SHARDED_SCRIPT.replace("DIRECTORY", repr(str(tmp_path / "ckpt"))))
