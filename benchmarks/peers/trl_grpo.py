"""Seconds per GRPO iteration of trl's ``GRPOTrainer``: the other side of ``grpo_step.py``.

Table: the trl rows of docs/performance/peers.md, "GRPO iteration vs trl: `benchmarks/grpo_step.py`"
and "trl 1.16 beside trl 0.17".

It runs under trl 0.17 or trl 1.16, each in its own environment (``trl_ppo.ensure_env(version=
"0.17" | "1.16")``: trl 0.17 needs a transformers 4.x, ppojax installs 5.x; ``trl_ppo.TRL_VERSIONS``
lists both); ``grpo_step.py`` makes those environments and runs this script in each, in the same
benchmark run as ppojax's iteration:

    python benchmarks/peers/trl_grpo.py --policy DIR --prompts FILE.json [--num-generations 4]
        [--response-length 32] [--temperature 0.7] [--beta 0.04] [--iterations 3] [--warmup 1]
        [--all-positions-lm-head]

DIR is a Hugging Face directory with the policy as ``*ForCausalLM`` (trl's reference model is
the same weights: 0.17 copies the policy, ``create_reference_model``; 1.16 loads DIR again).
FILE holds {"token_ids": [[...], ...], "answers": [...]}: the chat-templated prompts as token
ids, all of one length, and each prompt's answer. Each prompt is decoded to its text, and the
text must tokenize back to the same ids, with and without special tokens (0.17 tokenizes
without them, 1.16 with), else ``ValueError``: trl tokenizes the text itself, so both sides then
feed the model the same tokens, with no padding. The reward is ``ppojax.tasks.arith.reward``
(exact match of the last number, plus 0.1 for ending on a number), loaded from
ppojax/tasks/arith.py by path (``arith_reward``: it needs only NumPy): a Python function of the
decoded completions and the dataset's ``answer`` column.

The settings mirror ``grpo_step.py``, under both versions: float32 on the CPU, every core, no
vLLM; the batch is every prompt once × ``--num-generations`` (per_device_train_batch_size =
prompts × generations, gradient_accumulation_steps = 1, num_iterations = 1: one optimizer step
per batch of completions); loss_type "grpo" (each sequence's token mean, then the mean over
sequences); rewards scaled by their group's std; no top-k and top-p 1; no dataset shuffling; no
gradient checkpointing; no masking of truncated completions (every completion here is
"truncated": it has no EOS); no logging integrations, no checkpoints. trl's generation stops
at EOS, ppojax's benchmark forces exactly ``--response-length`` tokens: this script sets
``min_new_tokens`` = ``max_new_tokens`` in the trainer's generation config (``generate`` gets
that object in both versions), so both sample exactly that many tokens (checked after the run:
trl's logged minimum completion length must be ``--response-length``).

What one trl 0.17 iteration runs (``GRPOTrainer._generate_and_score_completions`` and
``_compute_loss``): ``generate`` on the prompts × generations rows (each prompt's prefill once
per generation); with num_iterations = 1 no old log-probs pass (they are taken as the update's
own detached log-probs); the reference model's forward over prompt + completion (log-probs at
temperature T, the LM head on the completion positions: ``logits_to_keep``); the reward
function on the decoded completions; group advantages (r − mean) / (std + 1e-4); then
``Trainer.training_step``: the policy's forward and backward (clipped ratio loss + β·k3 KL),
gradient clipping at norm 1 and one AdamW step.

trl 1.16 runs the same passes (old log-probs are still skipped when num_iterations = 1 and the
generation batch is one optimizer step, without vLLM; advantages (r − mean) / (std + 1e-4)),
with these changes, each set here to 0.17's behaviour where a setting reaches it
(``version_settings``; the arguments of both versions are passed to both):

* defaults that changed: ``loss_type`` "dapo" (set "grpo"), ``gradient_checkpointing`` True
  (set False), ``bf16`` True unless fp16 (set False), ``top_k`` 0 (0.17: 50; set 0 in both),
  ``beta`` 0 (set ``--beta``), ``scale_rewards`` a string ("group" = 0.17's True);
* new options, off here: ``use_bias_correction_kl`` (default True: the k3 term is multiplied by
  the importance ratio, 1 in value but adding KL·∇log π to the gradient; set False, the plain
  k3 term of 0.17 and ppojax), ``top_entropy_quantile`` 1 (no entropy mask), ``entropy_coef`` 0,
  ``importance_sampling_level`` "token", ``use_transformers_continuous_batching`` (and the
  deprecated ``use_transformers_paged``) False: ``generate`` with a dynamic KV cache, as 0.17;
  vLLM's importance-sampling correction applies only with vLLM (off);
* the LM head: 1.16 computes log-probs with its fused, chunked LM head
  (``trl.trainer.utils.add_fused_lm_head``: the logits never materialised, the entropy computed
  too, the backward recomputing each vocabulary tile), which projects only the positions with a
  label (the completion) on CUDA and XPU but every position of prompt + completion elsewhere,
  this CPU included: the LM head over P + R − 1 positions instead of R in the reference forward
  and the update (at 16 × 4 rows of 40 + 32 tokens, ≈ 0.7 TFLOP more). No option turns it off,
  so this script makes the CPU take the CUDA path's selection (``completion_lm_head``: the
  projection tiles stay torch ops); ``--all-positions-lm-head`` keeps trl's CPU path as
  shipped. What remains different: the backward's recomputed LM-head projection (one more
  LM-head matmul over the completion positions, ≈ 0.1 TFLOP at that size) and the entropy;
* the decode is transformers 5.25's ``generate`` (0.17: 4.51's).

An iteration is the time between two of trl's ``on_step_end`` callbacks: all of the above and
trl's own bookkeeping of that iteration. The first ``--warmup`` iterations are not counted. The
last line printed is a JSON object with ``seconds_per_iteration`` (the median), ``peak_rss_mb``
(this process's ``VmHWM``), trl's last logged metrics, the version-specific settings
(``trl_settings``), ``lm_head_positions`` ("completion" or "all") and the versions used.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trl_ppo  # noqa: E402  pylint: disable=wrong-import-position

ARITH = Path(__file__).resolve().parents[2] / "ppojax" / "tasks" / "arith.py"


def arith_reward():
  """``ppojax.tasks.arith.reward``, imported from its file without the ppojax package (whose import
  needs jax, which this environment does not have): while the file loads, its one ppojax import,
  ``ppojax.data.records`` (used by its command line only, not by ``reward``), is an empty
  stand-in module, and ``sys.modules`` is restored after."""
  names = ("ppojax", "ppojax.data", "ppojax.data.records")
  stand_ins = {name: types.ModuleType(name) for name in names}
  stand_ins["ppojax"].data = stand_ins["ppojax.data"]
  stand_ins["ppojax.data"].records = stand_ins["ppojax.data.records"]
  saved = {name: sys.modules.get(name) for name in names}
  sys.modules.update(stand_ins)
  try:
    spec = importlib.util.spec_from_file_location("ppojax_arith", ARITH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
  finally:
    for name, old in saved.items():
      if old is None:
        sys.modules.pop(name, None)
      else:
        sys.modules[name] = old
  return module.reward


def arguments(description: str) -> argparse.ArgumentParser:
  """The GRPO iteration's options, shared by this script and ``tunix_grpo.py``."""
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument("--policy", required=True)
  parser.add_argument("--prompts", required=True,
                      help='JSON {"token_ids": [[...], ...], "answers": [...]}')
  parser.add_argument("--num-generations", type=int, default=4)
  parser.add_argument("--response-length", type=int, default=32)
  parser.add_argument("--temperature", type=float, default=0.7)
  parser.add_argument("--beta", type=float, default=0.04)
  parser.add_argument("--iterations", type=int, default=3)
  parser.add_argument("--warmup", type=int, default=1)
  parser.add_argument("--lr", type=float, default=3e-6)
  return parser


def major(version: str) -> int:
  """The major number of a version string ("0.17.0" -> 0, "1.16.0" -> 1)."""
  return int(version.split(".")[0])


def version_settings(version: str) -> dict:
  """The ``GRPOConfig`` arguments that only trl ``version`` has, set to trl 0.17's behaviour
  (the docstring says why): none for 0.x; for 1.x the KL term without the importance-ratio
  factor, and its entropy, off-policy and continuous-batching options at their off values."""
  if major(version) < 1:
    return {}
  return {"use_bias_correction_kl": False, "top_entropy_quantile": 1.0, "entropy_coef": 0.0,
          "importance_sampling_level": "token", "use_transformers_continuous_batching": False}


def completion_lm_head() -> None:
  """trl 1.x's fused LM head projects, on this CPU, the positions that carry a label only (the
  completion), as it does on CUDA and XPU, not every position: its ``compact`` selection reads
  ``trl.trainer.utils._use_triton``, replaced here; the kernels module keeps its own binding,
  so the projection tiles stay torch ops. Raises if that function has moved."""
  from trl.trainer import utils  # pylint: disable=import-outside-toplevel
  if not hasattr(utils, "_use_triton"):
    raise RuntimeError("trl.trainer.utils._use_triton is gone: this trl's fused LM head differs "
                       "from 1.16's (--all-positions-lm-head runs it as shipped)")
  utils._use_triton = lambda device: True  # pylint: disable=protected-access


def lm_head_positions(version: str, all_positions: bool) -> str:
  """Which positions trl ``version``'s LM head scores, made so: "completion" (0.x:
  ``logits_to_keep``; 1.x: ``completion_lm_head``), or "all" with ``all_positions`` on 1.x (its
  CPU path as shipped)."""
  if major(version) < 1:
    return "completion"
  if all_positions:
    return "all"
  completion_lm_head()
  return "completion"


def main():
  parser = arguments(__doc__.splitlines()[0])
  parser.add_argument("--all-positions-lm-head", action="store_true",
                      help="trl 1.x: leave its fused LM head as shipped for the CPU (every "
                      "position of prompt + completion, not the completion only)")
  args = parser.parse_args()

  # pylint: disable=import-outside-toplevel
  import torch
  import transformers
  import trl
  from datasets import Dataset
  from transformers import AutoModelForCausalLM, TrainerCallback
  from trl import GRPOConfig, GRPOTrainer

  torch.set_num_threads(os.cpu_count())
  spec = json.loads(Path(args.prompts).read_text())
  token_ids, answers = spec["token_ids"], spec["answers"]
  if len(token_ids) != len(answers):
    raise ValueError(f"{len(token_ids)} prompts but {len(answers)} answers")
  if len({len(p) for p in token_ids}) != 1:
    raise ValueError("every prompt must have the same number of tokens")
  tokenizer = trl_ppo.hf_tokenizer(args.policy)
  texts = [tokenizer.decode(ids, skip_special_tokens=False) for ids in token_ids]
  for i, (text, ids) in enumerate(zip(texts, token_ids)):
    for special in (False, True):  # trl 0.17 tokenizes without special tokens, 1.x with
      again = tokenizer(text, add_special_tokens=special)["input_ids"]
      if again != ids:
        raise ValueError(f"prompt {i} does not tokenize back to its ids (add_special_tokens="
                         f"{special}): {ids} -> {text!r} -> {again}")
  n_prompts, n_iterations = len(texts), args.warmup + args.iterations
  policy = AutoModelForCausalLM.from_pretrained(args.policy, torch_dtype=torch.float32)
  data = Dataset.from_dict({"prompt": texts, "answer": [str(a) for a in answers]})

  class LastLogs(TrainerCallback):
    def __init__(self):
      self.logs = {}

    def on_log(self, *_, logs=None, **__):
      self.logs.update(logs or {})

  settings = version_settings(trl.__version__)
  lm_head = lm_head_positions(trl.__version__, args.all_positions_lm_head)
  clock, logs = trl_ppo.step_clock(), LastLogs()
  with tempfile.TemporaryDirectory() as out:
    config = GRPOConfig(
        output_dir=out, per_device_train_batch_size=n_prompts * args.num_generations,
        gradient_accumulation_steps=1, num_generations=args.num_generations, num_iterations=1,
        max_completion_length=args.response_length, temperature=args.temperature, top_p=1.0,
        top_k=0, beta=args.beta, loss_type="grpo", scale_rewards=True, epsilon=0.2,
        mask_truncated_completions=False, shuffle_dataset=False, use_vllm=False,
        gradient_checkpointing=False, learning_rate=args.lr, lr_scheduler_type="constant",
        max_steps=n_iterations, report_to="none", save_strategy="no", logging_steps=10**6,
        disable_tqdm=True, use_cpu=True, bf16=False, fp16=False, seed=0, **settings)
    trainer = GRPOTrainer(model=policy, reward_funcs=arith_reward(), args=config,
                          train_dataset=data, processing_class=tokenizer,
                          callbacks=[clock, logs])
    # exactly --response-length tokens, as ppojax's min_new_tokens = max_new_tokens: EOS is
    # banned until then (HF's MinNewTokensLengthLogitsProcessor)
    trainer.generation_config.min_new_tokens = args.response_length
    trainer.train()

  steps = [b - a for a, b in zip(clock.marks, clock.marks[1:])]
  if len(steps) != n_iterations:
    raise RuntimeError(f"trl ran {len(steps)} iterations, expected {n_iterations}")
  shortest = logs.logs.get("completions/min_length")  # the mean over steps of each step's min
  if shortest != args.response_length:
    raise RuntimeError(f"trl's completions were not all {args.response_length} tokens long "
                       f"(logged completions/min_length: {shortest})")
  timed = steps[args.warmup:]
  print(json.dumps({
      "seconds_per_iteration": statistics.median(timed), "iterations": timed,
      "warmup_seconds": steps[:args.warmup],
      "peak_rss_mb": trl_ppo.peak_rss_mb(),
      "prompts": n_prompts, "num_generations": args.num_generations,
      "prompt_length": len(token_ids[0]), "response_length": args.response_length,
      "metrics": {k: v for k, v in logs.logs.items() if isinstance(v, (int, float))},
      "trl_settings": settings, "lm_head_positions": lm_head,
      "gradient_checkpointing": bool(policy.is_gradient_checkpointing),
      "trl": trl.__version__, "transformers": transformers.__version__,
      "torch": torch.__version__, "threads": torch.get_num_threads()}))


if __name__ == "__main__":
  sys.exit(main())
