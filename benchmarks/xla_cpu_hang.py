"""Whether the vmapped CartPole run still hangs on XLA:CPU (issue 28), and the hang's cause.

Table: none; its counts of hung runs per arm are quoted in docs/classic.md, at the top ("Classic
control: CartPole on the same PPO math").

    python benchmarks/xla_cpu_hang.py [--processes 3] [--runs 12] [--timeout 150]
                                      [--calls 20000] [--arms ARM ...]

The cause (docs/classic.md): vmapped, flax's orthogonal initializer makes one batched LAPACK QR
(``lapack_sgeqrf_ffi``) per layer; jaxlib 0.10.2 runs a batched LAPACK call with enough work as
tasks on XLA:CPU's intra-op thread pool and blocks its pool thread until they finish, so when
as many QRs as the pool has threads run at once, every pool thread waits and the call never
returns. ``ppojax.classic.agent.orthogonal`` keeps each QR unbatched under ``vmap``.

Each child process prints a line per finished computation; one that has not finished within
``--timeout`` seconds has hung (``gdb -p PID``, ``thread apply all bt``: each ``tf_XLAEigen``
thread in ``ParallelBatchMap`` → ``BlockingCounter::Wait``). ``--processes`` children per arm:

  train_with_libtpu     ``--runs`` times ``jax.jit(jax.vmap(ppo.make_train(hp)))`` for 2 seeds
                        of 4,096 steps (caches cleared between runs), libtpu loaded first
                        (describing a TPU topology, as ``python -m ppojax.aot`` does)
  train_without_libtpu  the same without libtpu
  train_flax_orthogonal the same with flax's own initializer (``agent.orthogonal`` replaced by
                        ``nn.initializers.orthogonal``): the code before the fix
  init_flax             ``--calls`` times one jitted, vmapped call (2 keys) of flax's orthogonal
                        initializer on the network's six kernel shapes: jax and flax only
  init_fixed            the same with ``agent.orthogonal``

Prints, last, one JSON line: per arm the processes that hung and the computations each
finished. Needs the test extra (libtpu, gymnax).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

TRAIN = """
import sys
import jax
if sys.argv[1] == "1":
  from jax.experimental import topologies
  topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")
from flax import linen as nn
from ppojax.classic import agent, ppo, runner
if sys.argv[3] == "flax":
  agent.orthogonal = nn.initializers.orthogonal
hp = ppo.Hyper(total_timesteps=4096)
for i in range(int(sys.argv[2])):
  _, metrics = jax.jit(jax.vmap(ppo.make_train(hp)))(runner.seed_keys(i, 2))
  jax.device_get(metrics["episode/return"])
  print("run", i, flush=True)
  jax.clear_caches()
"""

INIT = """
import sys
import jax
from flax import linen as nn
from ppojax.classic import agent
init = nn.initializers.orthogonal if sys.argv[3] == "flax" else agent.orthogonal
shapes = [(4, 64), (64, 64), (64, 2), (4, 64), (64, 64), (64, 1)]  # CartPole's kernels
def kernels(key):
  return [init(1.0)(k, s) for k, s in zip(jax.random.split(key, len(shapes)), shapes)]
f = jax.jit(jax.vmap(kernels))
calls = int(sys.argv[2])
for i in range(calls):
  jax.block_until_ready(f(jax.random.split(jax.random.key(i), 2)))
  if (i + 1) % 1000 == 0 or i + 1 == calls:
    print("run", i, flush=True)
"""

# arm: (child code, libtpu, initializer)
ARMS = {
    "train_with_libtpu": (TRAIN, True, "fixed"),
    "train_without_libtpu": (TRAIN, False, "fixed"),
    "train_flax_orthogonal": (TRAIN, False, "flax"),
    "init_flax": (INIT, False, "flax"),
    "init_fixed": (INIT, False, "fixed"),
}


def child(code: str, libtpu: bool, initializer: str, count: int, timeout: float) -> dict:
  cmd = [sys.executable, "-c", code, "1" if libtpu else "0", str(count), initializer]
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
  try:
    out, _ = proc.communicate(timeout=timeout)
    hung = False
  except subprocess.TimeoutExpired:
    proc.kill()
    out, _ = proc.communicate()
    hung = True
  lines = [line for line in out.splitlines() if line.startswith("run ")]
  finished = int(lines[-1].split()[1]) + 1 if lines else 0
  return {"hung": hung, "finished": finished, "returncode": proc.returncode}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--processes", type=int, default=3, help="child processes per arm")
  parser.add_argument("--runs", type=int, default=12, help="training runs per train_* child")
  parser.add_argument("--calls", type=int, default=20000, help="calls per init_* child")
  parser.add_argument("--timeout", type=float, default=150, help="seconds before a child hung")
  parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
  args = parser.parse_args()
  result = {}
  for arm in args.arms:
    code, libtpu, initializer = ARMS[arm]
    count = args.runs if code is TRAIN else args.calls
    children = [child(code, libtpu, initializer, count, args.timeout)
                for _ in range(args.processes)]
    for c in children:
      print(arm, c, flush=True)
    result[arm] = {"processes": args.processes, "per_process": count,
                   "hung": sum(c["hung"] for c in children),
                   "finished": [c["finished"] for c in children]}
  print(json.dumps(result))


if __name__ == "__main__":
  main()
