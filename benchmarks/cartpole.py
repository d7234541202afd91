"""Time to solve CartPole-v1 (mean return >= 475; 500 is the maximum) with ppojax.classic and with
a straightforward PyTorch + gymnasium PPO of the same hyper-parameters
(benchmarks/peers/cartpole_torch.py), one after the other on this CPU; and the throughput of many
seeds trained in one vmapped call.

Table: docs/classic.md, "Figures" (ppojax against PyTorch, time to 475, many seeds).

    python benchmarks/cartpole.py [--seeds 16] [--total-timesteps 500000] [--no-torch] \
        [--warm-cache]

Both sides run PureJaxRL's CartPole settings (ppojax.classic.ppo.Hyper's defaults: 4
environments × 128 steps, 4 epochs × 4 minibatches, lr 2.5e-4 annealed, 500k steps) for the
whole budget. A side's return at an iteration is the mean over its environments of the last
finished episode's return; it is *solved* when the mean over its last 10 iterations is >= 475.
ppojax's seconds include compiling (``jax.jit(train).lower(key).compile()``). The whole run
is one call, so ppojax's time to 475 is measured in a second run that compiles 16 iterations per
call and stops after the call in which the return first reaches 475 (``until_475``); PyTorch's is
its wall time at the end of the first iteration whose return is >= 475. ``speedup_full_run``
compares the whole budget (the same work), ``speedup_to_475`` the times to 475. Both sides'
clocks start after their libraries are imported: gymnax here (ppojax.classic imports it on first
use, 1.2–2 s on this CPU), torch and gymnasium in cartpole_torch.py.

``--warm-cache`` adds the time to 475 of a run that finds its programs in JAX's persistent
compilation cache, as a second run of the same program does (``JAX_COMPILATION_CACHE_DIR``):
two fresh processes on one empty cache directory, the first compiling and writing it, the
second loading; the second's figure is ``until_475_warm_cache`` (and
``speedup_to_475_warm_cache``). It is not the cold figure: the goal counts compiling.

Prints progress to stderr and one JSON line to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import gymnax  # noqa: E402,F401  pylint: disable=unused-import
import jax  # noqa: E402
import numpy as np  # noqa: E402
from algorithms import cpu_name  # noqa: E402  (this folder is a script's sys.path[0])

from ppojax.classic import ppo, runner  # noqa: E402

TARGET = 475.0


def summary(returns: np.ndarray) -> dict:
  """returns [iterations] → first iteration >= 475 (1-based; None if never), final mean."""
  first = int(ppo.first_reaching(returns, TARGET))
  final = float(np.mean(returns[-10:]))
  return {"first_iteration_at_475": first + 1 if first >= 0 else None,
          "final_return": round(final, 1), "solved": final >= TARGET}


def matmul_flops_per_env_step(hp: ppo.Hyper, obs_dim: int = 4, num_actions: int = 2) -> float:
  """The networks' matmul FLOPs per environment step: the rollout's actor and critic forward
  passes, the critic at the final observation, and E epochs of forward + backward (≈ 3 forward
  passes) of both: (2 + 1 + 3·E)·f_critic + (1 + 3·E)·f_actor, f = 2·Σ fan_in·fan_out."""
  def f(out):
    sizes = [obs_dim] + [hp.hidden] * hp.depth + [out]
    return 2 * sum(a * b for a, b in zip(sizes[:-1], sizes[1:]))
  return (2 + 3 * hp.num_epochs) * f(1) + (1 + 3 * hp.num_epochs) * f(num_actions)


def small_matmul_gflops(rows: int, width: int = 64, repeats: int = 2000) -> float:
  """GFLOP/s of a chain of tanh([rows, width] @ [width, width]) in one compiled scan: what this
  CPU gives the agents' layer shapes (128 rows: one minibatch of one seed; 2048: of 16)."""
  x = jax.random.normal(jax.random.key(0), (rows, width))
  w = jax.random.normal(jax.random.key(1), (width, width)) / width
  fn = jax.jit(lambda x, w: jax.lax.scan(lambda c, _: (jax.numpy.tanh(c @ w), None), x, None,
                                         length=repeats)[0])
  fn(x, w).block_until_ready()
  best = float("inf")
  for _ in range(3):
    start = time.perf_counter()
    fn(x, w).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return round(2 * rows * width * width * repeats / best / 1e9, 1)


def time_ppojax(hp: ppo.Hyper, seeds: int | None) -> dict:
  """Compile and run ``make_train`` for one key (seeds None) or ``vmap`` over ``seeds`` keys."""
  train = ppo.make_train(hp)
  keys = runner.seed_keys(0, seeds or 1)
  fn, arg = (jax.jit(train), keys[0]) if seeds is None else (jax.jit(jax.vmap(train)), keys)
  start = time.perf_counter()
  compiled = fn.lower(arg).compile()
  compiled_at = time.perf_counter()
  _, metrics = compiled(arg)
  returns = np.asarray(metrics["episode/return"]).reshape(seeds or 1, -1)
  end = time.perf_counter()
  steps = (seeds or 1) * hp.num_updates * hp.batch_size
  out = {"seconds": round(end - start, 2), "compile_seconds": round(compiled_at - start, 2),
         "run_seconds": round(end - compiled_at, 2),
         "env_steps_per_second": round(steps / (end - compiled_at)),
         "matmul_gflop_per_second": round(steps * matmul_flops_per_env_step(hp) / 1e9
                                          / (end - compiled_at), 1)}
  per_seed = [summary(r) for r in returns]
  if seeds is None:
    out.update(per_seed[0])
  else:
    out.update(seeds=seeds, solved_seeds=sum(s["solved"] for s in per_seed),
               final_returns=[s["final_return"] for s in per_seed])
  return out


def time_ppojax_to_target(hp: ppo.Hyper, chunk: int = 16) -> dict:
  """Wall time until the return first reaches 475, compiling included: ``make_iteration``
  ``chunk`` iterations per compiled call (the CLI's loop), checked after each call."""
  start = time.perf_counter()
  step = jax.jit(ppo.iterations(ppo.make_iteration(hp), chunk))
  state = jax.jit(lambda k: ppo.init(hp, k))(runner.seed_keys(0, 1)[0])
  for done in range(0, hp.num_updates - chunk + 1, chunk):
    state, metrics = step(state)
    first = int(ppo.first_reaching(np.asarray(metrics["episode/return"]), TARGET))
    if first >= 0:
      return {"seconds_to_475": round(time.perf_counter() - start, 2),
              "first_iteration_at_475": done + first + 1}
  return {"seconds_to_475": None, "first_iteration_at_475": None}


def time_to_target_warm_cache() -> dict:
  """``time_ppojax_to_target`` in a fresh process whose programs come from a persistent
  compilation cache that an identical process filled just before (both results)."""
  import tempfile  # pylint: disable=import-outside-toplevel
  with tempfile.TemporaryDirectory() as cache:
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": cache,
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    runs = []
    for _ in range(2):
      proc = subprocess.run([sys.executable, __file__, "--to-475-only"], env=env,
                            capture_output=True, text=True, check=False)
      if proc.returncode:
        raise RuntimeError(f"the --to-475-only run failed:\n{proc.stderr[-3000:]}")
      runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    entries = len(os.listdir(cache))
  return {**runs[1], "filling_run": runs[0], "cache_entries": entries}


def time_torch(total_timesteps: int, threads: int) -> dict:
  script = pathlib.Path(__file__).resolve().parent / "peers" / "cartpole_torch.py"
  result = subprocess.run([sys.executable, str(script), "--total-timesteps", str(total_timesteps),
                           "--threads", str(threads)], capture_output=True, text=True, check=False)
  if result.returncode:
    raise RuntimeError(f"{script.name} failed:\n{result.stderr[-3000:]}")
  run = json.loads(result.stdout.strip().splitlines()[-1])
  out = {"seconds": round(run["seconds"], 2)}
  out.update(summary(np.asarray(run["returns"])))
  first = out["first_iteration_at_475"]
  out["seconds_to_475"] = round(run["seconds_at"][first - 1], 2) if first else None
  out.update(torch=run["torch"], gymnasium=run["gymnasium"], threads=run["torch_threads"])
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seeds", type=int, default=16, help="agents in the vmapped call")
  parser.add_argument("--total-timesteps", type=int, default=500_000)
  parser.add_argument("--torch-threads", type=int, default=1)
  parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch reference")
  parser.add_argument("--warm-cache", action="store_true",
                      help="also the time to 475 with a warm persistent compilation cache")
  parser.add_argument("--to-475-only", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  hp = ppo.Hyper(total_timesteps=args.total_timesteps)
  if args.to_475_only:  # a --warm-cache child
    print(json.dumps(time_ppojax_to_target(hp)), flush=True)
    return
  log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
  log("ppojax, one seed ...")
  one = time_ppojax(hp, None)
  log(one)
  log("ppojax, one seed until its return reaches 475 ...")
  one["until_475"] = time_ppojax_to_target(hp)
  log(one["until_475"])
  if args.warm_cache:
    log("ppojax, the same in two fresh processes on one persistent compilation cache ...")
    one["until_475_warm_cache"] = time_to_target_warm_cache()
    log(one["until_475_warm_cache"])
  log(f"ppojax, {args.seeds} seeds in one vmapped call ...")
  many = time_ppojax(hp, args.seeds)
  log(many)
  many["seconds_vs_one_seed"] = round(many["seconds"] / one["seconds"], 2)
  many["run_seconds_vs_one_seed"] = round(many["run_seconds"] / one["run_seconds"], 2)
  result = {"benchmark": "cartpole", "cpu": cpu_name(), "cores": os.cpu_count(),
            "matmul_mflop_per_env_step": round(matmul_flops_per_env_step(hp) / 1e6, 3),
            "small_matmul_gflop_per_second": {r: small_matmul_gflops(r) for r in (128, 2048)},
            "total_timesteps": hp.num_updates * hp.batch_size, "jax": jax.__version__,
            "ppojax": one, "ppojax_vmap": many}
  if not args.no_torch:
    log("PyTorch + gymnasium reference ...")
    ref = time_torch(args.total_timesteps, args.torch_threads)
    log(ref)
    result["torch"] = ref
    result["speedup_full_run"] = round(ref["seconds"] / one["seconds"], 1)
    ours = one["until_475"]["seconds_to_475"]
    if ref["seconds_to_475"] is not None and ours is not None:
      result["speedup_to_475"] = round(ref["seconds_to_475"] / ours, 1)
    warm = one.get("until_475_warm_cache", {}).get("seconds_to_475")
    if ref["seconds_to_475"] is not None and warm:
      result["speedup_to_475_warm_cache"] = round(ref["seconds_to_475"] / warm, 1)
  print(json.dumps(result), flush=True)


if __name__ == "__main__":
  main()
