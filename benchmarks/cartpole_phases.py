"""Where the seconds of the vmapped CartPole run go: rollout (with GAE) against the updates, for
one seed and for many.

Table: docs/classic.md, "Figures" (rollout against updates).

    python benchmarks/cartpole_phases.py [--seeds 16] [--total-timesteps 250000]

Runs ``make_train`` (compiled first, then timed) with 1 and with 4 epochs, for one seed
(``jax.jit(train)``) and for ``--seeds`` seeds (``jax.jit(jax.vmap(train))``). With
t(E) = rollout + E · epoch, one epoch of updates is (t(4) − t(1)) / 3 and the rollout (env
steps, forward passes, GAE, the permutations) is t(1) − epoch. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

from ppojax.classic import ppo, runner


def run_seconds(hp: ppo.Hyper, seeds: int) -> float:
  train = ppo.make_train(hp)
  keys = runner.seed_keys(0, seeds)
  fn, arg = (jax.jit(train), keys[0]) if seeds == 1 else (jax.jit(jax.vmap(train)), keys)
  compiled = fn.lower(arg).compile()
  start = time.perf_counter()
  jax.block_until_ready(compiled(arg))
  return time.perf_counter() - start


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seeds", type=int, default=16)
  parser.add_argument("--total-timesteps", type=int, default=250_000)
  args = parser.parse_args()
  out = {"total_timesteps": args.total_timesteps}
  for seeds in (1, args.seeds):
    t = {e: run_seconds(ppo.Hyper(total_timesteps=args.total_timesteps, num_epochs=e), seeds)
         for e in (1, 4)}
    epoch = (t[4] - t[1]) / 3
    out[f"seeds_{seeds}"] = {"run_seconds_4_epochs": round(t[4], 2),
                             "run_seconds_1_epoch": round(t[1], 2),
                             "rollout_seconds": round(t[1] - epoch, 2),
                             "epoch_seconds": round(epoch, 2)}
  print(json.dumps(out), flush=True)


if __name__ == "__main__":
  main()
