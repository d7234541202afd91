"""Seconds per GRPO iteration of Google's tunix (``GRPOLearner``): the other side of
``grpo_step.py --tunix``.

Table: the tunix rows of docs/performance/peers.md, "GRPO vs tunix: `benchmarks/grpo_step.py
--tunix`".

It runs in the environment of ``tunix_ppo.ensure_env`` (tunix 0.1.7, under ``~/.cache/ppojax``)
and takes its pieces from ``tunix_ppo.py``: the SmolLM2-135M ``ModelConfig`` of tunix's Llama-3,
the loading by tunix's safetensors loader, the tokenizer, the ``RLCluster`` and the timing.
``grpo_step.py --tunix`` runs it in the same benchmark run as ppojax's iteration, before ppojax
builds anything (the two processes' memory never adds up):

    python benchmarks/peers/tunix_grpo.py --policy DIR --prompts FILE.json [--num-generations 4]
        [--response-length 32] [--temperature 0.7] [--beta 0.04] [--iterations 3] [--warmup 1]

DIR is the Hugging Face directory ppojax exports (``save_model``, ``LlamaForCausalLM``): the
policy (trained, and the rollout model: one set of weights, tunix's colocated default, so no
weight sync runs) and the reference (a second copy). FILE holds {"token_ids": [[...], ...],
"answers": [...]}, as for ``trl_grpo.py``: the chat-templated prompts as token ids (40 each, no
padding) and each prompt's answer. The reward is ``ppojax.tasks.arith.reward`` (loaded by path, as
``trl_grpo.arith_reward`` does), a Python function of the decoded completions; the answers
reach it as tunix passes a batch's other columns, one keyword list repeated per generation.

What tunix's ``GRPOLearner.train`` runs per iteration (one global step: num_iterations = 1, one
minibatch of every prompt × ``--num-generations``, no gradient accumulation, float32 on the
CPU):

* rollout: each prompt string repeated G times on the host, tokenized there, and tunix's
  "vanilla" sampler over the B·G rows: two compiled functions, a prefill of every row in full
  (no prefill shared by a prompt's samples, no shared chat header) and a decode ``while_loop``
  over a KV cache of P + R slots; top-p sampling with top_p = 1.0 (plain sampling at the
  temperature, but sorting the vocabulary every step). The completions are copied back,
  detokenized and padded on the host;
* the reference's compiled forward over the B·G full rows (the LM head at every position, the
  completion's log-probs at temperature T kept). With num_iterations = 1 no old log-probs pass
  runs (the loss's ratio takes the update's own detached log-probs, as trl's and ppojax's);
* on the host: the reward function on the decoded texts, group advantages
  (r − mean) / (std + 1e-6) with NumPy, metrics;
* the actor's compiled step: the policy's forward (LM head at every position) and backward of
  the clipped ratio loss + β·KL, plus a per-token entropy of the completion's logits (a metric,
  no gradient to speak of), gradient clipping at norm 1 and one AdamW step.

Settings as ``grpo_step.py``'s: β = 0.04 with the k3 estimator (tunix ``kl_loss_mode =
"low_var_kl"``: exp(ref − logp) − (ref − logp) − 1, as ppojax's and trl's), ratio clip 0.2,
loss aggregation "sequence-mean-token-mean" (each sequence's token mean, then the mean over
sequences), AdamW at lr 3e-6 with weight decay 0 and a constant schedule, temperature 0.7. What
differs, and how it is made to match:

* Exact length: tunix has no ``min_new_tokens``. Its sampler stops a row at an ``eos_tokens``
  id; this script passes one outside the vocabulary (``tunix_ppo.OUT_OF_VOCAB``), so every row
  runs all R decode steps. tunix's masks treat the tokenizer's pad id as padding, and the
  tokenizer's pad and eos are ``<|endoftext|>`` (0), as in ``tunix_ppo.py``: a completion that
  samples it would get a shorter mask and end its text there (ppojax bans the stop ids before R
  tokens). The script counts each completion's tokens other than the pad id at every
  ``RLCluster.generate`` call (``tunix_ppo.record_lengths``) and fails (a non-zero exit naming
  the expected and found lengths, ``tunix_ppo.check_lengths``) if any is not R tokens long;
  the JSON line has the shortest (``min_completion_length``).
* Prompts: tunix's rollout takes strings; the script decodes ppojax's ids to text and checks
  that tunix's tokenization (``Sampler.tokenize``) gives back exactly the same 40 ids.
* Group advantages: the sample standard deviation (ddof = 1) + 1e-6; ppojax's divides by its
  std + 1e-6 and trl by std + 1e-4 (elementwise on B·G numbers, no work to speak of).
* Shared prefix: ppojax's default (the chat template's 24-token header once per batch, each
  prompt's prefill once for its G samples) has no counterpart in tunix; ``grpo_step.py
  --no-shared-prefix`` times ppojax with every row whole.

Status: full-size runs (``grpo_step.py --tunix --no-trl``: 16 prompts × 4 samples, 32 new
tokens, timed iterations after the warm-up) have finished; their figures and conditions are in
docs/performance/peers.md ("GRPO vs tunix"). tunix's peak resident set there was about 19 GB, so the
run needs that much free memory (``TUNIX_RSS_LIMIT_MB`` stops it earlier, exit code 3).

An iteration is the time between two requests of tunix's trainer for its next batch (the
iterator this script hands to ``train``): rollout, reference, rewards, the update and tunix's
own bookkeeping of that iteration. The first ``--warmup`` iterations (the first compiles) are
not counted. The last line printed is a JSON object with ``seconds_per_iteration`` (the median),
``peak_rss_mb`` (VmHWM of this process) and the versions used.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# pylint: disable=wrong-import-position
import trl_grpo  # noqa: E402  (its arith_reward: ppojax.tasks.arith.reward without the package)
import tunix_ppo  # noqa: E402


def main():
  parser = trl_grpo.arguments(__doc__.splitlines()[0])
  parser.add_argument("--rss-limit-mb", type=float, default=0,
                      help="stop (exit code 3) once the resident set passes this (0: no limit)")
  args = parser.parse_args()
  if args.rss_limit_mb:
    tunix_ppo.rss_guard(args.rss_limit_mb)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

  # pylint: disable=import-outside-toplevel
  import numpy as np
  from tunix.rl.grpo import grpo_learner

  spec = json.loads(Path(args.prompts).read_text())
  prompts, answers = spec["token_ids"], [str(a) for a in spec["answers"]]
  if len(prompts) != len(answers):
    raise ValueError(f"{len(prompts)} prompts but {len(answers)} answers")
  tokenizer, texts = tunix_ppo.tokenizer_and_texts(args.policy, prompts)
  batch, p_len, r_len = len(prompts), len(prompts[0]), args.response_length
  n_iterations = args.warmup + args.iterations

  mesh, load = tunix_ppo.loader(args.policy)
  t0 = time.perf_counter()
  actor, reference = load(args.policy), load(args.policy)
  cluster = tunix_ppo.make_cluster(mesh=mesh, actor=actor, reference=reference,
                                   tokenizer=tokenizer, prompt_length=p_len,
                                   response_length=r_len, temperature=args.temperature,
                                   batch=batch, max_steps=n_iterations, lr=args.lr)
  del actor, reference
  tunix_ppo.check_tokenization(cluster, texts, prompts)
  algo = grpo_learner.GRPOConfig(
      num_generations=args.num_generations, num_iterations=1, beta=args.beta,
      kl_loss_mode="low_var_kl", epsilon=0.2, loss_agg_mode="sequence-mean-token-mean")
  mean_rewards = []  # per iteration: the mean reward
  last_completion = []  # the last iteration's first completion text, to eyeball

  def metric(prompts, completions, rewards, advantages, **_):  # tunix's metric_fns hook
    del prompts, advantages
    mean_rewards.append(float(np.mean(rewards)))
    last_completion[:] = completions[:1]
    return {}

  lengths = tunix_ppo.record_lengths(cluster)  # per generate call, each completion's length
  learner = grpo_learner.GRPOLearner(rl_cluster=cluster, algo_config=algo,
                                     reward_fns=trl_grpo.arith_reward(), metric_fns=[metric])
  build_s = time.perf_counter() - t0
  print(f"tunix_grpo: built in {build_s:.0f} s, RSS {tunix_ppo.peak_rss_mb('VmRSS'):.0f} MB, "
        f"peak {tunix_ppo.peak_rss_mb():.0f} MB", file=sys.stderr, flush=True)

  # arrays: tunix's pipeline repeats each leaf G times along its first axis
  steps = tunix_ppo.timed_train(
      learner, {"prompts": np.array(texts), "answer": np.array(answers)}, n_iterations)
  tunix_ppo.check_lengths(lengths, n_iterations, r_len)
  timed = steps[args.warmup:]
  print(json.dumps({
      "seconds_per_iteration": statistics.median(timed), "iterations": timed,
      "warmup_seconds": steps[:args.warmup], "build_seconds": build_s, "prompts": batch,
      "num_generations": args.num_generations, "prompt_length": p_len,
      "response_length": r_len, "min_completion_length": min(min(call) for call in lengths),
      "mean_reward": statistics.mean(mean_rewards[args.warmup:] or [float("nan")]),
      "last_completion": last_completion[0] if last_completion else None,
      **tunix_ppo.versions(), "peak_rss_mb": tunix_ppo.peak_rss_mb()}))


if __name__ == "__main__":
  sys.exit(main())
