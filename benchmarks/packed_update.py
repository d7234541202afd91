"""The learn phase with packed rows vs padded rows (``rl.pack_fractions``), side by side in one
run, on responses whose lengths have a long tail.

Table: docs/performance/cpu.md, "Packed vs padded update: `benchmarks/packed_update.py`".

    python benchmarks/packed_update.py [--config configs/grpo_arith.py] [--batch 16]
        [--response-length 128] [--median-length 24] [--pack-fractions 0.5 ...] [--iterations 3]
        [--small]

One GRPO rollout of configs/grpo_arith.py (SmolLM2-135M-Instruct, the arithmetic task's
chat-templated prompts, ``--batch`` rows, float32, the single-pass update) is sampled once at
``--response-length`` tokens; then each row's response is cut to a length drawn from a
log-normal distribution with median ``--median-length`` (σ = 0.8, seed 0), clipped to
[1, ``--response-length``]: most responses short, a few at the limit (those lose their stop
token: truncated). The same rollout and scores then go through two compiled ``learn`` steps
built from the same config and weights, one padded (``rl.pack_fractions = ()``) and one packed
(``--pack-fractions``: the fewest rows of the list that hold the batch), their calls
interleaved so that load drift hits both alike: ``padded_seconds`` and ``packed_seconds``
(medians of ``--iterations`` calls after a warm-up that compiles), ``speedup`` (padded /
packed), whether the packed step really ran packed (``update/packed``) and in how many rows
(``packed_rows``), the slots' fill, and each side's model FLOPs of the policy's forward and
backward (``update_tflop``) with the GFLOP/s they ran at.
The two steps' losses and gradient norms must agree (``max_relative_diff``). ``--small``: a tiny
random model instead of SmolLM2, packed one sequence per row (a check of the script, not a
figure). The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from ppojax.infra import flops
from ppojax.run import build as build_lib

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from algorithms import cpu_name  # noqa: E402
from ppo_step import matmul_peak  # noqa: E402

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"


def make_config(args, fractions: tuple):
  overrides = {"rl__batch_size": args.batch // args.samples, "rl__pack_fractions": fractions,
               "sampling__num_samples_per_prompt": args.samples,
               "sampling__max_new_tokens": args.response_length, "rl__num_epochs": 1,
               "rl__num_minibatches": 1, "rl__grad_accum": 1}
  if args.small:
    overrides.update(model__policy="tiny", data__task="count", reward__kind="jax",
                     reward__fn="ppojax.tasks.count:count_reward", sampling__stop_ids=[0],
                     sampling__pad_id=0)
  return build_lib.load_config(pathlib.Path(args.config), **overrides)


def long_tail(r, args, pad_id: int):
  """The rollout with each response cut to a log-normal length (median ``--median-length``):
  tokens after it become padding; one cut at the limit keeps no stop token."""
  rng = np.random.RandomState(0)
  b, big_r = r.responses.shape
  lengths = np.clip(np.round(rng.lognormal(np.log(args.median_length), 0.8, b)), 1, big_r)
  mask = np.arange(big_r)[None] < lengths[:, None]
  responses = np.where(mask, np.asarray(r.responses), pad_id)
  cut = lambda x: None if x is None else jnp.where(mask, x, 0.0)  # noqa: E731
  return r._replace(responses=jnp.asarray(responses, jnp.int32), mask=jnp.asarray(mask),
                    has_stop=jnp.asarray(lengths < big_r), old_logp=cut(r.old_logp),
                    ref_logp=cut(r.ref_logp), sampler_logp=cut(r.sampler_logp)), lengths


def update_tflop(cfg, rows: int, length: int, head_slots: int) -> float:
  """Model TFLOP of the policy's forward and backward (3× the forward; ``infra/flops.py``'s
  convention) over ``rows`` rows of ``length`` tokens, each attending to all earlier slots of
  its row (a packed row's masked scores are computed too), the LM head on ``head_slots``
  positions (padded: the B·R response positions; packed: every slot). A shared prefix runs
  once for the batch either way and is left out."""
  attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * length * (length + 1) / 2
  forward = rows * (2 * flops.body_params(cfg) * length + attn) + (
      2 * cfg.hidden_size * cfg.vocab_size * head_slots)
  return 3 * forward / 1e12


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default=str(CONFIGS / "grpo_arith.py"))
  parser.add_argument("--batch", type=int, default=16, help="rows (prompts × samples)")
  parser.add_argument("--samples", type=int, default=4)
  parser.add_argument("--response-length", type=int, default=128)
  parser.add_argument("--median-length", type=float, default=24)
  parser.add_argument("--pack-fractions", type=float, nargs="+", default=[0.5])
  parser.add_argument("--iterations", type=int, default=3)
  parser.add_argument("--small", action="store_true")
  args = parser.parse_args(argv)
  if args.small:
    args.response_length, args.median_length = min(args.response_length, 6), 2
    args.pack_fractions = [1.0]  # toy rows are too short for two sequences: pack one per row
  packed_key = tuple(args.pack_fractions)
  runs = {f: build_lib.build(make_config(args, f)) for f in ((), packed_key)}
  padded_run = runs[()]
  prompts = padded_run.source.batch(0).prompts
  r = padded_run.step.rollout(padded_run.state, padded_run.frozen, prompts)
  r, lengths = long_tail(r, args, padded_run.sampling.pad_id)
  scores = jnp.asarray(np.random.RandomState(1).randint(0, 2, r.mask.shape[0]), jnp.float32)

  def call(run):  # (seconds, metrics): the state is donated, so a copy goes in
    state = jax.block_until_ready(jax.tree.map(jnp.copy, run.state))
    start = time.perf_counter()
    _, metrics = jax.block_until_ready(run.step.learn(state, r, scores))
    return time.perf_counter() - start, jax.device_get(metrics)

  warm = {f: call(run)[0] for f, run in runs.items()}
  times, last = {f: [] for f in runs}, {}
  for _ in range(args.iterations):
    for f, run in runs.items():
      seconds, last[f] = call(run)
      times[f].append(seconds)
  padded_metrics, packed_metrics = last[()], last[packed_key]
  # the losses and gradient norm of the two forms (Adam's first step is sign(g)·lr, so the
  # parameters alone would hide a wrong gradient)
  diff = {k: abs(float(packed_metrics[k]) - float(padded_metrics[k]))
          / max(abs(float(padded_metrics[k])), 1e-12)
          for k in ("loss/policy_avg", "loss/total_avg", "policy/grad_norm_avg")}

  b, length = r.prompts.shape[0], r.prompts.shape[1] + r.responses.shape[1] - (
      0 if r.prefix is None else r.prefix.shape[0])
  rows = round(float(packed_metrics["update/pack_rows_avg"]) * b)  # the rows that ran
  cfg = padded_run.models.policy.cfg
  tflop = {"padded": update_tflop(cfg, b, length, b * r.responses.shape[1]),
           "packed": update_tflop(cfg, rows, length, rows * length)}
  padded_s, packed_s = (statistics.median(times[f]) for f in ((), packed_key))
  out = {
      "benchmark": "packed_update", "model": "tiny" if args.small else "smollm2",
      "rows": b, "row_length": length,
      "packed_rows": rows, "response_length": args.response_length,
      "mean_response_length": float(np.mean(lengths)),
      "max_response_length": int(np.max(lengths)),
      "truncated_fraction": float(np.mean(lengths >= args.response_length)),
      "slot_fill_padded": float(jnp.sum(r.mask) + jnp.sum(r.prompt_mask)
                                - b * (0 if r.prefix is None else r.prefix.shape[0])) / (b * length),
      "slot_fill_packed": float(packed_metrics["update/pack_fill_avg"]),
      "ran_packed": float(packed_metrics["update/packed_avg"]),
      "padded_seconds": padded_s, "packed_seconds": packed_s,
      "speedup": padded_s / packed_s,
      "pack_fractions": list(packed_key), "padded_times": times[()],
      "packed_times": times[packed_key],
      "compile_and_first_seconds": {"padded": warm[()], "packed": warm[packed_key]},
      "update_tflop_padded": tflop["padded"], "update_tflop_packed": tflop["packed"],
      "flop_ratio": tflop["padded"] / tflop["packed"],
      "gflops_padded": 1e3 * tflop["padded"] / padded_s,
      "gflops_packed": 1e3 * tflop["packed"] / packed_s,
      "max_relative_diff": max(diff.values()), "compared": sorted(diff), "cpu": cpu_name(),
      "fp32_matmul_gflops": matmul_peak(jnp.float32, 256 if args.small else 2048),
      "jax": jax.__version__, "commit": subprocess.run(
          ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
          check=False).stdout.strip(),
  }
  print(json.dumps(out))
  return out


if __name__ == "__main__":
  main()
