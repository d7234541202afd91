"""The fit tables of docs/scale.md: ``python -m ppojax.aot`` for each (config, topology, options).

Tables: docs/scale.md, "The table" and "LoRA: Llama-3.1-8B on 8 chips"; docs/scale-families.md
(Qwen3 and Gemma 3).

    python benchmarks/scale_table.py [--jobs 2] [--out FILE [--skip-done]]
        [--only qwen2_5_0_5b | --goals | --lora | --families]

Without a selection: "The table" (Qwen2.5 and Llama 3, each topology, and the rows beyond it);
``--goals``: the goal rows; ``--lora``: "LoRA: Llama-3.1-8B on 8 chips"; ``--families``: "Qwen3
and Gemma 3" (full PPO and GRPO of each on each topology, and v5e:1x1 for the smallest of each).

Each row is one deviceless compile in its own process (``python -m ppojax.aot --config
configs/scale.py:NAME --topology T [--config.X=Y ...]``), so a row's figures are exactly what that
command prints. Prints a Markdown row per compile as it finishes (in the table's order at the
end), and as its last line one JSON object: the machine (``lscpu``'s model name), jax/libtpu
versions and every row's JSON report.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also when loaded by a test
from algorithms import cpu_name  # noqa: E402  (grpo_step.py reads it here)

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("qwen2_5_0_5b", "qwen2_5_1_5b", "llama3_2_1b", "llama3_2_3b", "qwen2_5_7b",
          "llama3_1_8b")
TOPOLOGIES = ("v5e:2x2", "v5e:2x4", "v5e:4x4", "v4:2x2x2", "v5p:2x2x2")
# GRPO on the same 64 rows: 16 prompts x 4 samples, no critic (reference and reward model kept).
GRPO = ("--config.algorithm=grpo", "--config.sampling.num_samples_per_prompt=4",
        "--config.rl.batch_size=16")
GRPO_ROWS = (("qwen2_5_0_5b", "v5e:2x4", GRPO), ("llama3_1_8b", "v5e:4x4", GRPO),
             ("qwen2_5_7b", "v5e:4x4", GRPO))
# LoRA (rank 16 on every linear layer of policy and critic, both on the one frozen base that is
# also the reference; reward model kept) where full PPO does not fit: Llama-3.1-8B on 8 chips.
LORA = ("--config.lora.rank=16", "--config.lora.critic=True", "--config.model.critic_init=policy")
LORA_ROWS = (("llama3_1_8b", "v5e:2x4", LORA),
             ("llama3_1_8b", "v5e:2x4", LORA + ("--config.rl.grad_accum=2",)),
             ("llama3_1_8b", "v5e:2x4", LORA + ("--config.lora.base_dtype=bfloat16",)))
# The rows beyond the model x topology grid: the goals' topologies, the batch splits whose
# temporaries should fall (issue 24), and the critic-free step where PPO's does not fit.
EXTRA = (
    ("qwen2_5_7b", "v5p:2x2x1", ()),
    ("llama3_1_8b", "v5e:4x8", ()),
    ("qwen2_5_7b", "v5e:4x8", ()),
    ("qwen2_5_0_5b", "v5e:2x4", ("--config.rl.grad_accum=2",)),
    ("qwen2_5_0_5b", "v5e:2x4", ("--config.rl.grad_accum=4",)),
    ("qwen2_5_0_5b", "v5e:2x4", ("--config.rl.num_minibatches=4",)),
    ("llama3_1_8b", "v5e:4x4", ("--config.optim.state_dtype=float32",)),
) + GRPO_ROWS + LORA_ROWS
# Qwen3 and Gemma 3 (--families): full PPO on each topology, one chip for the smallest of each,
# then GRPO on each topology (in that order: the rows a short session can finish come first)
FAMILIES = ("qwen3_0_6b", "qwen3_1_7b", "qwen3_4b", "qwen3_8b", "gemma3_1b", "gemma3_4b",
            "gemma3_12b")
FAMILY_ROWS = (tuple((m, t, ()) for m in FAMILIES for t in TOPOLOGIES)
               + tuple((m, "v5e:1x1", o) for m in ("qwen3_0_6b", "gemma3_1b") for o in ((), GRPO))
               + tuple((m, t, GRPO) for m in FAMILIES for t in TOPOLOGIES))
# Issue 24's goals (PPO with critic, reward model and reference) and the GRPO rows: --goals.
GOALS = (("qwen2_5_0_5b", "v5e:2x4", ()), ("qwen2_5_1_5b", "v5e:2x4", ()),
         ("llama3_1_8b", "v5e:4x4", ()), ("qwen2_5_7b", "v5p:2x2x1", ())) + GRPO_ROWS


def rows(only: str | None, goals: bool = False, lora: bool = False, families: bool = False):
  if goals:
    return list(GOALS)
  if lora:
    return list(LORA_ROWS)
  if families or only in FAMILIES:
    return [r for r in FAMILY_ROWS if only is None or r[0] == only]
  grid = [(m, t, ()) for m in MODELS for t in TOPOLOGIES]
  return [r for r in grid + list(EXTRA) if only is None or r[0] == only]


def compile_row(model: str, topology: str, options: tuple[str, ...]) -> dict:
  cmd = [sys.executable, "-m", "ppojax.aot", f"--config=configs/scale.py:{model}",
         f"--topology={topology}", *options]
  start = time.perf_counter()
  done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
  wall = round(time.perf_counter() - start, 1)  # the whole process: start, trace, compile
  last = done.stdout.strip().splitlines()[-1:] or [""]
  if done.returncode != 0 or not last[0].startswith("{"):
    return {"config": model, "topology": topology, "options": list(options),
            "wall_seconds": wall, "error": (done.stderr.strip().splitlines() or ["?"])[-1][:300]}
  report = json.loads(last[0])
  report.update(config=model, options=list(options), wall_seconds=wall)
  return report


def verdict_of(r: dict) -> str:
  """The fit column: "**fits**", "does not fit" (the estimate is over the HBM), "refused by
  the compiler" (XLA:TPU stopped it: out of memory) or "unknown" (the chip's HBM is not known)."""
  if r.get("compiler_out_of_memory"):
    return "refused by the compiler"
  return {True: "**fits**", False: "does not fit", None: "unknown"}[r["fits"]]


def markdown(r: dict) -> str:
  name = r["config"] + "".join(f" `{o.removeprefix('--config.')}`" for o in r["options"])
  if "error" in r:
    return f"| {name} | {r['topology']} | error: {r['error']} |"
  gib = lambda b: "?" if b is None else f"{b / 2**30:.2f}"  # noqa: E731
  mesh = "×".join(str(r["mesh"][a]) for a in ("data", "fsdp", "tensor"))
  verdict = verdict_of(r)
  at40 = r["seconds_per_iteration_at_40pct"]
  return (f"| {name} | {r['topology']} | {mesh} | {gib(r['per_device_bytes'])} / "
          f"{gib(r['hbm_bytes_per_device'])} | {verdict} | {gib(r['argument_bytes'])} | "
          f"{gib(r['temp_bytes'])} | {r['param_shard_ratio']:.3f} | "
          f"{r['flops_per_iteration'] / 1e12:.0f} | {at40} | {r['compile_seconds']:.0f} |")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--jobs", type=int, default=1, help="compiles at once (each is mostly "
                      "one thread; more jobs than cores distorts compile_seconds)")
  which = parser.add_mutually_exclusive_group()
  which.add_argument("--only", choices=MODELS + FAMILIES, help="only this config's rows")
  which.add_argument("--goals", action="store_true", help="only issue 24's goal rows (PPO) and "
                     "the GRPO rows")
  which.add_argument("--lora", action="store_true", help="only the LoRA rows")
  which.add_argument("--families", action="store_true", help="only the Qwen3 and Gemma 3 rows: "
                     "PPO and GRPO on each topology, v5e:1x1 for the smallest of each")
  parser.add_argument("--out", type=Path, help="also append each row's JSON to this file")
  parser.add_argument("--skip-done", action="store_true", help="skip the rows --out already "
                      "holds (a run resumed after an interruption)")
  args = parser.parse_args()
  todo = rows(args.only, args.goals, args.lora, args.families)
  if args.skip_done and args.out and args.out.exists():
    done = {(r["config"], r["topology"], tuple(r["options"]))
            for r in map(json.loads, args.out.read_text().splitlines()) if "error" not in r}
    todo = [r for r in todo if (r[0], r[1], tuple(r[2])) not in done]
  results = {}
  with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
    futures = {pool.submit(compile_row, *row): i for i, row in enumerate(todo)}
    for future in concurrent.futures.as_completed(futures):
      r = results[futures[future]] = future.result()
      print(markdown(r), flush=True)
      if args.out:
        with args.out.open("a") as f:
          f.write(json.dumps(r) + "\n")
  print("\n| config | topology | mesh (data×fsdp×tensor) | needs / has (GiB) | | arguments | "
        "temporaries | parameter shards vs total/devices | TFLOP / iteration | "
        "s / iteration at 40% of peak | compile s |")
  print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
  for i in range(len(todo)):
    print(markdown(results[i]))
  print(json.dumps({"cpu": cpu_name(), "jax": metadata.version("jax"),
                    "libtpu": metadata.version("libtpu"), "rows": [results[i] for i in
                                                                   range(len(todo))]}))


if __name__ == "__main__":
  main()
