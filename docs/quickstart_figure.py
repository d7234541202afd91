"""Draws docs/quickstart.png from quickstart runs (one workdir per seed):

    python docs/quickstart_figure.py runs/quickstart runs/quickstart_seed1 runs/quickstart_seed2
"""

import json
import pathlib
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def rows(workdir):
  with open(pathlib.Path(workdir) / "metrics.jsonl", encoding="utf-8") as f:
    return [r for r in map(json.loads, f) if "objective/scores" in r]


def main(workdirs):
  fig, axes = plt.subplots(1, 4, figsize=(16, 3.4))
  for i, w in enumerate(workdirs):
    rs = rows(w)
    steps = [r["step"] for r in rs]
    for ax, key in zip(axes[:3], ("objective/scores", "objective/kl", "val/response_length")):
      ax.plot(steps, [r[key] for r in rs], label=f"seed {i}")
      ax.set_title(key)
      ax.set_xlabel("iteration")
    evals = json.loads((pathlib.Path(w) / "eval.json").read_text())
    names = ["accuracy/digits=1", "accuracy/digits=2", "accuracy"]
    x = range(len(names))
    axes[3].plot(x, [evals["before"]["eval/" + n] for n in names], "o--", color=f"C{i}",
                 alpha=0.5)
    axes[3].plot(x, [evals["after"]["eval/" + n] for n in names], "o-", color=f"C{i}")
    axes[3].set_xticks(list(x), ["1-digit", "2-digit", "all"])
  axes[3].set_title("held-out accuracy (dashed: before)")
  axes[3].set_ylim(0, 1)
  axes[0].legend()
  fig.tight_layout()
  out = pathlib.Path(__file__).parent / "quickstart.png"
  fig.savefig(out, dpi=80)
  print(f"wrote {out}")


if __name__ == "__main__":
  main(sys.argv[1:])
