"""Reward-model over-optimisation (Gao, Schulman and Hilton 2022) in RLHF runs: the proxy reward
(the learned reward model's score) and the true reward (exact match) against the KL to the SFT
policy, one line per run, and the KL at which the true reward peaks.

    python docs/overoptimisation_figure.py --out docs/rlhf_overoptimisation.png \
        runs/rlhf_kl0.05 runs/rlhf_kl0.01

A run is a ``python -m ppojax.train --config configs/rlhf_arith.py`` workdir: per iteration its
metrics.jsonl has ``objective/kl`` (the sampled responses' summed log-ratio to the reference,
which is the SFT policy, averaged over the batch), ``objective/scores_raw`` (the reward model's
score) and ``monitor/accuracy`` (their exact match); at every ``eval.every``-th iteration
eval.json has the held-out greedy exact match. The per-iteration curves are running means over
``--smooth`` iterations. Prints one JSON line per run: the SFT policy's held-out accuracy, the
best held-out accuracy, its iteration and KL, and the last.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def running_mean(x, k: int) -> np.ndarray:
  x = np.asarray(x, float)
  c = np.cumsum(np.insert(x, 0, 0.0))
  lo = np.maximum(np.arange(1, len(x) + 1) - k, 0)
  return (c[1:] - c[lo]) / (np.arange(1, len(x) + 1) - lo)


def read(workdir: pathlib.Path) -> dict:
  rows = [json.loads(line) for line in open(workdir / "metrics.jsonl", encoding="utf-8")]
  it = [r for r in rows if "objective/kl" in r]
  kl = {r["step"]: r["objective/kl"] for r in it}
  evals = json.loads((workdir / "eval.json").read_text())
  held = [(0, 0.0, evals["before"]["eval/accuracy"])]
  for phase, e in evals.items():
    if phase.startswith("iteration_"):
      step = int(phase.removeprefix("iteration_"))
      held.append((step, kl[step], e["eval/accuracy"]))
  if "after" in evals and it and it[-1]["step"] not in [h[0] for h in held]:
    held.append((it[-1]["step"], it[-1]["objective/kl"], evals["after"]["eval/accuracy"]))
  held.sort()
  config = json.loads((workdir / "config.json").read_text())
  return {"name": f"β = {config['ppo']['kl_coef']}", "step": [r["step"] for r in it],
          "kl": [r["objective/kl"] for r in it],
          "proxy": [r["objective/scores_raw"] for r in it],
          "true": [r["monitor/accuracy"] for r in it], "held": held,
          "instructed": evals.get("before_instructed", {}).get("eval/accuracy")}


def summary(run: dict) -> dict:
  step, kl, best = max(run["held"], key=lambda h: h[2])
  sft = run["held"][0][2]
  return {"run": run["name"], "sft_accuracy": sft, "sft_instructed": run["instructed"],
          "best_accuracy": best, "best_iteration": step, "kl_at_best": kl,
          "gain_points": 100 * (best - sft), "last_accuracy": run["held"][-1][2],
          "last_iteration": run["held"][-1][0], "last_kl": run["held"][-1][1]}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("workdirs", nargs="+", type=pathlib.Path)
  parser.add_argument("--out", default="docs/rlhf_overoptimisation.png")
  parser.add_argument("--smooth", type=int, default=5)
  args = parser.parse_args()
  runs = [read(w) for w in args.workdirs]
  fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
  for i, run in enumerate(runs):
    color = f"C{i}"
    kl = running_mean(run["kl"], args.smooth)
    axes[0].plot(kl, running_mean(run["proxy"], args.smooth), color=color, label=run["name"])
    axes[1].plot(kl, running_mean(run["true"], args.smooth), color=color, label=run["name"])
    held = np.asarray(run["held"])
    axes[2].plot(held[:, 1], held[:, 2], "o-", color=color, label=run["name"])
  axes[2].axhline(runs[0]["held"][0][2], color="gray", ls="--", label="SFT policy")
  titles = ("proxy: reward-model score (sampled)", "true: exact match (sampled, T = 0.7)",
            "true: held-out exact match (greedy)")
  for ax, title in zip(axes, titles):
    ax.set_title(title)
    ax.set_xlabel("KL to the SFT policy (nats per response)")
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(args.out, dpi=110)
  for run in runs:
    print(json.dumps(summary(run)))


if __name__ == "__main__":
  main()
