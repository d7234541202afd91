"""Peak memory of whole training runs: GRPO (no critic) against PPO on the quickstart task.

Tables: docs/algorithms.md, "Memory" (GRPO against PPO); docs/performance/memory.md, "Freed memory
between phases" and "A resumed run".

    python benchmarks/memory.py [--iterations 3] [--save-every 2] [--ab] [--resume] \\
        [NAME=CONFIG[,--config.FIELD=VALUE...] ...]

Each job is ``python -m ppojax.train`` on its config in a process of its own: loading, the
held-out evaluations before and after, ``--iterations`` iterations with a checkpoint every
``--save-every``, and the export. A job's figure is that process's peak resident set (the
kernel's ``ru_maxrss`` of the child, read by ``os.wait4``; this script imports no JAX, so
nothing of its own is folded in). ``ratios`` divides every job's peak by the first job's.

``--compiled`` adds what the compiled programs need (XLA's ``memory_analysis`` of the
sampling half and the update half, built abstractly, no weights read): the state, the frozen
models (reference) and each half's temporaries. The difference between a run's peak and
state + frozen + the larger temporaries is the process's own memory (Python, JAX, the
tokenizer, compiled code) and whatever its allocator holds.

``--resume`` reruns every job's workdir for one iteration more (``NAME_resumed``): a process
that restores the last checkpoint, trains that iteration, evaluates and exports; its ratio to
the first process says what a resume costs beyond a fresh start (which also evaluates before).

``--ab`` runs every job a second time with ``PPOJAX_RELEASE_MEMORY=0``: without
``hostmem.release`` returning the C heap's free pages between phases (``*_no_release``).

The last line printed is one JSON object: per job the peak in MiB and the wall seconds, the
ratios, the CPU (``lscpu``).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from algorithms import cpu_name, parse_job  # noqa: E402  pylint: disable=wrong-import-position

from ppojax.run import build as build_lib

DEFAULT_JOBS = ("ppo=configs/quickstart.py", "grpo=configs/grpo_arith.py")


def run_job(config: str, flags: list[str], workdir: pathlib.Path, iterations: int,
            save_every: int, env: dict, resume: bool = False) -> dict:
  """One training process: its peak resident set (MiB) and wall seconds. ``resume``: it resumes
  ``workdir`` (its log: ``NAME_resumed.log``) instead of starting it afresh (``NAME.log``)."""
  log_name = f"{workdir.name}_resumed" if resume else workdir.name
  if not resume:
    shutil.rmtree(workdir, ignore_errors=True)
  cmd = [sys.executable, "-m", "ppojax.train", "--config", config, "--workdir", str(workdir),
         f"--config.num_iterations={iterations}", f"--config.save_every={save_every}",
         "--config.eval.every=0", *flags]
  t0 = time.perf_counter()
  with open(workdir.parent / f"{log_name}.log", "w", encoding="utf-8") as log:
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
  code = os.waitstatus_to_exitcode(status)
  if code:
    raise SystemExit(f"{' '.join(cmd)} failed ({code}); see {workdir.parent}/{workdir.name}.log")
  return {"peak_rss_mb": round(usage.ru_maxrss / 1024, 1),  # KiB on Linux
          "wall_s": round(time.perf_counter() - t0, 1)}


def compiled_mb(config: str, flags: list[str]) -> dict:
  """MiB of the state, the frozen models and the two compiled halves' temporaries of
  ``config``, on this machine's first device. A text reward runs on the host between the
  halves and holds no device memory: it is swapped for a JAX rule of the same shapes, so that
  the step builds without a tokenizer."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from ppojax.run import aot  # pylint: disable=import-outside-toplevel
  from ppojax.run.build import load_config  # pylint: disable=import-outside-toplevel

  def value(text: str):
    try:
      return ast.literal_eval(text)
    except (ValueError, SyntaxError):
      return text  # a string option

  c = load_config(config, **{k.removeprefix("--config.").replace(".", "__"): value(v)
                             for k, v in (f.split("=", 1) for f in flags)})
  c.reward.update(kind="jax", fn="ppojax.tasks.count:count_reward")
  run = build_lib.build(c, devices=jax.devices()[:1], abstract=True)
  prompts = aot.abstract_prompts(c, run.mesh)
  mb = lambda tree: round(sum(x.size * x.dtype.itemsize  # noqa: E731
                              for x in jax.tree.leaves(tree)) / 2**20, 1)
  rollout = jax.eval_shape(run.step.rollout, run.state, run.frozen, prompts)
  scores = jax.ShapeDtypeStruct((rollout.responses.shape[0],), jnp.float32)
  temp = lambda fn, *a: round(  # noqa: E731
      fn.lower(*a).compile().memory_analysis().temp_size_in_bytes / 2**20, 1)
  return {"state_mb": mb(run.state), "frozen_mb": mb(run.frozen),
          "sampling_temp_mb": temp(run.step.rollout, run.state, run.frozen, prompts),
          "update_temp_mb": temp(run.step.learn, run.state, rollout, scores)}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("jobs", nargs="*", default=list(DEFAULT_JOBS))
  parser.add_argument("--iterations", type=int, default=3)
  parser.add_argument("--save-every", type=int, default=2)
  parser.add_argument("--out", default="/tmp/ppojax-memory")
  parser.add_argument("--compiled", action="store_true",
                      help="also report what the compiled programs need (no run)")
  parser.add_argument("--resume", action="store_true",
                      help="also resume every job's workdir for one iteration more")
  parser.add_argument("--ab", action="store_true",
                      help="also run every job with PPOJAX_RELEASE_MEMORY=0")
  args = parser.parse_args(argv)
  jobs = [parse_job(j) for j in args.jobs]
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  variants = [("", {})] + ([("_no_release", {"PPOJAX_RELEASE_MEMORY": "0"})] if args.ab else [])
  results = {}
  for suffix, extra in variants:
    for name, config, flags in jobs:
      key = name + suffix
      results[key] = run_job(config, flags, out / key, args.iterations, args.save_every,
                             {**os.environ, **extra})
      print(f"{key}: peak {results[key]['peak_rss_mb'] / 1024:.2f} GiB, "
            f"{results[key]['wall_s']:.0f} s", file=sys.stderr, flush=True)
  ratios = {}
  for suffix, _ in variants:
    first = results[jobs[0][0] + suffix]["peak_rss_mb"]
    for name, _, _ in jobs[1:]:
      ratios[f"{name}{suffix}/{jobs[0][0]}{suffix}"] = round(
          results[name + suffix]["peak_rss_mb"] / first, 3)
  for name, config, flags in jobs if args.resume else ():
    key = f"{name}_resumed"
    results[key] = run_job(config, flags, out / name, args.iterations + 1, args.save_every,
                           dict(os.environ), resume=True)
    ratios[f"{key}/{name}"] = round(results[key]["peak_rss_mb"] / results[name]["peak_rss_mb"], 3)
    print(f"{key}: peak {results[key]['peak_rss_mb'] / 1024:.2f} GiB", file=sys.stderr, flush=True)
  if args.compiled:
    for name, config, flags in jobs:
      results[name]["compiled"] = compiled_mb(config, flags)
  print(json.dumps({"jobs": results, "ratios": ratios, "iterations": args.iterations,
                    "save_every": args.save_every, "cpu": cpu_name(),
                    "cpus": os.cpu_count()}))


if __name__ == "__main__":
  main()
