"""Where one fused PPO iteration's time goes, op by op: a ``jax.profiler`` trace of the step that
``benchmarks/ppo_step.py`` times (SmolLM2-135M-Instruct as policy, reference, reward model and
critic; its defaults), summed by the kind of XLA operation each traced op is:

Table: docs/performance/cpu.md, "Where the time goes".

    python benchmarks/step_trace.py [--batch 16] [--response-length 32] [--dtype float32]
        [--trace-dir DIR]

The step runs twice untraced (compile, warm-up), then once under ``jax.profiler.trace`` (with
``--trace-dir`` the trace stays there, for xprof or Perfetto). Each executed op of the trace is
matched by name with the compiled program's HLO (``compiled.as_text()``) and put in one
category: ``matmul`` (a dot, or a fusion that contains one), ``copy / transpose``,
``dynamic-update-slice`` (KV-cache writes), ``dynamic-slice / slice`` (per-layer slices of
scanned weights and caches), ``other`` (sorts, random bits, custom calls, collectives) and
``elementwise / reduce`` (every other op). Container ops (while loops, conditionals, calls)
are not counted: their bodies' ops are. Prints the wall time of the traced iteration, seconds
per category, the matmuls' GFLOP/s over the iteration's model FLOPs
(``ppo_step.iteration_flops``) against the float32 matmul peak (the mean of samples just before
and after the trace), the 12 costliest ops, and one JSON line. XLA:CPU runs independent ops
concurrently, so the categories can add up to more than the wall time.
"""

import argparse
import collections
import gzip
import json
import os
import pathlib
import re
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

from ppojax.infra import hostmem
from ppojax.learner import update as update_lib
from ppojax.run import build as build_lib
from ppojax.run import runner

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
# pylint: disable=wrong-import-position
import ppo_step  # noqa: E402

CONTAINERS = {"while", "conditional", "call", "async-start", "async-done", "parameter", "tuple",
              "get-tuple-element", "constant", "bitcast"}
# neither a matmul nor memory traffic nor elementwise arithmetic: sorts, random bits, calls out
OTHER = {"sort", "custom-call", "rng", "rng-bit-generator", "rng-get-and-update-state",
         "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
         "infeed", "outfeed", "send", "recv", "send-done", "recv-done"}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([a-z][\w\-]*)\((.*)$")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


def hlo_ops(hlo_text: str) -> dict[str, str]:
  """Every instruction of an HLO module's text mapped to its category (see the module's
  docstring): a fusion by the instructions of the computation it calls."""
  bodies, opcodes, fusion_calls, current = collections.defaultdict(set), {}, {}, None
  for line in hlo_text.splitlines():
    if (m := _COMPUTATION.match(line)) and "=" not in line.split("{")[0]:
      current = m.group(1)
      continue
    if (m := _INSTRUCTION.match(line)) is None:
      continue
    name, opcode, rest = m.groups()
    opcodes[name] = opcode
    bodies[current].add(opcode)
    if opcode == "fusion" and (c := _CALLS.search(rest)):
      fusion_calls[name] = c.group(1)
  return {name: category(opcode, bodies.get(fusion_calls.get(name), set()))
          for name, opcode in opcodes.items()}


def category(opcode: str, fused: set[str]) -> str | None:
  """The category of an op with ``opcode`` whose fused computation (if a fusion) holds the
  opcodes ``fused``; None for a container, whose body's ops are counted instead."""
  kinds = fused if opcode == "fusion" else {opcode}
  if opcode in CONTAINERS:
    return None
  if kinds & {"dot", "convolution"}:
    return "matmul"
  if kinds & {"dynamic-update-slice", "scatter"}:
    return "dynamic-update-slice"
  if kinds & {"dynamic-slice", "slice", "gather"}:
    return "dynamic-slice / slice"
  if kinds <= {"copy", "transpose", "parameter", "bitcast", "reshape", "broadcast"}:
    return "copy / transpose"
  if opcode in OTHER:
    return "other"
  return "elementwise / reduce"


def trace_events(trace_dir: pathlib.Path) -> list[dict]:
  """The complete ("X") events of the Perfetto trace that ``jax.profiler.trace`` wrote."""
  files = sorted(trace_dir.rglob("perfetto_trace.json.gz"))
  if not files:
    raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
  with gzip.open(files[-1], "rt") as f:
    data = json.load(f)
  events = data["traceEvents"] if isinstance(data, dict) else data
  return [e for e in events if e.get("ph") == "X" and "dur" in e]


def summarize(events: list[dict], categories: dict[str, str]) -> tuple[dict, list]:
  """Seconds per category of the events named like an HLO instruction, and per op."""
  per_category, per_op = collections.Counter(), collections.Counter()
  for e in events:
    name = e.get("name", "")
    if categories.get(name) is None:
      continue
    per_category[categories[name]] += e["dur"] / 1e6
    per_op[name] += e["dur"] / 1e6
  return dict(per_category), per_op.most_common(12)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--response-length", type=int, default=32)
  parser.add_argument("--prompt-length", type=int, default=44)
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  parser.add_argument("--matmul-size", type=int, default=4096)
  parser.add_argument("--trace-dir", type=pathlib.Path, default=None,
                      help="keep the trace there (default: a temporary directory)")
  args = parser.parse_args()
  hostmem.reexec_with_huge_pages()
  defaults = dict(remat=False, unrolled=False, old_logprobs="recompute",
                  reuse_update_forward=True, lora=0)
  config_args = argparse.Namespace(**vars(args), **defaults)
  with tempfile.TemporaryDirectory() as tmp:
    ppo_step.write_models(tmp, args.batch, args.prompt_length, peers=False)
    run = build_lib.build(ppo_step.make_config(config_args, f"{tmp}/reward"))
  prompts = ppo_step.make_prompts(run.policy.tokenizer, args.batch, args.prompt_length)
  state = run.state
  for _ in range(2):  # compile, then one warm iteration
    state, _, _, _ = runner.iteration(run, state, prompts)
  # this VM's speed drifts within minutes: the peak sampled just before and just after the trace
  peaks = [ppo_step.matmul_peak(jnp.float32, args.matmul_size)]
  trace_dir = args.trace_dir or pathlib.Path(tempfile.mkdtemp(prefix="ppojax-trace-"))
  with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
    t0 = time.perf_counter()
    state, _, rollout, _ = runner.iteration(run, state, prompts)
    wall = time.perf_counter() - t0
  ppo_step.check_rollout(rollout, args.response_length)  # the traced responses: exact length
  peaks.append(ppo_step.matmul_peak(jnp.float32, args.matmul_size))
  peak = sum(peaks) / 2
  # the executable the calls ran (JAX's cache: no second compile), for its instructions' names
  compiled = run.step.fused.lower(state, run.frozen, prompts).compile()
  per_category, top = summarize(trace_events(trace_dir), hlo_ops(compiled.as_text()))

  shared = len(prompts.prefix)
  single = update_lib.single_pass(run.config.rl)
  flops = sum(ppo_step.iteration_flops(
      run.policy.cfg, args.batch, args.prompt_length, args.response_length,
      old_logp_fwd=not single, critic_fwd=not single, shared=shared).values())
  matmul_s = per_category.get("matmul", 0.0)
  print(f"device: {jax.devices()[0].device_kind}, {os.cpu_count()} CPUs, jax {jax.__version__};"
        f" {args.dtype}; batch {args.batch}, prompts {args.prompt_length}, responses "
        f"{args.response_length}; float32 matmul peak {peak:.1f} GFLOP/s (before / after the "
        f"trace: {peaks[0]:.1f} / {peaks[1]:.1f})")
  print(f"traced iteration: {wall:.2f} s; model FLOPs {flops / 1e12:.3f} TFLOP")
  for name, s in sorted(per_category.items(), key=lambda kv: -kv[1]):
    print(f"  {name:<24}{s:>8.2f} s")
  if matmul_s:
    print(f"matmuls: {flops / matmul_s / 1e9:.1f} GFLOP/s, {flops / matmul_s / 1e9 / peak:.1%}"
          f" of the peak")
  print("costliest ops:")
  for name, s in top:
    print(f"  {name:<40}{s:>8.3f} s")
  summary = {"wall_seconds": round(wall, 3), "seconds_by_category": {
      k: round(v, 3) for k, v in per_category.items()}, "model_tflop": round(flops / 1e12, 4),
      "matmul_gflops": round(flops / matmul_s / 1e9, 1) if matmul_s else None,
      "matmul_peak_gflops": round(peak, 1),
      "matmul_peak_samples": [round(x, 1) for x in peaks],
      "top_ops": [[n, round(s, 4)] for n, s in top],
      "checked_lengths": True}  # check_rollout raised otherwise
  print(json.dumps(summary))


if __name__ == "__main__":
  main()
