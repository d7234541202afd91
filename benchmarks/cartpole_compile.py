"""Where the compiling in CartPole's time to 475 goes, and what two XLA options change.

Table: docs/classic.md, "Figures" (where the compiling goes).

    python benchmarks/cartpole_compile.py [--rounds 2]

``benchmarks/cartpole.py``'s time to 475 compiles two programs before the first iteration runs:
the initial state (``ppo.init``: six orthogonal initialisers, each a normal draw and a QR, the
optimizer and the environments' reset) and a 16-iteration chunk of ``ppo.make_iteration``.
This script compiles both, alternating between XLA's default options and
``xla_backend_optimization_level=1`` (the CPU backend's LLVM optimisation level; 0 made the run
about 3x slower, docs/classic.md), for ``--rounds`` rounds; times 256 iterations of each
compiled chunk after 64 of warm-up; and times ``ppo.init`` run eagerly (op by op, every
primitive compiled on its own) for comparison. The return after each arm's 320 iterations
shows that the options change the numerics (the same seed gives another trajectory), not only
the time. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from ppojax.classic import ppo, runner  # noqa: E402

ARMS = {"default": {}, "llvm_o1": {"xla_backend_optimization_level": 1}}


def seconds(f):
  start = time.perf_counter()
  out = jax.block_until_ready(f())
  return time.perf_counter() - start, out


def arm(hp: ppo.Hyper, iteration, key, options: dict) -> dict:
  """Compile init and a 16-iteration chunk with ``options``; run 64 + 256 iterations."""
  kw = {"compiler_options": options} if options else {}
  init_s, init = seconds(lambda: jax.jit(lambda k: ppo.init(hp, k)).lower(key).compile(**kw))
  state = init(key)
  chunk = jax.jit(ppo.iterations(iteration, 16))  # benchmarks/cartpole.py's chunk
  chunk_s, chunk = seconds(lambda: chunk.lower(state).compile(**kw))
  for _ in range(4):
    state, _ = chunk(state)
  jax.block_until_ready(state)
  start = time.perf_counter()
  for _ in range(16):
    state, metrics = chunk(state)
  jax.block_until_ready(state)
  return {"init_compile_s": round(init_s, 2), "chunk_compile_s": round(chunk_s, 2),
          "run_256_iterations_s": round(time.perf_counter() - start, 3),
          "return_after_320": round(float(metrics["episode/return"][-1]), 1)}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=2)
  args = parser.parse_args()
  hp = ppo.Hyper()
  key = runner.seed_keys(0, 1)[0]
  make_s, iteration = seconds(lambda: ppo.make_iteration(hp))  # imports gymnax the first time
  eager_s, _ = seconds(lambda: ppo.init(hp, key))
  eager_again_s, _ = seconds(lambda: ppo.init(hp, jax.random.fold_in(key, 1)))
  rounds = [{name: arm(hp, iteration, key, options) for name, options in ARMS.items()}
            for _ in range(args.rounds)]
  for r in rounds:
    print(json.dumps(r), flush=True, file=sys.stderr)
  print(json.dumps({
      "make_iteration_s": round(make_s, 2), "eager_init_first_s": round(eager_s, 2),
      "eager_init_again_s": round(eager_again_s, 2), "rounds": rounds,
      "load_average": os.getloadavg(), "jax": jax.__version__}))


if __name__ == "__main__":
  main()
