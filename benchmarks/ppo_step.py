"""Seconds per PPO iteration of ppojax's compiled step, where the time goes, and the FLOP rate.

Tables: docs/performance/cpu.md, "The PPO iteration: `benchmarks/ppo_step.py`";
docs/performance/peers.md, "PPO iteration vs trl: `benchmarks/ppo_step.py`", "PPO iteration vs
tunix: `benchmarks/ppo_step.py --tunix`" and "LoRA PPO iteration vs trl + peft:
`benchmarks/ppo_step.py --lora 16`".

SmolLM2-135M-Instruct is policy, reference, reward model and critic (the reward model is the
policy's backbone with a zero score head, saved to a temporary Hugging Face directory by a child
process, so that its loading is not in this process's peak memory; the critic starts from
it). One epoch, one minibatch; chat prompts of exactly 44 tokens (the questions
below template to 44; shorter ones would be left-padded); every response is forced to exactly
``--response-length`` tokens (min_new_tokens = max_new_tokens), so the FLOP count below is exact:

    python benchmarks/ppo_step.py --batch 16 --response-length 32 [--iterations 3]
        [--dtype float32|bfloat16] [--remat] [--unrolled] [--no-shared-prefix] [--lora RANK]
        [--lora-critic lora|full|both] [--no-equal-work] [--no-trl] [--tunix]

Prints the compile time (first iteration minus the steady median), the median seconds per
iteration of the fused step (one compiled function), a median over the phase-timed path
(sampling / scoring / update, three compiled functions, warmed up first), peak host memory
(VmHWM), the model FLOPs of one iteration, the achieved GFLOP/s against the matmul peak (a
4096² float32 ``jnp.dot``, sampled between the timed iterations of the same run), and trl 0.17's
``PPOTrainer`` on the same models, prompts and settings, timed in the same run (before ppojax's
step, in a subprocess: ``benchmarks/peers/trl_ppo.py``, in a virtual environment of its own that the
first ``--trl`` run creates under ``~/.cache/ppojax``; ``--no-trl`` skips it; trl 1.16, the
second trl peer of ``grpo_step.py``, has no PPO trainer: trl 1.13 removed
``trl.experimental.ppo``). ``--tunix`` also
times Google's tunix ``PPOLearner`` on the same models, prompts and lengths in the same run
(``benchmarks/peers/tunix_ppo.py``, in its own environment under ``~/.cache/ppojax``; its
docstring lists what differs) and prints its figure and the ratio beside trl's. The last line is a
JSON object. Like the CLI, the script restarts itself once with glibc's huge-page tunable
(``ppojax.infra.hostmem``; ``PPOJAX_HUGE_PAGES=0``: off).

Equal work (``--equal-work``, the default while a peer runs): ppojax's defaults do less work
than the peers do. The chat header runs once per batch (shared prefix) and the single-pass
update takes the old log-probs and values from its own forward, where trl and tunix run every
row whole and a critic forward in the rollout. So the run also times ppojax doing each peer's
passes, in a fresh process before this one builds anything (the two never hold memory at
once): for trl ``--no-shared-prefix --no-reuse-update-forward --old-logprobs sampler`` (trl
takes log π_old from its generation's logits: no policy forward for it), for tunix
``--no-shared-prefix --no-reuse-update-forward --old-logprobs recompute`` (tunix recomputes
them in a forward). A row that the default already is (those flags given) is not run twice.
Each row is printed with its seconds, model FLOPs, peak memory and ratio to each peer it is
compared with; the JSON line's ``rows`` lists them, and its flat keys name each ratio's pair:
``ratio_vs_trl_default`` / ``ratio_vs_trl_equal_work`` (peer seconds / ppojax seconds) and
``memory_vs_trl_default`` / ``memory_vs_trl_equal_work`` (ppojax peak / peer peak), likewise
for tunix. The older flat keys (``seconds_per_iteration``, ``trl_ratio``, ...) are the default
row's.

``--lora RANK``: the policy trains LoRA adapters of that rank (alpha ``--lora-alpha``) on every
linear layer of the blocks, the reference being the frozen base; trl's side wraps its policy
with peft's ``LoraConfig`` of the same rank, alpha and layers (``ref_model=None``: its
reference is the policy with adapters off; its reward model stays full). The critic follows
``--lora-critic``:

* ``lora``: both sides train a LoRA critic: ppojax's ``lora.critic`` (adapters of the same rank
  and layers on the policy's frozen base, plus its value head, trained in full), trl's value
  model with peft's adapters of the same rank, alpha and layers injected and its ``score``
  head trainable, the rest frozen (``trl_ppo.py --lora-critic``);
* ``full``: both sides train a full critic (ppojax ``lora.critic = False``, started from the
  reward model as trl's is);
* ``both`` (default): the two pairs in one run, each with its own trl figure; the flat keys
  then carry the pair, e.g. ``ratio_vs_trl_lora_critic_default``,
  ``memory_vs_trl_full_critic_equal_work``.

ppojax's full fine-tuning iteration then runs once in a fresh process for its peak memory
(``full``), and ``checkpoint_mb`` (the bytes of the state a checkpoint holds: no frozen base)
is compared with it. The FLOP count takes the update's backward as activation gradients only
where adapters train (no weight gradients; ``flops.model_flops(lora=True)``), a full critic's
with its weight gradients.

Every response must be exactly ``--response-length`` tokens long on every side: ppojax checks
each iteration's rollout, ``trl_ppo.py`` and ``tunix_ppo.py`` their own, and a length that
differs ends the run (``peer_env.check_lengths``).

Model FLOPs (multiply-add = 2 FLOPs), from the model config: d = hidden_size, f =
intermediate_size, L = num_layers, H / H_kv = num_heads / num_kv_heads, D = head_dim, V =
vocab_size; B rows, P prompt slots (padding included: it is computed), R response tokens,
T = P + R.

    N_body   = L·(d·H·D + 2·d·H_kv·D + H·D·d + 3·d·f)   matmul parameters per token (q, k, v, o,
                                                          gate, up, down; the embedding lookup
                                                          is not a matmul)
    N_lm     = d·V (tied embeddings: the LM head),  N_score = d (the 1-wide value/score head)
    attn(c)  = 4·L·H·D·c  per token that attends to c positions (q·kᵀ and probs·v); a token at
               0-based position i of a causal sequence attends to c = i + 1 positions

    full(head, n_head) = B·[2·N_body·T + 2·head·n_head + Σ_{i<T} attn(i + 1)]

    generation = B·[2·N_body·P + 2·N_lm·1 + Σ_{i<P} attn(i + 1)]         prefill (ppojax runs
                                                                          the LM head on the
                                                                          last prompt slot only)
               + Σ_{t<R−1} B·[2·(N_body + N_lm) + attn(P + t + 1)]         R − 1 decode steps
                                                                          (the prefill gives
                                                                          token 0; the last
                                                                          token is not fed)
    policy     = full(N_lm, R)      old log-probs, reference log-probs, and the update's forward
                                    (ppojax's scoring passes run the LM head on the R response
                                    positions only)
    value      = full(N_score, T)   critic in the rollout, reward model, the update's forward
    iteration  = generation + 2·policy + 2·value                        (rollout + scoring)
               + 3·policy + 3·value                                     (update: backward = 2×
                                                                         forward)

The issue's reference figure, about 2.9 TFLOP for 16 × (44 + 32) tokens, is this count without
the LM head (2 × non-embedding parameters per token, the Kaplan convention): 2.87 TFLOP. The LM
head (d·V = 28 M of SmolLM2's 135 M matmul parameters) adds 0.17 TFLOP where ppojax runs it (the
prefill's last slot, the decode steps, the R response positions of five policy passes): 3.05
TFLOP; on every position, as a plain Hugging Face forward, it would be 3.28 TFLOP.

The rollout terms are what ``--no-reuse-update-forward`` runs (``rl.reuse_update_forward =
False``). By default the benchmark's 1 epoch × 1 minibatch update is a single pass
(``step.single_pass``): its own forward gives the old values and the old log-probs, and the
rollout runs neither the critic nor the policy forward (1·policy + 1·value fewer: 2.49 TFLOP).
With --old-logprobs sampler (``rl.old_logprobs = "sampler"``) log π_old comes from the
sampler, as in trl's PPOTrainer, so the rollout has no policy forward either way (two-pass:
2.76 TFLOP; single-pass: 2.49).

With a shared prefix of C tokens (the chat template's header and system prompt, 24 of the 44
prompt tokens here; ``data.shared_prefix``, on by default as in the CLI) every pass runs those C
tokens once for the batch: B·T token-rows become C + B·(T − C), i.e.

    full(head, n_head) = B·[2·N_body·(T − C) + 2·head·n_head + Σ_{C≤i<T} attn(i + 1)]
                         + 2·N_body·C + Σ_{i<C} attn(i + 1)

(value: n_head = T − C) and the prefill likewise (plus the LM head on the prefix's last slot,
which its separate prefill computes). The JSON's
``model_tflop_per_iteration`` and ``achieved_gflops`` count what ppojax runs;
``whole_rows_tflop_per_iteration`` and ``effective_gflops`` the same iteration with every row
run whole (C = 0, what trl runs): the rate a step without the prefix would need to match ours.
Here C = 24 takes the default single-pass iteration from 2.49 to 1.80 TFLOP.

With --remat the backward recomputes each layer's forward: more work for the hardware, the same
model FLOPs; trl's side then runs with transformers' gradient checkpointing on its policy and
value model, and ``--lora``'s full fine-tuning process with --remat too. Decode attention in
ppojax reads all P + R − 1 cache slots (masked), and elementwise work (norms, softmax, RoPE,
sampling, losses, Adam) is not counted.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ppojax.data.batch import Prompts, with_prefix
from ppojax.data.encoding import template_prefix
from ppojax.infra import hostmem
from ppojax.infra.flops import model_flops
from ppojax.learner import update as update_lib
from ppojax.models import load_model, save_model
from ppojax.run import build as build_lib
from ppojax.run import runner

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "peers"))  # the peers' sides
# pylint: disable=wrong-import-position
import peer_env  # noqa: E402
import trl_ppo  # noqa: E402
import tunix_ppo  # noqa: E402

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
# Chat prompts whose templated length is exactly 44 SmolLM2 tokens (default system prompt
# included); shorter ones would be left-padded.
QUESTIONS = [
    "What is 17 + 25? Explain your steps.",
    "Why is the sky blue? Keep the answer short and very precise.",
    "Write a haiku about autumn leaves falling on a very quiet lake.",
    "How do bees make honey? Answer in two or three short sentences.",
]
REFERENCE_TFLOP = 2.9  # the figure for 16 × (44 + 32) tokens


# ---------------------------------------------------------------------------------------------
# Setup
# ---------------------------------------------------------------------------------------------


def make_config(args, reward_dir: str):
  spec = importlib.util.spec_from_file_location("toy_config", CONFIGS / "toy.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config()
  c.num_iterations = 1000  # only sizes the lr schedules
  c.phase_timing = False
  c.model.policy = "smollm2"
  c.model.reward = reward_dir
  c.model.critic_init = "reward"
  c.model.dtype = args.dtype
  c.model.remat = args.remat
  c.model.scan_layers = not args.unrolled
  c.reward.kind = "model"
  c.sampling.max_new_tokens = args.response_length
  c.sampling.min_new_tokens = args.response_length  # exactly R tokens: stop ids banned before
  c.sampling.stop_ids = []  # the model's eos
  c.sampling.pad_id = None
  c.rl.batch_size = args.batch
  c.rl.num_epochs = 1
  c.rl.num_minibatches = 1
  c.rl.grad_accum = 1
  c.rl.old_logprobs = args.old_logprobs
  c.rl.reuse_update_forward = args.reuse_update_forward
  if args.lora:  # adapters on every linear layer; with a LoRA critic, on the same frozen base
    lora_critic = args.lora_critic == "lora"
    c.lora.update(rank=args.lora, alpha=args.lora_alpha, targets="all-linear",
                  critic=lora_critic)
    if lora_critic:  # the same backbone as the reward model's (its zero head)
      c.model.critic_init = "policy"
  for name in ("actor", "critic"):  # a realistic fine-tuning lr: the weights stay finite
    c.optim[name].lr = 3e-6
    c.optim[name].warmup_steps = 0
    c.optim[name].decay = "constant"
  return c


def write_models(directory: str, batch: int, prompt_length: int, peers: bool) -> None:
  """DIR/reward: SmolLM2 with a zero score head; with ``peers`` also DIR/policy and
  DIR/prompts.json, the batch's prompt tokens (``make_prompts``), for trl's and tunix's runs."""
  save_model(f"{directory}/reward", load_model("smollm2", head="value"))
  if peers:
    policy = load_model("smollm2")
    save_model(f"{directory}/policy", policy)
    tokens = np.asarray(make_prompts(policy.tokenizer, batch, prompt_length).tokens).tolist()
    pathlib.Path(f"{directory}/prompts.json").write_text(json.dumps(tokens))


def make_prompts(tokenizer, batch: int, length: int, shared_prefix: bool = True,
                 questions: Sequence[str] = QUESTIONS) -> Prompts:
  """The batch's left-padded chat prompts (``questions``, cycled, as user messages), with the
  chat template's header as their shared prefix (``Prompts.prefix``) as the CLI's data sources
  give them, unless ``shared_prefix`` is False."""
  texts = [tokenizer.apply_chat_template(
      [{"role": "user", "content": questions[i % len(questions)]}], tokenize=False,
      add_generation_prompt=True) for i in range(batch)]
  rows = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
  if max(map(len, rows)) > length:
    raise ValueError(f"a templated prompt is longer than {length} tokens")
  tokens = np.full((batch, length), tokenizer.pad_token_id, np.int32)
  mask = np.zeros((batch, length), bool)
  for i, row in enumerate(rows):
    tokens[i, length - len(row):], mask[i, length - len(row):] = row, True
  prompts = Prompts(tokens, mask)
  if shared_prefix:
    prompts = with_prefix(prompts, template_prefix(tokenizer))
    if prompts.prefix is None:
      raise RuntimeError("the prompts do not all begin with the chat template's header")
  return prompts


# ---------------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------------


PHASE_PARTS = {
    "sampling": ("generation (prefill)", "generation (decode)", "old log-probs (policy fwd)",
                 "reference log-probs (fwd)", "critic values (fwd)"),
    "scoring": ("reward model (fwd)",),
    "update": ("policy fwd+bwd", "critic fwd+bwd"),
}


def iteration_flops(cfg, batch: int, prompt_len: int, response_len: int, *, lora: bool = False,
                    lora_critic: bool = True, **kw) -> dict[str, float]:
  """``model_flops`` by part; with ``lora`` and a full critic (``lora_critic`` False) the
  critic's update keeps its weight gradients (3× its forward), the policy's does not (2×)."""
  flops = model_flops(cfg, batch, prompt_len, response_len, lora=lora, **kw)
  if lora and not lora_critic:
    full = model_flops(cfg, batch, prompt_len, response_len, lora=False, **kw)
    flops["critic fwd+bwd"] = full["critic fwd+bwd"]
  return flops


# ---------------------------------------------------------------------------------------------
# Rows: which ppojax configurations a run times, and their ratios to the peers
# ---------------------------------------------------------------------------------------------


# The ppojax flags under which it runs the passes each peer runs: every row whole (no shared
# prefix), the old values from a critic forward in the rollout (no single-pass reuse), and
# log π_old from the sampler's logits (trl) or from a policy forward (tunix).
EQUAL_WORK = {
    "trl": {"shared_prefix": False, "reuse_update_forward": False, "old_logprobs": "sampler"},
    "tunix": {"shared_prefix": False, "reuse_update_forward": False,
              "old_logprobs": "recompute"},
}
ROW_FLAGS = ("shared_prefix", "reuse_update_forward", "old_logprobs")
ROW_RESULTS = ("seconds_per_iteration", "iterations", "model_tflop_per_iteration",
               "whole_rows_tflop_per_iteration", "achieved_gflops", "peak_rss_mb",
               "first_iteration_seconds")


def plan_rows(critics: Sequence, default: dict, peers: Sequence[str], equal_work: bool,
              equal_flags: dict | None = None, flags: Sequence[str] = ROW_FLAGS) -> list[dict]:
  """The ppojax rows of a run: for each critic (``None`` without LoRA, else "lora"/"full"), the
  ``default`` values of ``flags`` and, with ``equal_work``, a row with each peer's
  ``equal_flags[peer]`` (default ``EQUAL_WORK``) over them; rows with the same critic and
  flags are one row. Each row: critic, work ("default"/"equal_work"), the flags, ``vs`` (the
  peers it is compared with: every peer for the default row, else the peers whose passes it
  runs) and ``equal_work_for`` (the peers whose passes it runs)."""
  equal_flags = EQUAL_WORK if equal_flags is None else equal_flags
  rows = []
  for critic in critics:
    base = {"critic": critic, "work": "default", **{k: default[k] for k in flags},
            "vs": list(peers), "equal_work_for": []}
    rows.append(base)
    for peer in peers:
      values = {**{k: default[k] for k in flags}, **equal_flags[peer]}
      same = next((r for r in rows if r["critic"] == critic
                   and all(r[k] == values[k] for k in flags)), None)
      if same is base:  # the default row already runs this peer's passes
        base["equal_work_for"].append(peer)
      elif not equal_work:
        continue
      elif same is None:
        rows.append({"critic": critic, "work": "equal_work", **values, "vs": [peer],
                     "equal_work_for": [peer]})
      else:
        same["vs"].append(peer)
        same["equal_work_for"].append(peer)
  return rows


def row_name(row: dict, work: str | None = None) -> str:
  """A row's key suffix: its work (or ``work``), after its critic where it has one
  (``lora_critic_default``, ``equal_work``)."""
  return (f"{row['critic']}_critic_" if row["critic"] else "") + (work or row["work"])


def comparisons(rows: Sequence[dict], peers: dict) -> dict:
  """The flat ratio keys of a run. ``rows``: ``plan_rows``' rows with their measured
  ``seconds_per_iteration`` and ``peak_rss_mb``; ``peers``: {name: {critic: that peer's JSON
  (``seconds_per_iteration``, ``peak_rss_mb``)}}. For each row, each peer in its ``vs`` that
  was measured for its critic: ``ratio_vs_PEER_ROW`` = peer seconds / row seconds and
  ``memory_vs_PEER_ROW`` = row peak / peer peak (None without the peer's peak). ROW is
  ``row_name``; a default row that runs the peer's passes also gives its ``equal_work`` keys."""
  out = {}
  for row in rows:
    for peer in row["vs"]:
      side = peers.get(peer, {}).get(row["critic"])
      if side is None:
        continue
      names = [row_name(row)]
      if row["work"] == "default" and peer in row["equal_work_for"]:
        names.append(row_name(row, "equal_work"))
      for name in names:
        out[f"ratio_vs_{peer}_{name}"] = (side["seconds_per_iteration"]
                                          / row["seconds_per_iteration"])
        rss = side.get("peak_rss_mb")
        out[f"memory_vs_{peer}_{name}"] = None if not rss else row["peak_rss_mb"] / rss
  return out


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


_PEAK_DOT = jax.jit(functools.partial(jax.lax.dot, preferred_element_type=jnp.float32))


def matmul_peak(dtype, n: int, repeats: int = 3) -> float:
  """GFLOP/s of a jit-compiled n×n·n×n product in ``dtype``, accumulated in float32 (the form
  every ppojax matmul takes): the median of ``repeats`` calls after a warm-up."""
  ka, kb = jax.random.split(jax.random.key(0))
  a = jax.random.normal(ka, (n, n), jnp.float32).astype(dtype)
  b = jax.random.normal(kb, (n, n), jnp.float32).astype(dtype)
  _PEAK_DOT(a, b).block_until_ready()
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    _PEAK_DOT(a, b).block_until_ready()
    times.append(time.perf_counter() - t0)
  return 2 * n**3 / statistics.median(times) / 1e9


def check_rollout(rollout, response_length: int) -> None:
  """That every response of ``rollout`` is ``response_length`` tokens (its mask's row sums):
  ``peer_env.check_lengths``, which raises otherwise."""
  lengths = np.sum(np.asarray(rollout.mask), axis=-1).tolist()
  peer_env.check_lengths(lengths, response_length, "ppojax's responses")


def run_trl(python: pathlib.Path, policy_dir: str, reward_dir: str, tokens: list[list[int]],
            response_length: int, iterations: int, lora_rank: int = 0,
            lora_alpha: float = 32.0, remat: bool = False, lora_critic: bool = False) -> dict:
  """trl's seconds per iteration on the same models and prompts (``trl_ppo.py`` in its own
  environment, one warm-up iteration; ``remat``: transformers' gradient checkpointing;
  ``lora_critic``: peft's adapters on the value model too): the JSON object it prints last."""
  cmd = [str(python), str(pathlib.Path(trl_ppo.__file__)), "--policy", policy_dir,
         "--reward", reward_dir, "--response-length", str(response_length), "--iterations",
         str(iterations), "--warmup", "1", "--lora-rank", str(lora_rank), "--lora-alpha",
         str(lora_alpha)] + (["--gradient-checkpointing"] if remat else []) + (
             ["--lora-critic"] if lora_critic else [])
  return run_json(cmd, "trl's PPOTrainer", prompts=tokens)


def run_row(args, row: dict) -> dict:
  """ppojax's iteration under ``row``'s critic and flags, with ``args``' sizes, in a fresh
  process (this script with ``--row-child``: no peers, no further rows): the JSON object it
  prints last."""
  cmd = [sys.executable, __file__, "--row-child", "--no-trl", "--no-tunix", "--no-equal-work",
         "--batch", str(args.batch), "--response-length", str(args.response_length),
         "--prompt-length", str(args.prompt_length), "--iterations", str(args.iterations),
         "--dtype", args.dtype, "--matmul-size", str(args.matmul_size),
         "--old-logprobs", row["old_logprobs"],
         "--shared-prefix" if row["shared_prefix"] else "--no-shared-prefix",
         "--reuse-update-forward" if row["reuse_update_forward"]
         else "--no-reuse-update-forward",
         *(["--remat"] if args.remat else []), *(["--unrolled"] if args.unrolled else []),
         *(["--lora", str(args.lora), "--lora-alpha", str(args.lora_alpha), "--lora-critic",
            row["critic"]] if args.lora else [])]
  return run_json(cmd, f"ppojax's {row_name(row)} row", "--no-equal-work")


def run_tunix(python: pathlib.Path, policy_dir: str, reward_dir: str, tokens: list[list[int]],
              response_length: int, iterations: int, kl_coef: float,
              temperature: float) -> dict:
  """tunix's seconds per iteration on the same models and prompts (``tunix_ppo.py`` in its
  own environment, one warm-up iteration): the JSON object it prints last."""
  cmd = [str(python), str(pathlib.Path(tunix_ppo.__file__)), "--policy", policy_dir,
         "--reward", reward_dir, "--response-length", str(response_length), "--iterations",
         str(iterations), "--warmup", "1", "--kl-coef", str(kl_coef), "--temperature",
         str(temperature), *tunix_rss_limit()]
  return run_json(cmd, "tunix's PPOLearner", "--no-tunix",
                  prompts=tokens)


def tunix_rss_limit() -> list[str]:
  """``--rss-limit-mb`` from ``TUNIX_RSS_LIMIT_MB`` (a shared machine: tunix stops itself before
  the OOM killer does), or nothing."""
  limit = os.environ.get("TUNIX_RSS_LIMIT_MB")
  return ["--rss-limit-mb", limit] if limit else []


def run_json(cmd: list[str], what: str, skip: str = "--no-trl", prompts=None) -> dict:
  """The last stdout line of ``cmd`` as JSON (the peer's side of a benchmark, run in the same
  environment as ppojax's, the huge-page tunable included); a failure names ``what``. With
  ``prompts`` (JSON-able), ``cmd`` gets ``--prompts FILE``, a temporary file holding them."""
  with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
    if prompts is not None:
      json.dump(prompts, f)
      f.flush()
      cmd = [*cmd, "--prompts", f.name]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
  if proc.returncode:
    raise RuntimeError(f"{what} failed (rc={proc.returncode}); its last output:\n"
                       f"{proc.stderr[-3000:]}\n({skip} skips the comparison)")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def print_rows(rows: Sequence[dict], peers: dict, ratios: dict,
               flags: Sequence[str] = ROW_FLAGS) -> None:
  """The run's ppojax rows (their ``flags``) beside each peer they are compared with: seconds,
  model TFLOP and peak memory, the peer's seconds and peak, peer / ppojax seconds and ppojax /
  peer memory."""
  print("\nppojax rows of this run, and each peer they are compared with (ratio: peer s / "
        "ppojax s; memory: ppojax peak / peer peak):")
  for row in rows:
    values = ", ".join(f"{k}={row[k]}" for k in flags)
    print(f"  {row_name(row)} ({values}): {row['seconds_per_iteration']:.2f} s/iteration, "
          f"{row['model_tflop_per_iteration']:.3f} TFLOP (whole rows "
          f"{row['whole_rows_tflop_per_iteration']:.3f}), peak RSS {row['peak_rss_mb']:.0f} MB")
    for peer in row["vs"]:
      side = peers.get(peer, {}).get(row["critic"])
      if side is None:
        continue
      name = row_name(row)
      memory = ratios[f"memory_vs_{peer}_{name}"]
      equal = " (its passes)" if peer in row["equal_work_for"] else ""
      print(f"    vs {peer}{equal}: {side['seconds_per_iteration']:.2f} s/iteration, peak RSS "
            f"{side.get('peak_rss_mb', float('nan')):.0f} MB; ratio_vs_{peer}_{name} = "
            f"{ratios[f'ratio_vs_{peer}_{name}']:.2f}x, memory_vs_{peer}_{name} = "
            + ("n/a" if memory is None else f"{memory:.2f}x"))


def main():
  hostmem.reexec_with_huge_pages()  # as the CLI does (PPOJAX_HUGE_PAGES=0: off)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--response-length", type=int, default=32)
  parser.add_argument("--prompt-length", type=int, default=44)
  parser.add_argument("--iterations", type=int, default=3, help="timed iterations per path")
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  parser.add_argument("--remat", action="store_true")
  parser.add_argument("--unrolled", action="store_true", help="model.scan_layers=False")
  parser.add_argument("--old-logprobs", default="recompute", choices=["recompute", "sampler"],
                      help="rl.old_logprobs (sampler: no policy forward for log π_old)")
  parser.add_argument("--reuse-update-forward", action=argparse.BooleanOptionalAction,
                      default=True, help="rl.reuse_update_forward (default): the single-pass "
                      "update gives the old values and log-probs; --no-…: rollout forwards")
  parser.add_argument("--shared-prefix", action=argparse.BooleanOptionalAction, default=True,
                      help="data.shared_prefix (default): the chat template's header runs once "
                      "per batch; --no-…: every row whole")
  parser.add_argument("--matmul-size", type=int, default=4096)
  parser.add_argument("--trl", action=argparse.BooleanOptionalAction, default=True,
                      help="time trl's PPOTrainer on the same task in this run (default)")
  parser.add_argument("--trl-env", type=pathlib.Path, default=None,
                      help=f"its virtual environment (default {trl_ppo.default_env_dir()})")
  parser.add_argument("--tunix", action=argparse.BooleanOptionalAction, default=False,
                      help="time tunix's PPOLearner on the same task in this run "
                      "(benchmarks/peers/tunix_ppo.py; its docstring lists what differs)")
  parser.add_argument("--tunix-env", type=pathlib.Path, default=None,
                      help=f"its virtual environment (default {tunix_ppo.default_env_dir()})")
  parser.add_argument("--lora", type=int, default=0, metavar="RANK",
                      help="LoRA adapters of this rank on the policy (trl side: peft) and, per "
                      "--lora-critic, the critic; ppojax's full PPO iteration's peak memory "
                      "from a fresh process beside it (0: full fine-tuning)")
  parser.add_argument("--lora-alpha", type=float, default=32.0)
  parser.add_argument("--lora-critic", default="both", choices=["lora", "full", "both"],
                      help="with --lora: both sides train a LoRA critic (lora), a full one "
                      "(full), or the two pairs in one run (both, default)")
  parser.add_argument("--equal-work", action=argparse.BooleanOptionalAction, default=True,
                      help="also time ppojax running each peer's passes (every row whole, "
                      "rollout forwards; see the docstring) in a fresh process (default)")
  parser.add_argument("--write-models", default=None, help=argparse.SUPPRESS)
  parser.add_argument("--row-child", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  b, r_len = args.batch, args.response_length

  if args.write_models:  # a child of the run below
    write_models(args.write_models, b, args.prompt_length, peers=args.trl or args.tunix)
    return
  if args.tunix and args.lora:
    raise SystemExit("--tunix compares full fine-tuning only (no --lora)")
  if args.row_child and args.lora and args.lora_critic == "both":
    raise SystemExit("a row process takes one critic: --lora-critic lora or full")
  critics = ([None] if not args.lora else ["lora", "full"] if args.lora_critic == "both"
             else [args.lora_critic])
  peer_names = [p for p in ("trl", "tunix") if getattr(args, p)]
  rows = plan_rows(critics, vars(args), peer_names, args.equal_work)
  # this process times the first row; its critic becomes args' (make_config reads it)
  lora_critic_option, args.lora_critic = args.lora_critic, rows[0]["critic"]
  with tempfile.TemporaryDirectory() as tmp:
    reward_dir, policy_dir = f"{tmp}/reward", f"{tmp}/policy"
    # the models the runs read, and the peers' prompts, written by a child process: loaded
    # here, their freed heap would stay in this process, under ppojax's peak below
    subprocess.run([sys.executable, __file__, "--write-models", tmp, "--batch", str(b),
                    "--prompt-length", str(args.prompt_length),
                    *([] if args.trl or args.tunix else ["--no-trl"])], check=True)
    peer_tokens = (json.loads(pathlib.Path(f"{tmp}/prompts.json").read_text())
                   if args.trl or args.tunix else None)
    peers = {}  # {peer: {critic: its JSON}}
    if args.trl:  # first, while this process holds no compiled step or TrainState
      python = trl_ppo.ensure_env(args.trl_env)
      peers["trl"] = {}
      for critic in critics:
        trl_peaks = [matmul_peak(jnp.float32, args.matmul_size)]
        pair = "" if critic is None else f" ({critic} critic)"
        print(f"trl{pair}: {args.iterations} iterations after one warm-up ...", flush=True)
        trl = run_trl(python, policy_dir, reward_dir, peer_tokens, r_len, args.iterations,
                      args.lora, args.lora_alpha, args.remat, lora_critic=critic == "lora")
        trl_peaks.append(matmul_peak(jnp.float32, args.matmul_size))
        trl["matmul_peak_samples"] = trl_peaks
        peers["trl"][critic] = trl
        print(f"trl {trl['trl']}{pair} (transformers {trl['transformers']}, torch "
              f"{trl['torch']}, {trl['threads']} threads): {trl['seconds_per_iteration']:.2f} "
              f"s/iteration (median of {', '.join(f'{x:.2f}' for x in trl['iterations'])}; "
              f"warm-up {trl['warmup_seconds'][0]:.1f} s); peak RSS "
              f"{trl['peak_rss_mb']:.0f} MB; float32 peak before / after: "
              f"{trl_peaks[0]:.0f} / {trl_peaks[1]:.0f} GFLOP/s", flush=True)
    trl = peers.get("trl", {}).get(rows[0]["critic"])
    tunix = None
    if args.tunix:  # likewise first, in its own process and environment
      python = tunix_ppo.ensure_env(args.tunix_env)
      c0 = make_config(args, reward_dir)
      tunix_peaks = [matmul_peak(jnp.float32, args.matmul_size)]
      print(f"tunix: {args.iterations} iterations after one warm-up ...", flush=True)
      tunix = run_tunix(python, policy_dir, reward_dir, peer_tokens, r_len, args.iterations,
                        c0.rl.kl_coef, c0.sampling.temperature)
      tunix_peaks.append(matmul_peak(jnp.float32, args.matmul_size))
      tunix["matmul_peak_samples"] = tunix_peaks
      peers["tunix"] = {None: tunix}
      print(f"tunix {tunix['tunix']} (jax {tunix['jax']}, flax {tunix['flax']}): "
            f"{tunix['seconds_per_iteration']:.2f} s/iteration (median of "
            f"{', '.join(f'{x:.2f}' for x in tunix['iterations'])}; warm-up "
            f"{tunix['warmup_seconds'][0]:.1f} s); peak RSS {tunix['peak_rss_mb']:.0f} MB; "
            f"float32 peak before / after: {tunix_peaks[0]:.0f} / {tunix_peaks[1]:.0f} GFLOP/s",
            flush=True)
    full = None
    if args.lora and not args.row_child:  # ppojax's full fine-tuning, in a fresh process
      print("ppojax full fine-tuning: one iteration in a fresh process for its peak memory ...",
            flush=True)
      full = run_json([sys.executable, __file__, "--row-child", "--no-trl", "--no-equal-work",
                       "--iterations", "1", "--batch", str(b), "--response-length",
                       str(r_len), "--prompt-length", str(args.prompt_length), "--dtype",
                       args.dtype] + (["--remat"] if args.remat else []),
                      "ppojax's full fine-tuning iteration")
    for row in rows[1:]:  # the other rows, each in a fresh process, before this one builds
      print(f"ppojax row {row_name(row)} (shared_prefix={row['shared_prefix']}, "
            f"reuse_update_forward={row['reuse_update_forward']}, old_logprobs="
            f"{row['old_logprobs']}): a fresh process ...", flush=True)
      measured = run_row(args, row)
      row.update({k: measured[k] for k in ROW_RESULTS})
      print(f"ppojax row {row_name(row)}: {row['seconds_per_iteration']:.2f} s/iteration, "
            f"{row['model_tflop_per_iteration']:.3f} TFLOP, peak RSS "
            f"{row['peak_rss_mb']:.0f} MB", flush=True)
    config = make_config(args, reward_dir)
    t0 = time.perf_counter()
    run = build_lib.build(config)
    build_s = time.perf_counter() - t0
  build_rss = hostmem.peak_rss_mb()
  cfg = run.policy.cfg
  prompts = make_prompts(run.policy.tokenizer, b, args.prompt_length, args.shared_prefix)
  shared = 0 if prompts.prefix is None else len(prompts.prefix)
  real = int(np.sum(np.asarray(prompts.mask)))
  print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), {os.cpu_count()} "
        f"CPUs, jax {jax.__version__}; SmolLM2-135M-Instruct as policy, reference, reward and "
        f"critic; {args.dtype}{', remat' if args.remat else ''}"
        f"{', unrolled layers' if args.unrolled else ''}; old log-probs: {args.old_logprobs}; "
        f"reuse_update_forward={args.reuse_update_forward}; "
        + (f"LoRA rank {args.lora}, {args.lora_critic} critic; " if args.lora else "")
        + f"huge_pages={hostmem.huge_pages_active()}")
  print(f"batch {b}, prompts {args.prompt_length} slots ({real / b:.1f} real tokens per row), "
        f"responses exactly {r_len} tokens; shared prefix {shared} tokens; 1 epoch × 1 "
        f"minibatch; build {build_s:.1f} s",
        flush=True)

  # The fused step: one compiled function. The first call compiles.
  state = run.state
  t0 = time.perf_counter()
  state, _, rollout, _ = runner.iteration(run, state, prompts)
  first_s = time.perf_counter() - t0
  check_rollout(rollout, r_len)
  # The matmul peak is sampled before every timed iteration and after the last: this VM's
  # speed drifts by ±15% within minutes, so a peak taken once, at another moment, would make
  # the fraction of peak mostly noise.
  dtypes = ["float32"] + (["bfloat16"] if args.dtype == "bfloat16" else [])
  peak_samples = {k: [] for k in dtypes}

  def sample_peaks():
    for k in dtypes:
      peak_samples[k].append(matmul_peak(jnp.dtype(k), args.matmul_size))

  fused = []
  for _ in range(args.iterations):
    sample_peaks()
    state, metrics, rollout, _ = runner.iteration(run, state, prompts)
    fused.append(metrics["time/iteration"])
    check_rollout(rollout, r_len)
  sample_peaks()
  seconds = statistics.median(fused)
  compile_s = first_s - seconds
  print(f"fused step: first iteration {first_s:.1f} s (compile ≈ {compile_s:.1f} s), then "
        f"{seconds:.2f} s/iteration (median of {args.iterations}: "
        f"{', '.join(f'{x:.2f}' for x in fused)})", flush=True)

  # The phase-timed path compiles its own three functions: warm up first.
  t0 = time.perf_counter()
  state, _, _, _ = runner.iteration(run, state, prompts, phase_timing=True)
  phase_first_s = time.perf_counter() - t0
  phase_rows = []
  for _ in range(args.iterations):
    state, metrics, rollout, _ = runner.iteration(run, state, prompts, phase_timing=True)
    phase_rows.append(metrics)
    check_rollout(rollout, r_len)
  jax.block_until_ready(state)
  rss = hostmem.peak_rss_mb()
  # what a checkpoint holds: the state without LoRA's frozen base (loop_state.saved)
  checkpoint_mb = sum(x.nbytes for x in jax.tree.leaves(state._replace(base=None))) / 2**20

  recompute = args.old_logprobs == "recompute"
  single = update_lib.single_pass(config.rl)  # the benchmark's 1 × 1 × 1 update
  runs = {"old_logp_fwd": recompute and not single, "critic_fwd": not single}
  # no weight gradients where adapters train
  runs.update(lora=bool(args.lora), lora_critic=args.lora_critic == "lora")
  flops = iteration_flops(cfg, b, args.prompt_length, r_len, **runs, shared=shared)
  total = sum(flops.values())
  whole = sum(iteration_flops(cfg, b, args.prompt_length, r_len, **runs).values())
  phase_s = {k: statistics.median(m[f"time/{k}"] for m in phase_rows) for k in PHASE_PARTS}
  phased_total = statistics.median(m["time/iteration"] for m in phase_rows)

  peaks = {k: statistics.median(v) for k, v in peak_samples.items()}
  peak = peaks[args.dtype]
  achieved, effective = total / seconds / 1e9, whole / seconds / 1e9

  print(f"phase-timed path (three compiled functions): warm-up {phase_first_s:.1f} s, then "
        f"{phased_total:.2f} s/iteration (median of {args.iterations}; "
        f"{phased_total - seconds:+.2f} s vs the fused step)")
  print("\nmedians per column (they need not add up exactly):")
  print(f"{'phase':<10}{'seconds':>9}{'share':>8}{'TFLOP':>8}{'GFLOP/s':>9}{'of peak':>9}")
  phases = {}
  for name, parts in PHASE_PARTS.items():
    fl, s = sum(flops[p] for p in parts), phase_s[name]
    phases[name] = {"seconds": s, "tflop": fl / 1e12, "gflops": fl / s / 1e9}
    print(f"{name:<10}{s:>9.2f}{s / phased_total:>8.1%}{fl / 1e12:>8.3f}{fl / s / 1e9:>9.1f}"
          f"{fl / s / 1e9 / peak:>9.1%}")
  rest = statistics.median(m["time/iteration"] - sum(m[f"time/{k}"] for k in PHASE_PARTS)
                           for m in phase_rows)  # host work between the calls
  print(f"{'(other)':<10}{rest:>9.2f}{rest / phased_total:>8.1%}")
  print(f"{'iteration':<10}{phased_total:>9.2f}{1:>8.1%}{total / 1e12:>8.3f}"
        f"{total / phased_total / 1e9:>9.1f}{total / phased_total / 1e9 / peak:>9.1%}")

  print(f"\nmodel FLOPs of one iteration ({b} × ({args.prompt_length} + {r_len}) tokens):")
  for name, fl in flops.items():
    print(f"  {name:<30}{fl / 1e12:>8.3f} TFLOP")
  other = {k: sum(iteration_flops(cfg, b, args.prompt_length, r_len, lm_head=k,
                                  **runs).values()) / 1e12
           for k in ("all", "none")}  # rows whole
  print(f"  {'total':<30}{total / 1e12:>8.3f} TFLOP"
        + (f"  ({whole / 1e12:.3f} TFLOP with every row whole: the {shared}-token prefix "
           f"runs once, not {b} times)" if shared else ""))
  print(f"  the issue's reference: about {REFERENCE_TFLOP} TFLOP for 16 × (44 + 32), rows whole")
  print(f"  the same count with the LM head on every position (a plain HF forward): "
        f"{other['all']:.3f} TFLOP; without any LM head (2 × non-embedding parameters per "
        f"token + attention): {other['none']:.3f} TFLOP")
  if b == 16 and args.prompt_length == 44 and r_len == 32 and not args.lora and runs[
      "old_logp_fwd"] and runs["critic_fwd"] and not (
      0.8 < whole / 1e12 / REFERENCE_TFLOP < 1.25):
    print(f"  WARNING: {whole / 1e12:.2f} TFLOP is not in the ballpark of {REFERENCE_TFLOP}")

  print(f"\nmatmul peak ({args.matmul_size}² product, float32 accumulation; median of "
        f"{len(peak_samples['float32'])} samples taken between the fused iterations): "
        + ", ".join(f"{k} {v:.1f} GFLOP/s (samples "
                    f"{', '.join(f'{x:.0f}' for x in peak_samples[k])})"
                    for k, v in peaks.items()))
  print(f"achieved (fused step): {achieved:.1f} GFLOP/s = {achieved / peak:.1%} of the "
        f"{args.dtype} matmul peak"
        + (f" ({achieved / peaks['float32']:.1%} of the float32 peak)"
           if args.dtype != "float32" else ""))
  if shared:
    print(f"effective (the FLOPs of whole rows over the same time): {effective:.1f} GFLOP/s = "
          f"{effective / peak:.1%} of the {args.dtype} matmul peak")
  print(f"peak host memory (VmHWM): {rss:.0f} MB ({build_rss:.0f} MB already after loading "
        f"the models and building the state)")
  if full is not None:
    print(f"LoRA rank {args.lora}: peak RSS {rss:.0f} MB vs ppojax full fine-tuning "
          f"{full['peak_rss_mb']:.0f} MB = {rss / full['peak_rss_mb']:.2f}x; checkpoint "
          f"{checkpoint_mb:.0f} MB vs {full['checkpoint_mb']:.0f} MB = "
          f"{checkpoint_mb / full['checkpoint_mb']:.3f}x", flush=True)
  trl_ratio = None if trl is None else trl["seconds_per_iteration"] / seconds
  tunix_ratio = None if tunix is None else tunix["seconds_per_iteration"] / seconds
  rows[0].update(seconds_per_iteration=seconds, iterations=fused,
                 model_tflop_per_iteration=total / 1e12,
                 whole_rows_tflop_per_iteration=whole / 1e12, achieved_gflops=achieved,
                 peak_rss_mb=rss, first_iteration_seconds=first_s)
  ratios = comparisons(rows, peers)
  print_rows(rows, peers, ratios)

  print(json.dumps({
      "seconds_per_iteration": seconds, "iterations": fused, "compile_seconds": compile_s,
      "first_iteration_seconds": first_s, "phase_timed_warmup_seconds": phase_first_s,
      "phase_timed_seconds_per_iteration": phased_total,
      "model_tflop_per_iteration": total / 1e12, "achieved_gflops": achieved,
      "shared_prefix_tokens": shared, "whole_rows_tflop_per_iteration": whole / 1e12,
      "effective_gflops": effective, "effective_fraction_of_peak": effective / peak,
      "matmul_peak_gflops": peaks["float32"], "matmul_peak_samples": peak_samples["float32"],
      **({"matmul_peak_bf16_gflops": peaks["bfloat16"]} if "bfloat16" in peaks else {}),
      "fraction_of_peak": achieved / peak, "peak_rss_mb": rss, "checkpoint_mb": checkpoint_mb,
      "lora_rank": args.lora, "full": full,
      "memory_vs_full": None if full is None else rss / full["peak_rss_mb"],
      "checkpoint_vs_full": None if full is None else checkpoint_mb / full["checkpoint_mb"],
      "trl_peak_rss_mb": None if trl is None else trl.get("peak_rss_mb"),
      "memory_vs_trl": None if trl is None or "peak_rss_mb" not in trl
                       else rss / trl["peak_rss_mb"],
      "peak_rss_after_build_mb": build_rss, "phases": phases,
      "dtype": args.dtype, "remat": args.remat, "unrolled": args.unrolled,
      "old_logprobs": args.old_logprobs, "reuse_update_forward": args.reuse_update_forward,
      "single_pass": single,
      "huge_pages": hostmem.huge_pages_active(),
      "batch": b, "prompt_length": args.prompt_length,
      "response_length": r_len,
      "trl_seconds_per_iteration": None if trl is None else trl["seconds_per_iteration"],
      "trl_ratio": trl_ratio, "trl": trl,  # the default row's pair (the first critic)
      "tunix_seconds_per_iteration": None if tunix is None else tunix["seconds_per_iteration"],
      "tunix_ratio": tunix_ratio, "tunix_peak_rss_mb": None if tunix is None
      else tunix["peak_rss_mb"], "tunix": tunix,
      "device": jax.devices()[0].device_kind, "cpus": os.cpu_count(),
      "lora_critic": lora_critic_option if args.lora else None,
      "equal_work": args.equal_work, "rows": rows,
      **ratios, "trl_by_critic": None if "trl" not in peers or not args.lora
      else {str(k): v for k, v in peers["trl"].items()}}))


if __name__ == "__main__":
  main()
