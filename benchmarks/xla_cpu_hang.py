"""How often a small jitted, vmapped XLA:CPU computation hangs, by process setting.

    python benchmarks/xla_cpu_hang.py [--processes 3] [--runs 12] [--timeout 150]

Each child process runs ``--runs`` times a small jitted, vmapped computation (two seeds of the
CartPole PPO of ``ppojax.classic`` over 4,096 steps, about 5 s each here), its caches cleared
between runs, and prints a line per finished run. A child that has not finished within
``--timeout`` seconds has hung: its main thread waits for a result that no thread computes
(``gdb -p PID``, ``thread apply all bt``: every XLA:CPU pool thread idle). Three arms of
``--processes`` children each: libtpu loaded first (describing a TPU topology, as ``python -m
ppojax.aot`` does), no libtpu, and no libtpu with ``XLA_FLAGS=--xla_cpu_multi_thread_eigen=false``
(``JAX_CPU_ENABLE_ASYNC_DISPATCH=false`` in the environment, tried by hand, hung as well).
Prints, last, one JSON line: per arm the processes that hung and the runs each finished. Needs
the test extra (libtpu, gymnax).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = """
import sys
import jax
if sys.argv[1] == "1":
  from jax.experimental import topologies
  topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")
from ppojax.classic import ppo, runner
hp = ppo.Hyper(total_timesteps=4096)
for i in range(int(sys.argv[2])):
  _, metrics = jax.jit(jax.vmap(ppo.make_train(hp)))(runner.seed_keys(i, 2))
  jax.device_get(metrics["episode/return"])
  print("run", i, flush=True)
  jax.clear_caches()
"""


def child(libtpu: bool, xla_flags: str, runs: int, timeout: float) -> dict:
  cmd = [sys.executable, "-c", CHILD, "1" if libtpu else "0", str(runs)]
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                          env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags))
  try:
    out, _ = proc.communicate(timeout=timeout)
    hung = False
  except subprocess.TimeoutExpired:
    proc.kill()
    out, _ = proc.communicate()
    hung = True
  return {"hung": hung, "runs_finished": out.count("run "), "returncode": proc.returncode}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--processes", type=int, default=3, help="child processes per arm")
  parser.add_argument("--runs", type=int, default=12, help="computations per child")
  parser.add_argument("--timeout", type=float, default=150, help="seconds before a child hung")
  args = parser.parse_args()
  result = {}
  arms = (("with_libtpu", True, ""), ("without_libtpu", False, ""),
          ("eigen_single_threaded", False, "--xla_cpu_multi_thread_eigen=false"))
  for arm, libtpu, flags in arms:
    children = [child(libtpu, flags, args.runs, args.timeout) for _ in range(args.processes)]
    for c in children:
      print(arm, c, flush=True)
    result[arm] = {"processes": args.processes, "hung": sum(c["hung"] for c in children),
                   "runs_finished": [c["runs_finished"] for c in children]}
  print(json.dumps({"runs_per_process": args.runs, **result}))


if __name__ == "__main__":
  main()
