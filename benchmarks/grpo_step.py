"""Seconds per GRPO iteration of ppojax and of trl's ``GRPOTrainer`` (0.17 and 1.16), in one run.

Tables: docs/performance/peers.md, "GRPO iteration vs trl: `benchmarks/grpo_step.py`", "trl 1.16
beside trl 0.17" and "GRPO vs tunix: `benchmarks/grpo_step.py --tunix`".

SmolLM2-135M-Instruct (``model.policy = "smollm2"``) is the policy and, frozen, the reference.
The task is ppojax's arithmetic (``ppojax.tasks.arith``): ``--prompts`` two-digit problems from the
training split ("What is 23 + 45?"), each chat-templated to exactly 40 tokens, so neither side
pads; ``--samples`` responses per prompt, each exactly ``--response-length`` tokens at
temperature ``--temperature`` (min_new_tokens = max_new_tokens on both sides, as in
``ppo_step.py``); the reward is ``ppojax.tasks.arith.reward``, a Python function of the decoded text
(exact match of the last number, + 0.1 for ending on a number); KL coefficient ``--kl-coef``
against the reference; one optimizer step per batch (1 epoch, 1 minibatch, no accumulation):

    python benchmarks/grpo_step.py [--prompts 16] [--samples 4] [--response-length 32]
        [--iterations 3] [--warmup 1] [--no-shared-prefix] [--no-equal-work] [--no-trl]
        [--trl-versions 0.17 1.16 1.16-shipped] [--trl-env DIR] [--trl116-env DIR] [--tunix]
        [--tunix-env DIR] [--ppo-rss]

What one ppojax iteration runs (``runner.iteration`` with a host reward: three compiled
functions and a host round trip; ``config.algorithm = "grpo"``, float32):

* rollout: one prefill per prompt (the chat template's 24-token header once per batch unless
  ``--no-shared-prefix``), its KV cache repeated for the ``--samples`` samples, R − 1 decode
  steps; the reference's forward over the B·n rows (log-probs at temperature T). No old
  log-probs pass: the single-pass update takes them from its own forward at the same params;
* scoring: decode the completions on the host and call the reward function;
* update: group advantages (r − mean) / (std + 1e-6), the policy's forward and backward
  (clipped ratio loss + β·k3 KL, sequence mean of token means), gradient clipping at norm 1
  and one AdamW step (weight decay 0).

trl's iteration (``benchmarks/peers/trl_grpo.py``, in trl's own environment, ``trl_ppo.ensure_env``)
runs under each version of ``--trl-versions`` (default both: trl 0.17 with transformers 4.51 in the
environment ``--trl-env``, trl 1.16 with transformers 5.25 in ``--trl116-env``; each made under
``~/.cache/ppojax`` on first use; ``grpo_peers.py`` runs them), one after the other, each in its own
process, on the same weights, prompt ids and settings. Both versions run the same passes
(``trl_grpo.py``'s docstring lists what trl 1.16 changed and what it sets to run 0.17's work:
``loss_type`` "grpo", no gradient checkpointing, the KL term without 1.16's importance-ratio factor,
the fused LM head on the completion positions only), with these differences from ppojax: it prefills
each of the B·n rows in full (no prefill shared by a prompt's samples, no shared header); its group
advantages divide by std + 1e-4 (ppojax: + 1e-6); its decode is Hugging Face ``generate`` with a
dynamic KV cache; trl 1.16's fused LM head recomputes its projection in the backward and computes
the entropy. Like ppojax it runs no old log-probs pass (trl computes them only when num_iterations >
1, or with vLLM; its ratio's denominator is the update's own detached log-probs) and it runs the LM
head on the completion positions only in the reference forward and the update (0.17:
``logits_to_keep``; 1.16: its fused LM head, as on CUDA, see ``trl_grpo.py``). Both clip the
gradient at norm 1 and take one AdamW step with weight decay 0 at a constant lr; both run float32 on
every core. trl runs in a subprocess before ppojax builds anything, so the two processes' memory
never adds up. trl 1.16 has no PPO trainer, so ``ppo_step.py``'s trl peer stays trl 0.17.

``--tunix`` (off by default) also times Google's tunix 0.1.7 ``GRPOLearner`` on the same weights,
prompt ids, lengths, temperature, β and reward (``benchmarks/peers/tunix_grpo.py``, in the
environment of ``tunix_ppo.ensure_env``, run likewise in a subprocess first; its docstring lists
what differs): ``tunix_seconds_per_iteration``, ``tunix_ratio`` (tunix / ppojax) and
``tunix_peak_rss_mb`` in the JSON line. ``TUNIX_RSS_LIMIT_MB`` stops it at that resident set.

Equal work (``--equal-work``, the default while a peer runs): ppojax's default runs the chat
header once per batch (shared prefix), which neither peer does, so the run also times ppojax
with ``--no-shared-prefix`` (every row whole), in a fresh process before this one builds
anything. Both peers' remaining difference in work, each of the B·n rows prefilled in full
where ppojax prefills each prompt once for its samples, has no ppojax flag (it is the
prefill of the 40 prompt tokens, n − 1 times per prompt). Each row is printed with its
seconds, model FLOPs (``flops.model_flops``: the reference forward and the update, no critic
or reward model) and peak memory; the JSON line's ``rows`` lists them and its flat keys name
each ratio's pair: ``ratio_vs_trl_default`` / ``ratio_vs_trl_equal_work`` (peer seconds /
ppojax seconds) and ``memory_vs_trl_default`` / ``memory_vs_trl_equal_work`` (ppojax peak /
peer peak), likewise for trl 1.16 (``..._vs_trl116_...``) and tunix; ``speedup`` (trl 0.17),
``trl116_ratio`` and ``tunix_ratio`` stay the default row's.

The JSON's keys per peer (``grpo_peers.py``): trl 0.17 keeps the keys of the figures taken
before trl 1.16 (``trl_seconds_per_iteration``, ``speedup``, ``trl_peak_rss_mb``,
``trl_mean_reward``, its whole JSON under ``trl``, its trl / transformers / torch versions flat
in ``versions``); trl 1.16 has the same under the prefix ``trl116`` (``trl116_seconds_per_iteration``,
``trl116_ratio``, ``trl116_peak_rss_mb``, ``trl116_mean_reward``, ``trl116``,
``versions.trl116``); "1.16-shipped" (in the default ``--trl-versions``) runs trl 1.16 a second
time as a user gets it on a CPU, its LM head over every position (``--all-positions-lm-head``),
under the prefix ``trl116_shipped``; ``trl_versions`` lists the versions run. A peer not run has
None.
Every response must be exactly ``--response-length`` tokens on every side: ppojax checks each
iteration's rollout, ``trl_grpo.py`` and ``tunix_grpo.py`` theirs, and a length that differs
ends the run.

Timing: ppojax's first ``--warmup`` iterations (the first compiles) are not counted, nor are
trl's; ``seconds_per_iteration`` is the median of the next ``--iterations``, each from the
start of sampling to the end of the update (metrics copied to the host). ``peak_rss_mb`` is
this process's peak resident set (``VmHWM``: ``hostmem.peak_rss_mb``) after the timed
iterations (the model's load and Hugging Face export included); ``trl_peak_rss_mb`` and
``trl116_peak_rss_mb`` the trl processes'. ``--ppo-rss`` also runs one PPO
iteration of configs/quickstart.py's shape (32 prompts × 32 tokens, critic, 4 minibatches) in a
fresh process and reports its ``VmHWM`` as ``ppo_quickstart_peak_rss_mb``. The last line is
a JSON object. Like the CLI, the script restarts itself once with glibc's huge-page tunable
(``ppojax.infra.hostmem``; ``PPOJAX_HUGE_PAGES=0``: off).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from importlib import metadata

import jax
import numpy as np

from ppojax.infra import hostmem
from ppojax.infra.flops import model_flops
from ppojax.learner import update as update_lib
from ppojax.models import load_model
from ppojax.run import build as build_lib
from ppojax.run import runner
from ppojax.tasks import arith

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "peers"))  # the peers' sides
# pylint: disable=wrong-import-position
import grpo_peers  # noqa: E402
import scale_table  # noqa: E402
from ppo_step import (  # noqa: E402
  CONFIGS,
  check_rollout,
  comparisons,
  make_prompts,
  plan_rows,
  print_rows,
  row_name,
  run_json,
)

PROMPT_LENGTH = 40  # a two-digit problem through SmolLM2's chat template
# The ppojax flag under which it runs each peer's passes (as far as a flag reaches: see the
# docstring): every row whole.
EQUAL_WORK = {peer: {"shared_prefix": False} for peer in grpo_peers.RATIO_KEYS}
ROW_FLAGS = ("shared_prefix",)
ROW_RESULTS = ("seconds_per_iteration", "iterations", "model_tflop_per_iteration",
               "whole_rows_tflop_per_iteration", "peak_rss_mb", "warmup_seconds")


def quickstart_config():
  spec = importlib.util.spec_from_file_location("quickstart_config", CONFIGS / "quickstart.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def make_config(args):
  """configs/quickstart.py (SmolLM2, the arithmetic task, ``ppojax.tasks.arith:reward`` as a text
  reward, temperature 0.7) as GRPO with the benchmark's sizes."""
  c = quickstart_config()
  c.algorithm = "grpo"
  c.num_iterations = 1000  # only sizes the lr schedule
  c.phase_timing = False
  c.sample_every = 0
  c.data.shared_prefix = args.shared_prefix
  c.sampling.temperature = args.temperature
  c.sampling.max_new_tokens = args.response_length
  c.sampling.min_new_tokens = args.response_length  # exactly R tokens: stop ids banned before
  c.sampling.num_samples_per_prompt = args.samples
  c.rl.batch_size = args.prompts
  c.rl.kl_coef = args.kl_coef
  c.rl.num_epochs = c.rl.num_minibatches = c.rl.grad_accum = 1
  c.optim.actor.update(lr=args.lr, warmup_steps=0, decay="constant")
  return c


def run_row(args, row: dict) -> dict:
  """ppojax's iteration under ``row``'s flags, with ``args``' sizes, in a fresh process (this
  script with ``--row-child``: no peers, no further rows): the JSON object it prints last."""
  cmd = [sys.executable, __file__, "--row-child", "--no-trl", "--no-tunix", "--no-equal-work",
         "--prompts", str(args.prompts), "--samples", str(args.samples), "--response-length",
         str(args.response_length), "--temperature", str(args.temperature), "--kl-coef",
         str(args.kl_coef), "--lr", str(args.lr), "--seed", str(args.seed), "--iterations",
         str(args.iterations), "--warmup", str(args.warmup),
         "--shared-prefix" if row["shared_prefix"] else "--no-shared-prefix"]
  return run_json(cmd, f"ppojax's {row_name(row)} row", "--no-equal-work")


def iteration_tflop(run, prompts: int, samples: int, response_length: int,
                    shared: int) -> float:
  """Model TFLOP of one GRPO iteration of ``run`` (``flops.model_flops``): the prefill over
  ``prompts`` (a ``shared``-token prefix once), the decode and the passes over prompts ×
  ``samples`` rows; a reference forward where the KL term needs it, no old log-probs forward in
  the single-pass update, no critic, no reward model."""
  rl = run.config.rl
  single = update_lib.single_pass(rl)
  flops = model_flops(run.policy.cfg, prompts, PROMPT_LENGTH, response_length,
                      old_logp_fwd=rl.old_logprobs == "recompute" and not single,
                      critic_fwd=False, shared=shared, samples=samples, critic=False,
                      reference=rl.kl_coef > 0, reward_model=False)
  return sum(flops.values()) / 1e12


def ppo_quickstart_rss() -> dict:
  """One PPO iteration of configs/quickstart.py's shape in this process (called in a fresh
  one by ``--ppo-rss``): its ``VmHWM`` and seconds (compile included)."""
  config = quickstart_config()
  config.sample_every = 0
  config.phase_timing = False
  run = build_lib.build(config)
  drawn = run.source.batch(0)
  t0 = time.perf_counter()
  state, _, _, _ = runner.iteration(run, run.state, drawn.prompts, drawn.records)
  jax.block_until_ready(state)
  return {"peak_rss_mb": hostmem.peak_rss_mb(),
          "first_iteration_seconds": time.perf_counter() - t0,
          "batch": config.rl.batch_size, "response_length": config.sampling.max_new_tokens,
          "num_minibatches": config.rl.num_minibatches}


def versions() -> dict:
  return {name: metadata.version(name) for name in ("jax", "jaxlib", "flax", "optax")}


def main():
  hostmem.reexec_with_huge_pages()  # as the CLI does (PPOJAX_HUGE_PAGES=0: off)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--prompts", type=int, default=16, help="prompts per iteration")
  parser.add_argument("--samples", type=int, default=4, help="samples per prompt")
  parser.add_argument("--response-length", type=int, default=32)
  parser.add_argument("--temperature", type=float, default=0.7)
  parser.add_argument("--kl-coef", type=float, default=0.04)
  parser.add_argument("--lr", type=float, default=3e-6)
  parser.add_argument("--seed", type=int, default=0, help="which arithmetic problems")
  parser.add_argument("--iterations", type=int, default=3, help="timed iterations per side")
  parser.add_argument("--warmup", type=int, default=1, help="untimed iterations per side first")
  parser.add_argument("--shared-prefix", action=argparse.BooleanOptionalAction, default=True,
                      help="data.shared_prefix (default): the chat template's header runs once "
                      "per batch; --no-…: every row whole")
  parser.add_argument("--equal-work", action=argparse.BooleanOptionalAction, default=True,
                      help="also time ppojax with every row whole (--no-shared-prefix) in a "
                      "fresh process, the peers' work (default)")
  parser.add_argument("--row-child", action="store_true", help=argparse.SUPPRESS)
  grpo_peers.add_arguments(parser)  # --[no-]trl, --trl-versions, --trl-env, ..., --tunix
  parser.add_argument("--ppo-rss", action="store_true", help="also the peak RSS of one PPO "
                      "iteration of configs/quickstart.py's shape, in a fresh process")
  parser.add_argument("--ppo-rss-child", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.ppo_rss_child:
    print(json.dumps(ppo_quickstart_rss()))
    return
  if args.warmup < 1:
    raise ValueError("--warmup must be at least 1: the first iteration compiles")
  b, n, r_len = args.prompts, args.samples, args.response_length

  problems = arith.problems(args.seed, b, "train", digits=(2,))
  policy = load_model("smollm2")
  prompts = make_prompts(policy.tokenizer, b, PROMPT_LENGTH, args.shared_prefix,
                         questions=[p["prompt"] for p in problems])
  if not np.asarray(prompts.mask).all():
    raise RuntimeError(f"a prompt is shorter than {PROMPT_LENGTH} tokens: the two sides would "
                       "pad differently")
  answers = [p["answer"] for p in problems]
  # first, while this process holds no compiled step or TrainState
  peers = grpo_peers.run_peers(args, policy, np.asarray(prompts.tokens), answers)
  del policy
  rows = plan_rows([None], vars(args), grpo_peers.peer_names(args), args.equal_work,
                   EQUAL_WORK, ROW_FLAGS)
  for row in rows[1:]:  # each in a fresh process, before this one builds
    print(f"ppojax row {row_name(row)} (shared_prefix={row['shared_prefix']}): a fresh "
          "process ...", flush=True)
    measured = run_row(args, row)
    row.update({k: measured[k] for k in ROW_RESULTS})
    print(f"ppojax row {row_name(row)}: {row['seconds_per_iteration']:.2f} s/iteration, "
          f"{row['model_tflop_per_iteration']:.3f} TFLOP, peak RSS {row['peak_rss_mb']:.0f} MB",
          flush=True)

  config = make_config(args)
  t0 = time.perf_counter()
  run = build_lib.build(config)
  build_s = time.perf_counter() - t0
  rl = run.config.rl  # resolved: the algorithm's fields filled in
  print(f"ppojax: {jax.devices()[0].device_kind}, {os.cpu_count()} CPUs, jax {jax.__version__}; "
        f"{b} prompts × {n} samples × {r_len} tokens; estimator {rl.estimator}, KL in the "
        f"{rl.kl_in} ({rl.kl_estimator}, β = {rl.kl_coef}), aggregation {rl.aggregation}; "
        f"shared prefix {0 if prompts.prefix is None else len(prompts.prefix)} tokens; build "
        f"{build_s:.1f} s; huge_pages={hostmem.huge_pages_active()}", flush=True)

  state, timed_rows, warm = run.state, [], []
  for i in range(args.warmup + args.iterations):
    state, metrics, rollout, _ = runner.iteration(run, state, prompts, problems)
    check_rollout(rollout, r_len)
    (warm if i < args.warmup else timed_rows).append(metrics)
  jax.block_until_ready(state)
  rss = hostmem.peak_rss_mb()
  times, warm_times = ([m["time/iteration"] for m in ms] for ms in (timed_rows, warm))
  seconds = statistics.median(times)
  phases = {k: statistics.median(m[f"time/{k}"] for m in timed_rows)
            for k in ("sampling", "scoring", "update")}
  shared = 0 if prompts.prefix is None else len(prompts.prefix)
  tflop = iteration_tflop(run, b, n, r_len, shared)
  whole_tflop = iteration_tflop(run, b, n, r_len, 0)
  print(f"ppojax: {seconds:.2f} s/iteration (median of {', '.join(f'{x:.2f}' for x in times)}; "
        f"warm-up {', '.join(f'{x:.1f}' for x in warm_times)} s, the first "
        f"compiles); sampling {phases['sampling']:.2f} s, scoring {phases['scoring']:.2f} s, "
        f"update {phases['update']:.2f} s; peak RSS {rss:.0f} MB; {tflop:.3f} model TFLOP "
        f"per iteration ({whole_tflop:.3f} with every row whole)", flush=True)

  quickstart = None
  if args.ppo_rss:
    proc = subprocess.run([sys.executable, __file__, "--ppo-rss-child"], capture_output=True,
                          text=True, check=False)
    if proc.returncode:
      raise RuntimeError(f"the quickstart PPO iteration failed (rc={proc.returncode}):\n"
                         f"{proc.stderr[-3000:]}")
    quickstart = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"ppojax PPO, configs/quickstart.py's shape, one iteration: peak RSS "
          f"{quickstart['peak_rss_mb']:.0f} MB", flush=True)

  reported = grpo_peers.summary(peers, seconds, rss)  # printed
  rows[0].update(seconds_per_iteration=seconds, iterations=times, warmup_seconds=warm_times,
                 model_tflop_per_iteration=tflop, whole_rows_tflop_per_iteration=whole_tflop,
                 peak_rss_mb=rss)
  by_critic = {name: {None: side} for name, side in peers.items()}
  ratios = comparisons(rows, by_critic)
  print_rows(rows, by_critic, ratios, ROW_FLAGS)
  versions_run = {**versions(), **reported.pop("versions")}
  print(json.dumps({
      "seconds_per_iteration": seconds, "iterations": times,
      "model_tflop_per_iteration": tflop, "whole_rows_tflop_per_iteration": whole_tflop,
      "equal_work": args.equal_work, "rows": rows, **ratios,
      "warmup_seconds": warm_times, "phases": phases, "peak_rss_mb": rss,
      "trl_versions": list(grpo_peers.trl_peers(args).values()), **reported,
      "ppo_quickstart_peak_rss_mb": None if quickstart is None else quickstart["peak_rss_mb"],
      "ppojax_mean_score": statistics.mean(m["objective/scores"] for m in timed_rows),
      "cpu": scale_table.cpu_name(), "cpus": os.cpu_count(),
      "device": jax.devices()[0].device_kind, "huge_pages": hostmem.huge_pages_active(),
      "versions": versions_run,
      "settings": {
          "model": "SmolLM2-135M-Instruct", "dtype": "float32", "prompts": b,
          "samples_per_prompt": n, "prompt_length": PROMPT_LENGTH,
          "shared_prefix_tokens": 0 if prompts.prefix is None else len(prompts.prefix),
          "response_length": r_len, "temperature": args.temperature, "kl_coef": args.kl_coef,
          "lr": args.lr, "estimator": rl.estimator, "kl_in": rl.kl_in,
          "kl_estimator": rl.kl_estimator, "aggregation": rl.aggregation,
          "epochs": 1, "minibatches": 1, "grad_accum": 1, "reward": "ppojax.tasks.arith:reward",
          "iterations": args.iterations, "warmup": args.warmup},
      "ppo_quickstart": quickstart}))


if __name__ == "__main__":
  main()
