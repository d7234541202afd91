"""The five algorithms on the quickstart task, several seeds each: held-out accuracy, training
time and peak memory in one table, and the accuracy-against-time curves in one figure.

Tables: docs/algorithms.md, "On the quickstart task" and "DAPO against GRPO on chain_sum" (and their
figures, docs/algorithms.png and docs/dapo_vs_grpo.png).

    python benchmarks/algorithms.py --out runs/algorithms [--seeds 0 1 2] [--parallel 1]
        [--figure docs/algorithms.png [--figure-by-iteration]] [--eval-every 5] [JOB ...]

A JOB is ``NAME=CONFIG[,--config.FIELD=VALUE...]``; the default jobs are the five algorithms'
configs: ``ppo=configs/quickstart.py``, ``grpo=configs/grpo_arith.py``,
``dr_grpo=configs/dr_grpo_arith.py``, ``rloo=configs/rloo_arith.py``,
``reinforce_pp=configs/reinforce_pp_arith.py``. Each (job, seed) is one
``python -m ppojax.train --config CONFIG --workdir OUT/NAME/seedS --config.seed=S
--config.eval.every=E`` (a run already finished there is read, not rerun; one cut off resumes).
``--parallel`` runs that many at once (one accelerator shared by several small runs: each
process then allocates device memory as it needs it, ``XLA_PYTHON_CLIENT_PREALLOCATE=false``).

Per run it reads eval.json (held-out greedy exact match before, at every ``--eval-every``-th
iteration and after) and metrics.jsonl: ``time/train_s`` (the iterations' seconds, held-out
evaluations not counted), the peaks ``memory/peak_rss_mb`` and ``memory/device_peak_mb`` (where
the device counts), and the process's wall time as this script saw it (loading, compiling and
the evaluations included), the sampled responses' mean length (``val/response_length``) and
the share cut off at the length limit (``objective/missing_stop_frac``), both averaged over the
iterations. Per job: the mean, min and max over seeds. The last line printed is
a JSON object with the rows, the CPU (``lscpu``) and the device. Runs in parallel share the
machine, so their times are comparable with each other, not with a run alone.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pathlib
import platform
import shutil
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_JOBS = ("ppo=configs/quickstart.py", "grpo=configs/grpo_arith.py",
                "dr_grpo=configs/dr_grpo_arith.py", "rloo=configs/rloo_arith.py",
                "reinforce_pp=configs/reinforce_pp_arith.py")


def parse_job(spec: str) -> tuple[str, str, list[str]]:
  """``NAME=CONFIG[,--config.X=Y...]`` → (name, config path, extra flags)."""
  name, sep, rest = spec.partition("=")
  if not sep or not name or not rest:
    raise SystemExit(f"job {spec!r}: expected NAME=CONFIG[,--config.FIELD=VALUE...], e.g. "
                     "grpo_lr1e-5=configs/grpo_arith.py,--config.optim.actor.lr=1e-5")
  config, *flags = rest.split(",")
  bad = [f for f in flags if not f.startswith("--config.")]
  if bad:
    raise SystemExit(f"job {name}: {bad} are not --config.FIELD=VALUE overrides")
  return name, config, flags


def run_one(name: str, config: str, flags: list[str], seed: int, out: pathlib.Path,
            eval_every: int, shared_device: bool, keep_checkpoints: bool = False) -> dict:
  """Trains one (job, seed) in its own process unless its workdir holds a finished run; a
  finished run's checkpoints are deleted unless ``keep_checkpoints`` (its metrics, evaluations
  and exported policy stay)."""
  workdir = out / name / f"seed{seed}"
  done = workdir / "done.json"
  if done.exists():  # its wall time and command; the rest read again (this script may be newer)
    return {**json.loads(done.read_text()), **read_run(workdir)}
  workdir.mkdir(parents=True, exist_ok=True)
  cmd = [sys.executable, "-m", "ppojax.train", "--config", config, "--workdir", str(workdir),
         f"--config.seed={seed}", f"--config.eval.every={eval_every}", *flags]
  env = dict(os.environ)
  if shared_device:
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  t0 = time.perf_counter()
  with open(workdir / "log.txt", "a", encoding="utf-8") as log:
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                          check=False)
  wall = time.perf_counter() - t0
  if proc.returncode:
    tail = (workdir / "log.txt").read_text(encoding="utf-8")[-2000:]
    raise RuntimeError(f"{name} seed {seed} failed (rc={proc.returncode}):\n{tail}")
  result = {"name": name, "seed": seed, "wall_s": wall, "command": " ".join(cmd[1:]),
            **read_run(workdir)}
  done.write_text(json.dumps(result))
  if not keep_checkpoints:  # 3 GB per PPO run of the quickstart: a seed sweep filled a disk
    shutil.rmtree(workdir / "checkpoints", ignore_errors=True)
  return result


def read_run(workdir: pathlib.Path) -> dict:
  """Accuracy by phase, the accuracy curve against the iterations' seconds, and the peaks."""
  evals = json.loads((workdir / "eval.json").read_text())
  rows = [json.loads(line) for line in open(workdir / "metrics.jsonl", encoding="utf-8")]
  train_s = {r["step"]: r["time/train_s"] for r in rows if "time/train_s" in r}
  train_s[0] = 0.0
  curve = [(r["step"], train_s.get(r["step"]), r["eval/accuracy"])
           for r in rows if "eval/accuracy" in r]
  peak = lambda key: max((r[key] for r in rows if key in r), default=None)  # noqa: E731
  acc = {phase: {k.removeprefix("eval/"): v for k, v in e.items() if "accuracy" in k}
         for phase, e in evals.items()}
  mean = lambda key: spread([r[key] for r in rows if key in r])["mean"]  # noqa: E731
  return {"accuracy": acc, "curve": curve, "train_s": max(train_s.values()),
          "response_length": mean("val/response_length"),
          "truncated": mean("objective/missing_stop_frac"),
          "peak_rss_mb": peak("memory/peak_rss_mb"),
          "device_peak_mb": peak("memory/device_peak_mb"),
          # the verifier's score before any shaping (an overlong penalty), where the run has it
          "scores": [(r["step"], r.get("objective/scores_raw", r["objective/scores"]))
                     for r in rows if "objective/scores" in r]}


def spread(values: list[float]) -> dict:
  values = [v for v in values if v is not None]
  if not values:
    return {"mean": None, "min": None, "max": None}
  return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}


def summarize(runs: list[dict]) -> dict:
  """One job's seeds → mean/min/max of the final accuracies, times and peaks."""
  after = [r["accuracy"]["after"] for r in runs]
  return {
      "seeds": [r["seed"] for r in runs],
      "accuracy_before": spread([r["accuracy"]["before"]["accuracy"] for r in runs]),
      **{f"{k.replace('/', '_').replace('=', '')}": spread([a[k] for a in after])
         for k in after[0]},
      "response_length": spread([r["response_length"] for r in runs]),
      "truncated": spread([r["truncated"] for r in runs]),
      "train_s": spread([r["train_s"] for r in runs]),
      "wall_s": spread([r["wall_s"] for r in runs]),
      "peak_rss_mb": spread([r["peak_rss_mb"] for r in runs]),
      "device_peak_mb": spread([r["device_peak_mb"] for r in runs]),
  }


def table(summary: dict[str, dict]) -> str:
  """The Markdown table of the docs: mean [min, max] over seeds. Held-out accuracy whole and by
  the evaluation's own breakdown (digits for the arithmetic tasks, ``num_digits`` for
  reasoning-gym's chain_sum); the sampled responses' mean length and the share cut off at the
  length limit (no stop token), both averaged over every training iteration."""
  def cell(s, fmt):
    if s["mean"] is None:
      return "–"
    return f"{fmt(s['mean'])} [{fmt(s['min'])}, {fmt(s['max'])}]"
  pct = lambda v: f"{100 * v:.1f}"  # noqa: E731
  num = lambda v: f"{v:.1f}"  # noqa: E731
  sec = lambda v: f"{v:.0f}"  # noqa: E731
  gib = lambda v: f"{v / 1024:.1f}"  # noqa: E731
  parts = sorted({k for s in summary.values() for k in s if k.startswith("accuracy_")
                  and k != "accuracy_before"})
  columns = [("held-out exact match %", "accuracy", pct),
             *[(f"{k.removeprefix('accuracy_')} %", k, pct) for k in parts],
             ("response tokens", "response_length", num), ("truncated %", "truncated", pct),
             ("training s", "train_s", sec), ("wall s", "wall_s", sec),
             ("peak RSS GiB", "peak_rss_mb", gib), ("device peak GiB", "device_peak_mb", gib)]
  empty = {"mean": None}
  lines = ["| job | " + " | ".join(c[0] for c in columns) + " |",
           "| --- " * (len(columns) + 1) + "|"]
  for name, s in summary.items():
    lines.append(f"| {name} | " + " | ".join(cell(s.get(key, empty), fmt)
                                           for _, key, fmt in columns) + " |")
  return "\n".join(lines)


def figure(runs: dict[str, list[dict]], path: pathlib.Path, by_iteration: bool = False) -> None:
  """Held-out accuracy against the iterations' seconds (or the iteration, where the runs' times
  are not comparable), and the sampled score per iteration: one colour per job, one line per
  seed."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
  for i, (name, seeds) in enumerate(runs.items()):
    for j, r in enumerate(seeds):
      curve = [(step if by_iteration else t, a) for step, t, a in r["curve"] if t is not None]
      left.plot(*zip(*curve), "o-", color=f"C{i}", alpha=0.8, ms=3,
                label=name if j == 0 else None)
      right.plot(*zip(*r["scores"]), color=f"C{i}", alpha=0.6, label=name if j == 0 else None)
  left.set(xlabel="iteration" if by_iteration else
           "training seconds (held-out evaluations not counted)",
           ylabel="held-out exact match", title="greedy held-out accuracy", ylim=(0, 1))
  right.set(xlabel="iteration", ylabel="mean score of the sampled responses (unshaped)",
            title="reward while training")
  left.legend()
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)


def cpu_name() -> str:
  """``lscpu``'s model name, else ``platform.processor()``."""
  try:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True,
                               check=True).stdout.splitlines():
      if line.startswith("Model name:"):
        return line.split(":", 1)[1].strip()
  except (OSError, subprocess.CalledProcessError):
    pass
  return platform.processor() or "unknown"


def machine() -> dict:
  cpu = cpu_name()
  import jax  # pylint: disable=import-outside-toplevel
  dev = jax.devices()[0]
  return {"cpu": cpu, "cpus": os.cpu_count(), "device": f"{dev.platform}: {dev.device_kind}",
          "jax": jax.__version__}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("jobs", nargs="*", default=list(DEFAULT_JOBS))
  parser.add_argument("--out", required=True, type=pathlib.Path)
  parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
  parser.add_argument("--parallel", type=int, default=1)
  parser.add_argument("--eval-every", type=int, default=5)
  parser.add_argument("--figure", type=pathlib.Path, default=None)
  parser.add_argument("--figure-by-iteration", action="store_true",
                      help="the accuracy curves against the iteration, not training seconds")
  parser.add_argument("--keep-checkpoints", action="store_true",
                      help="keep each finished run's checkpoints (deleted by default)")
  parser.add_argument("--report-only", action="store_true",
                      help="summarise the finished runs under --out; start none")
  args = parser.parse_args(argv)
  jobs = [parse_job(j) for j in args.jobs]
  names = [n for n, _, _ in jobs]
  if len(set(names)) != len(names):
    raise SystemExit(f"job names must differ: {names}")
  out = args.out.resolve()
  tasks = [(job, seed) for seed in args.seeds for job in jobs]  # every job's seed 0 first
  if args.report_only:
    finished = [(job, seed) for job, seed in tasks
                if (out / job[0] / f"seed{seed}" / "done.json").exists()]
    missing = [t for t in tasks if t not in finished]
    if missing:
      print("not finished: " + ", ".join(f"{job[0]} seed {seed}" for job, seed in missing),
            file=sys.stderr)
    tasks = finished
  runs: dict[str, list[dict]] = {n: [] for n in names}
  failures = []
  with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
    futures = {pool.submit(run_one, *job, seed, out, args.eval_every, args.parallel > 1,
                           args.keep_checkpoints):
               (job[0], seed) for job, seed in tasks}
    for f in concurrent.futures.as_completed(futures):
      name, seed = futures[f]
      try:
        r = f.result()
      except RuntimeError as e:
        failures.append(str(e))
        print(e, file=sys.stderr, flush=True)
        continue
      runs[name].append(r)
      print(f"{name} seed {seed}: accuracy {r['accuracy']['before']['accuracy']:.3f} -> "
            f"{r['accuracy']['after']['accuracy']:.3f}, training {r['train_s']:.0f} s, wall "
            f"{r['wall_s']:.0f} s", file=sys.stderr, flush=True)
  runs = {n: sorted(rs, key=lambda r: r["seed"]) for n, rs in runs.items() if rs}
  summary = {n: summarize(rs) for n, rs in runs.items()}
  print(table(summary), file=sys.stderr)
  if args.figure and runs:
    figure(runs, args.figure, args.figure_by_iteration)
  print(json.dumps({"summary": summary, "machine": machine(), "parallel": args.parallel,
                    "eval_every": args.eval_every, "failures": len(failures),
                    "jobs": {n: [c, f] for n, c, f in jobs}}))
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
