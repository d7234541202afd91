"""Two processes × 4 CPU devices (jax.distributed over Gloo) train exactly like one process × 8
devices: the same mesh, placement by the same rules, a Python reward read on the host (the
rollout all-gathered across processes) and metrics fetched from arrays that span both."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
from conftest import TEST_XLA_FLAGS

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = """
import json, os, sys
devices, process_id, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
os.environ["XLA_FLAGS"] = (f"--xla_force_host_platform_device_count={devices} "
                           + os.environ.get("XLA_FLAGS", ""))  # the suite's flags (conftest)
import importlib.util
import jax
from ppojax.run import runner
spec = importlib.util.spec_from_file_location("toy", sys.argv[4])
toy = importlib.util.module_from_spec(spec)
spec.loader.exec_module(toy)
c = toy.get_config()
c.num_iterations, c.log_every, c.sample_every = 2, 1, 1
c.rl.batch_size = 32  # 2 per device in each minibatch of 16 (the 1 x 8 run: 12.7 s; 17.6 at 128)
c.reward.kind, c.reward.fn = "python", "ppojax.tasks.count:count_reward_numpy"
if process_id >= 0:
  c.distributed, c.num_processes, c.process_id = True, 2, process_id
  c.coordinator_address = f"localhost:{port}"
result = runner.run(c)
assert len(jax.devices()) == 8 and jax.process_count() == (2 if process_id >= 0 else 1)
print("HISTORY " + json.dumps(result.history), flush=True)
"""


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _start(tmp_path, devices, process_id, port):
  script = tmp_path / "train.py"
  script.write_text(SCRIPT)
  env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
         "XLA_FLAGS": TEST_XLA_FLAGS}  # the script adds its device count
  return subprocess.Popen(
      [sys.executable, str(script), str(devices), str(process_id), str(port),
       str(ROOT / "configs" / "toy.py")],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=str(tmp_path))


def _history(proc) -> list[dict]:
  out, _ = proc.communicate(timeout=300)
  assert proc.returncode == 0, out[-3000:]
  lines = [line for line in out.splitlines() if line.startswith("HISTORY ")]
  assert lines, out[-3000:]
  return json.loads(lines[-1][len("HISTORY "):])


def test_two_processes_train_like_one(tmp_path):
  port = _free_port()
  procs = [_start(tmp_path, 4, i, port) for i in range(2)]
  try:
    multi = [_history(p) for p in procs]
  finally:  # a process that failed leaves its peer waiting for it: stop both
    for p in procs:
      p.kill()
  single = _history(_start(tmp_path, 8, -1, 0))
  for ours, ref in zip(multi[0], single, strict=True):
    keys = [k for k in ref if not k.startswith(("time/", "eps", "memory/", "compile/"))]
    assert set(keys) == {k for k in ours
                         if not k.startswith(("time/", "eps", "memory/", "compile/"))}
    assert "objective/scores" in keys and "loss/policy_avg" in keys
    for k in keys:
      np.testing.assert_allclose(ours[k], ref[k], rtol=1e-4, atol=1e-5, err_msg=k)
  for a, b in zip(*multi, strict=True):  # both processes log the same global metrics
    assert a.keys() == b.keys()
    for k in a:
      if not k.startswith(("time/", "eps", "memory/", "compile/")):
        np.testing.assert_allclose(a[k], b[k], rtol=0, atol=0, err_msg=k)
