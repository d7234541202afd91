"""RLHF on the arithmetic task end to end: SFT → the SFT policy's own mistakes as preference
pairs → a reward model from the SFT policy → PPO against it at one or more KL coefficients;
then the reward-model over-optimisation figure (Gao, Schulman and Hilton 2022) and one JSON line.

Tables: docs/learning.md, "A reward model that learns" and "RLHF against a learned reward model:
over-optimisation, measured" (and the figures docs/rlhf_overoptimisation.png,
docs/rlhf_reward_model.png).

    python benchmarks/rlhf.py --out runs/rlhf [--kl 0.05 0.01] [--iterations 60] \
        [--eval-every 10] [--save-every 20] [--rm-save-every N] \
        [--figure docs/rlhf_overoptimisation.png] [--rm-figure docs/rlhf_reward_model.png] \
        [--compile-cache DIR] [--report-only]

Stages (each one ``python -m`` process, its log in OUT/NAME.log; a stage whose output exists is
not rerun, so a cut-off run goes on where it stopped):

1. ``ppojax.supervised.sft --config configs/sft_arith.py`` on ``--sft-size`` examples → OUT/sft/policy.
2. ``ppojax.supervised.preferences``: the SFT policy answers ``--pairs`` train problems 4 times at
   temperature 1; each distinct wrong answer w gives the pair (w with the right number, w);
   ``--synthetic`` template pairs are mixed in. The same on ``--test-pairs`` test problems (and
   ``--test-synthetic``) for the held-out set → OUT/prefs/{train,test}.jsonl.
3. ``ppojax.supervised.train_rm --config configs/rm_arith.py`` from the SFT policy, ``--rm-epochs`` epochs,
   held-out pairwise accuracy (overall and per source) every epoch → OUT/rm/reward_model.
4. ``ppojax.train --config configs/rlhf_arith.py`` per ``--kl`` (at once with ``--parallel``, for
   an accelerator) → OUT/ppo_klK: per iteration the reward model's score of the sampled responses
   (``objective/scores_raw``, the proxy), their exact match (``monitor/accuracy``, the true
   reward) and their KL to the SFT policy (``objective/kl``); the held-out greedy exact match at
   every ``--eval-every``-th iteration.

Every stage shares one persistent XLA compilation cache (``--compile-cache``, default
OUT/xla_cache; ``JAX_COMPILATION_CACHE_DIR`` if set wins): on a GPU each distinct greedy decode
took about 100 s to compile and autotune (docs/performance.md#gpu), and the PPO runs at other
β, or a run resumed from its last checkpoint (``--save-every``), load them instead.

The figure: proxy and true reward of the sampled responses (running means over ``--smooth``
iterations), and the held-out greedy completions' exact match (true) and reward-model score
(proxy, ``eval/reward_model``), all against the KL. The JSON line: the reward model's held-out
accuracy per evaluation, and per PPO run the SFT policy's held-out accuracy, the best one, its
iteration and KL (where the true reward peaks), and the last, each with its held-out proxy; plus
the machine. ``--rm-figure``: the reward model's held-out pairwise accuracy (overall and per
pair source) at every evaluation against the training step.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import os
import pathlib
import subprocess
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from algorithms import machine  # noqa: E402  (the CPU by lscpu, the device, jax)

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run_stage(out: pathlib.Path, name: str, done: pathlib.Path, args: list[str],
              env=None) -> None:
  """Runs ``python -m ARGS`` (log: OUT/NAME.log) unless ``done`` exists."""
  if done.exists():
    print(f"{name}: {done} exists, not rerun", flush=True)
    return
  print(f"{name}: python -m {' '.join(args)}", flush=True)
  with open(out / f"{name}.log", "a", encoding="utf-8") as log:
    proc = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, stdout=log,
                          stderr=subprocess.STDOUT, check=False, env=env)
  if proc.returncode or not done.exists():
    tail = (out / f"{name}.log").read_text(encoding="utf-8")[-2000:]
    raise SystemExit(f"{name} failed (rc={proc.returncode}):\n{tail}")


def run_pipeline(args, out: pathlib.Path) -> None:
  sft, rm, prefs = out / "sft", out / "rm", out / "prefs"
  prefs.mkdir(parents=True, exist_ok=True)
  env = dict(os.environ)
  if args.compile_cache:
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(args.compile_cache.resolve()))
  if args.parallel > 1:  # several processes on one accelerator: allocate as needed
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  stage = functools.partial(run_stage, env=env)
  stage(out, "sft", sft / "policy", [
      "ppojax.supervised.sft", "--config", "configs/sft_arith.py", "--workdir", str(sft),
      f"--config.data.train_size={args.sft_size}", "--config.save_every=100000"])
  sample = ["ppojax.supervised.preferences", "--config", "configs/rlhf_arith.py",
            f"--config.model.policy={sft / 'policy'}", "--samples=4"]
  stage(out, "prefs_train", prefs / "train.jsonl", [
      *sample, f"--out={prefs / 'train.jsonl'}", f"--n={args.pairs}",
      f"--synthetic={args.synthetic}", "--seed=0"])
  stage(out, "prefs_test", prefs / "test.jsonl", [
      *sample, f"--out={prefs / 'test.jsonl'}", "--split=test", f"--n={args.test_pairs}",
      f"--synthetic={args.test_synthetic}", "--seed=1"])
  stage(out, "rm", rm / "reward_model", [
      "ppojax.supervised.train_rm", "--config", "configs/rm_arith.py", "--workdir", str(rm),
      f"--config.model.init={sft / 'policy'}", f"--config.data.train={prefs / 'train.jsonl'}",
      f"--config.data.eval={prefs / 'test.jsonl'}", "--config.data.train_size=0",
      "--config.data.eval_size=0", "--config.data.max_response_len=32",
      f"--config.train.num_epochs={args.rm_epochs}", "--config.train.batch_size=32",
      "--config.train.eval_every=-1", "--config.train.eval_batch_size=128",
      f"--config.save_every={args.rm_save_every}"])

  def ppo(kl: float) -> None:
    workdir = out / f"ppo_kl{kl}"
    stage(out, f"ppo_kl{kl}", workdir / "policy", [
        "ppojax.train", "--config", "configs/rlhf_arith.py", "--workdir", str(workdir),
        f"--config.model.policy={sft / 'policy'}", f"--config.model.reward={rm / 'reward_model'}",
        f"--config.rl.kl_coef={kl}", f"--config.num_iterations={args.iterations}",
        f"--config.eval.every={args.eval_every}", f"--config.save_every={args.save_every}"])

  with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
    list(pool.map(ppo, args.kl))


# --------------------------------------------------------------------------------- the report


def running_mean(x, k: int) -> np.ndarray:
  """Mean of the last ``k`` values (fewer at the start)."""
  x = np.asarray(x, float)
  c = np.cumsum(np.insert(x, 0, 0.0))
  n = np.arange(1, len(x) + 1)
  lo = np.maximum(n - k, 0)
  return (c[n] - c[lo]) / (n - lo)


def read_ppo(workdir: pathlib.Path, smooth: int) -> dict:
  """Per iteration KL, proxy and true reward; held-out (iteration, KL, exact match, reward-model
  score) points, each at the running mean of the sampled KL over ``smooth`` iterations (one
  batch's KL is noisy)."""
  rows = [json.loads(line) for line in open(workdir / "metrics.jsonl", encoding="utf-8")]
  it = [r for r in rows if "objective/kl" in r]
  kl = dict(zip((r["step"] for r in it),
                running_mean([r["objective/kl"] for r in it], smooth).tolist()))
  evals = json.loads((workdir / "eval.json").read_text())
  point = lambda e: (e["eval/accuracy"], e.get("eval/reward_model", np.nan))  # noqa: E731
  held = [(0, 0.0, *point(evals["before"]))]
  for phase, e in evals.items():
    if phase.startswith("iteration_"):
      step = int(phase.removeprefix("iteration_"))
      held.append((step, kl[step], *point(e)))
  if "after" in evals and it and it[-1]["step"] not in [h[0] for h in held]:
    held.append((it[-1]["step"], kl[it[-1]["step"]], *point(evals["after"])))
  held.sort()
  config = json.loads((workdir / "config.json").read_text())
  return {"name": f"β = {config['ppo']['kl_coef']}", "kl": [r["objective/kl"] for r in it],
          "proxy": [r["objective/scores_raw"] for r in it],
          "true": [r["monitor/accuracy"] for r in it], "held": held,
          "instructed": evals.get("before_instructed", {}).get("eval/accuracy")}


def ppo_summary(run: dict) -> dict:
  """The SFT policy's held-out accuracy, the best one (where the true reward peaks: its
  iteration and KL) and the last, each with the reward model's held-out score (the proxy)."""
  step, kl, best, proxy = max(run["held"], key=lambda h: h[2])
  sft, last = run["held"][0], run["held"][-1]
  finite = lambda x: None if np.isnan(x) else x  # noqa: E731  (JSON has no NaN)
  return {"run": run["name"], "sft_accuracy": sft[2], "sft_instructed_accuracy": run["instructed"],
          "sft_proxy": finite(sft[3]), "best_accuracy": best, "best_iteration": step,
          "kl_at_best": kl, "proxy_at_best": finite(proxy), "gain_points": 100 * (best - sft[2]),
          "last_accuracy": last[2], "last_iteration": last[0], "last_kl": last[1],
          "last_proxy": finite(last[3])}


def rm_summary(workdir: pathlib.Path) -> list[dict]:
  """The reward model's held-out evaluations: step, epoch and every ``eval/`` accuracy."""
  rows = [json.loads(line) for line in open(workdir / "metrics.jsonl", encoding="utf-8")]
  return [{"step": r["step"], "epoch": r.get("epoch", 0.0),
           **{k.removeprefix("eval/"): v for k, v in r.items() if k.startswith("eval/accuracy")}}
          for r in rows if "eval/accuracy" in r]


def rm_figure(evals: list[dict], path: pathlib.Path) -> None:
  """Held-out pairwise accuracy (overall and per source) against the training step."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, ax = plt.subplots(figsize=(6, 3.8))
  steps = [e["step"] for e in evals]
  for key in sorted({k for e in evals for k in e if k.startswith("accuracy")}):
    label = "all held-out pairs" if key == "accuracy" else key.removeprefix("accuracy/") + " pairs"
    ax.plot(steps, [e.get(key, np.nan) for e in evals], "o-", label=label,
            lw=2 if key == "accuracy" else 1)
  ax.axhline(0.5, color="gray", ls="--", label="chance")
  ax.set_xlabel("training step (32 pairs each)")
  ax.set_ylabel("held-out pairwise accuracy")
  ax.set_title("reward model from the SFT policy")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def figure(runs: list[dict], path: pathlib.Path, smooth: int) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, axes = plt.subplots(1, 4, figsize=(19, 3.8))
  for i, run in enumerate(runs):
    kl = running_mean(run["kl"], smooth)
    axes[0].plot(kl, running_mean(run["proxy"], smooth), color=f"C{i}", label=run["name"])
    axes[1].plot(kl, running_mean(run["true"], smooth), color=f"C{i}", label=run["name"])
    held = np.asarray(run["held"], float)
    axes[2].plot(held[:, 1], held[:, 2], "o-", color=f"C{i}", label=f"{run['name']}: true")
    axes[3].plot(held[:, 1], held[:, 3], "s--", color=f"C{i}", label=f"{run['name']}: proxy")
  axes[2].axhline(runs[0]["held"][0][2], color="gray", ls="--", label="SFT policy")
  axes[3].axhline(runs[0]["held"][0][3], color="gray", ls="--", label="SFT policy")
  for ax, title in zip(axes, ("proxy: reward-model score (sampled)",
                              "true: exact match (sampled, T = 0.7)",
                              "true: held-out exact match (greedy)",
                              "proxy: held-out reward-model score (greedy)")):
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("KL to the SFT policy (nats per response)")
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, type=pathlib.Path)
  parser.add_argument("--sft-size", type=int, default=1024)
  parser.add_argument("--pairs", type=int, default=3072, help="train problems the policy answers")
  parser.add_argument("--synthetic", type=int, default=3072)
  parser.add_argument("--test-pairs", type=int, default=512)
  parser.add_argument("--test-synthetic", type=int, default=256)
  parser.add_argument("--rm-epochs", type=float, default=2.0)
  parser.add_argument("--kl", type=float, nargs="+", default=[0.05, 0.01])
  parser.add_argument("--iterations", type=int, default=60)
  parser.add_argument("--eval-every", type=int, default=10)
  parser.add_argument("--save-every", type=int, default=20,
                      help="PPO checkpoint interval (a cut-off run resumes from the last one)")
  parser.add_argument("--rm-save-every", type=int, default=100000,
                      help="the reward model's checkpoint interval in steps (on a CPU, where its "
                      "465 steps take hours: a cut-off stage resumes from the last one)")
  parser.add_argument("--parallel", type=int, default=1, help="PPO runs at once")
  parser.add_argument("--compile-cache", default=None,
                      help="persistent XLA compilation cache of every stage (default "
                      "OUT/xla_cache; '' for none)")
  parser.add_argument("--smooth", type=int, default=5)
  parser.add_argument("--figure", type=pathlib.Path, default=None)
  parser.add_argument("--rm-figure", type=pathlib.Path, default=None)
  parser.add_argument("--report-only", action="store_true")
  args = parser.parse_args(argv)
  out = args.out.resolve()
  out.mkdir(parents=True, exist_ok=True)
  args.compile_cache = (out / "xla_cache" if args.compile_cache is None
                        else pathlib.Path(args.compile_cache) if args.compile_cache else None)
  if not args.report_only:
    run_pipeline(args, out)
  runs = [read_ppo(out / f"ppo_kl{kl}", args.smooth) for kl in args.kl
          if (out / f"ppo_kl{kl}" / "eval.json").exists()]
  if args.figure and runs:
    figure(runs, args.figure, args.smooth)
  rm_evals = rm_summary(out / "rm") if (out / "rm" / "metrics.jsonl").exists() else None
  if args.rm_figure and rm_evals:
    rm_figure(rm_evals, args.rm_figure)
  print(json.dumps({"reward_model": rm_evals,
                    "ppo": [ppo_summary(r) for r in runs], "machine": machine()}))


if __name__ == "__main__":
  main()
