"""Compile seconds of each program of the training iteration, deviceless for a TPU topology.

Table: docs/scale-memory.md, "Compile seconds, by program".

    python benchmarks/compile_programs.py [--models qwen2_5_0_5b,qwen2_5_1_5b,llama3_1_8b]
        [--programs rollout,learn,step] [--topology v5e:2x4] [--config.X=Y ...]

For each (model, program) one process builds ``configs/scale.py:MODEL`` abstractly on the
topology's devices and compiles one program (``ppojax.run.aot.compile_step``): "rollout"
(sampling and the rollout's forward passes), "learn" (experience and update) or "step" (the
fused iteration). The processes run one after another, so each compile has the machine to
itself. Prints a Markdown row per compile and, last, one JSON line with the machine (``lscpu``'s
model name), the versions, the decode layout and every row. Extra ``--config.X=Y`` arguments go
to every compile (e.g. ``--config.sampling.decode_layers=unroll`` for the unrolled decode).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from algorithms import cpu_name  # this folder: sys.path[0] of a script

ROOT = Path(__file__).resolve().parent.parent
CHILD = """
import ast, json, sys
from ppojax.run import aot
from ppojax.run import build as build_lib

def value(text):
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text

model, program, topology, overrides = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
flags = {name[len("--config."):].replace(".", "__"): value(v)
         for name, v in (o.split("=", 1) for o in overrides)}
config = build_lib.load_config("configs/scale.py:" + model, **flags)
result = aot.compile_step(config, aot.topology_devices(topology), program)
print(json.dumps({"model": model, "program": program, "topology": topology,
                  "compile_seconds": round(result.seconds, 1),
                  "out_of_memory": result.out_of_memory is not None}))
"""


def compile_one(model: str, program: str, topology: str, overrides: list[str]) -> dict:
  t0 = time.perf_counter()
  done = subprocess.run([sys.executable, "-c", CHILD, model, program, topology, *overrides],
                        cwd=ROOT, capture_output=True, text=True, check=False,
                        env={**os.environ, "JAX_PLATFORMS": "cpu",
                             "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
                             "JAX_ENABLE_COMPILATION_CACHE": "false"})
  if done.returncode:
    return {"model": model, "program": program, "topology": topology,
            "error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed"}
  row = json.loads(done.stdout.strip().splitlines()[-1])
  row["process_seconds"] = round(time.perf_counter() - t0, 1)
  return row


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default="qwen2_5_0_5b,qwen2_5_1_5b,llama3_1_8b")
  parser.add_argument("--programs", default="rollout,learn,step")
  parser.add_argument("--topology", default="v5e:2x4")
  args, overrides = parser.parse_known_args()
  bad = [o for o in overrides if not o.startswith("--config.") or "=" not in o]
  if bad:
    parser.error(f"unknown arguments {bad}: expected --config.section.field=value")
  rows = []
  print("| model | program | topology | compile s |\n| --- | --- | --- | --- |", flush=True)
  for model in args.models.split(","):
    for program in args.programs.split(","):
      row = compile_one(model, program, args.topology, overrides)
      rows.append(row)
      print(f"| {model} | {program} | {args.topology} | "
            f"{row.get('compile_seconds', row.get('error'))} |", flush=True)
  print(json.dumps({"cpu": cpu_name(), "jax": metadata.version("jax"),
                    "libtpu": _version("libtpu"), "overrides": overrides, "rows": rows}))


def _version(name: str) -> str | None:
  try:
    return metadata.version(name)
  except metadata.PackageNotFoundError:
    return None


if __name__ == "__main__":
  main()
