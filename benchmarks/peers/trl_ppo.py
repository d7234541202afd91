"""Seconds per PPO iteration of trl's ``PPOTrainer``: the other side of ``ppo_step.py --trl``.

Table: the trl rows of docs/performance/peers.md, "PPO iteration vs trl: `benchmarks/ppo_step.py`"
and "LoRA PPO iteration vs trl + peft: `benchmarks/ppo_step.py --lora 16`".

It runs in an environment of its own, because trl 0.17 needs a transformers 4.x and ppojax
installs 5.x (``ppo_step.py --trl`` makes that environment with ``ensure_env`` and runs this
script in it, in the same benchmark run as ppojax's step). trl 0.17 is the only trl it runs
with: trl 1.13 removed ``trl.experimental.ppo`` (1.12 was its last release with a
``PPOTrainer``), so under trl 1.16 (``ensure_env(version="1.16")``, ``grpo_step.py``'s second
trl peer) it exits naming the missing import:

    python benchmarks/peers/trl_ppo.py --policy DIR --reward DIR --prompts FILE.json \\
        [--response-length 32] [--iterations 3] [--warmup 1] [--lora-rank R [--lora-critic]]

DIR are Hugging Face directories (the policy as ``*ForCausalLM``, the reward model as
``*ForSequenceClassification`` with one label; the critic starts from the reward model, trl's
default recipe and ppojax's ``critic_init = "reward"``). FILE holds the prompts as lists of token
ids, all of one length (so no padding differs from ppojax's side). The settings mirror
``ppo_step.py``: float32 on the CPU, every core; one epoch, one minibatch, no gradient
accumulation; the batch is the number of prompts; no stop token; no sample generations, no
logging integrations, no checkpoints.

Exact length: trl's ``PPOTrainer`` samples ``--response-length`` tokens (its own
``GenerationConfig``, ``max_new_tokens``; with ``stop_token=None`` it sets the policy's eos id
to None, so no row stops early), but it counts a response as ending at its first pad id, and
SmolLM2's pad id is its eos ``<|im_end|>``, which an instruct model samples when its answer
ends. ppojax bans its stop ids for all R tokens (min_new_tokens = max_new_tokens). This script
bans the pad and eos ids likewise: the policy's ``generation_config.suppress_tokens``, which
transformers copies into trl's config where that leaves the field at its default. It records
each response's length as trl counts it (up to the first pad id; the response's width where
none) at every ``generate`` call, and fails (``peer_env.check_lengths``: a non-zero exit naming
the expected and found lengths) if any differs from ``--response-length``.

LoRA (``--lora-rank R``): peft's ``LoraConfig`` of rank R and alpha ``--lora-alpha`` on every
linear layer of the policy's blocks (trl's ``peft_config``; the reference is the policy with
its adapters off). ``--lora-critic``: the value model too gets adapters of the same rank,
alpha and layers (peft's ``inject_adapter_in_model``, so it stays the
``*ForSequenceClassification`` whose backbone and ``score`` trl calls), and only those adapters
and its ``score`` head train, as ppojax's ``lora.critic`` trains its critic's adapters and value
head; without it the value model trains in full.

An iteration is the time between two of trl's ``on_step_end`` callbacks: rollout, scoring,
update, and trl's own bookkeeping of that iteration. The first ``--warmup`` iterations are not
counted. The last line printed is a JSON object with ``seconds_per_iteration`` (the median) and
the versions used.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import peer_env  # this folder; standard library only, so every environment imports it

# What ``ensure_env`` installs: trl 0.17 (the version the reference figure was taken
# with), the newest transformers 4.x it runs with, and the project's CPU build of torch.
TRL_REQUIREMENTS = ("torch==2.13.0", "trl==0.17.0", "transformers==4.51.3", "accelerate==1.15.0",
                    "datasets>=3", "peft==0.15.2")
# trl 1.16 (GRPOTrainer only: trl 1.13 removed trl.experimental.ppo, so it has no PPOTrainer)
# with the transformers, accelerate, datasets and peft that ppojax's own environment pins
# (trl 1.16 needs transformers >= 4.56.2, datasets >= 4.7).
TRL116_REQUIREMENTS = ("torch==2.13.0", "trl==1.16.0", "transformers==5.25.0",
                       "accelerate==1.16.0", "datasets==5.2.0", "peft==0.21.2")
# trl version -> (its key in the benchmarks' JSON, its environment's folder, its requirements);
# "trl" keeps the keys the figures before trl 1.16 were reported under
TRL_VERSIONS = {"0.17": ("trl", "trl-0.17-venv", TRL_REQUIREMENTS),
                "1.16": ("trl116", "trl-1.16-venv", TRL116_REQUIREMENTS),
                # trl 1.16 as a user runs it on a CPU: its LM head over every position
                # (``trl_grpo.py --all-positions-lm-head``), in the same environment
                "1.16-shipped": ("trl116_shipped", "trl-1.16-venv", TRL116_REQUIREMENTS)}


def default_env_dir(version: str = "0.17") -> Path:
  return peer_env.cache_dir(TRL_VERSIONS[version][1])


def ensure_env(directory: Path | None = None, version: str = "0.17",
               skip: str = "ppo_step.py --no-trl") -> Path:
  """The Python of a virtual environment with trl ``version``'s requirements (``TRL_VERSIONS``),
  created on first use."""
  return peer_env.ensure_env(directory or default_env_dir(version), TRL_VERSIONS[version][2],
                             f"trl {version}", skip)


def hf_tokenizer(policy_dir: str):
  """The left-padding tokenizer of a ppojax-exported Hugging Face directory, for transformers 4:
  built from tokenizer.json itself (ppojax writes the directory with transformers 5, whose
  tokenizer_config.json names a class that transformers 4 does not have), with the pad and eos
  tokens of its config.json."""
  from transformers import PreTrainedTokenizerFast  # pylint: disable=import-outside-toplevel
  model_config = json.loads((Path(policy_dir) / "config.json").read_text())
  tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(Path(policy_dir) / "tokenizer.json"),
                                      padding_side="left")
  tokenizer.pad_token = tokenizer.convert_ids_to_tokens(model_config["pad_token_id"])
  tokenizer.eos_token = tokenizer.convert_ids_to_tokens(model_config["eos_token_id"])
  return tokenizer


def step_clock():
  """A ``TrainerCallback`` whose ``marks`` are ``time.perf_counter()`` at its creation and at
  every ``on_step_end``: an iteration is the time between two marks."""
  from transformers import TrainerCallback  # pylint: disable=import-outside-toplevel

  class StepClock(TrainerCallback):
    def __init__(self):
      self.marks = [time.perf_counter()]

    def on_step_end(self, *_, **__):
      self.marks.append(time.perf_counter())

  return StepClock()


peak_rss_mb = peer_env.peak_rss_mb
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_config(rank: int, alpha: float, task_type):
  """peft's ``LoraConfig`` of ppojax's ``--lora``: rank, alpha, no dropout, no bias, every linear
  layer of the blocks (ppojax's ``all-linear``)."""
  from peft import LoraConfig  # pylint: disable=import-outside-toplevel
  return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, bias="none",
                    task_type=task_type, target_modules=list(LORA_TARGETS))


def lora_value_model(value, config) -> None:
  """Adapters of ``config`` injected into ``value`` (a ``*ForSequenceClassification``) in place,
  and only they and its ``score`` head left trainable: ppojax's LoRA critic (adapters and value
  head over a frozen base). In place, not a ``PeftModel``: trl reaches the value model's backbone
  and ``score`` by attribute, which a wrapper would hide."""
  from peft import inject_adapter_in_model  # pylint: disable=import-outside-toplevel
  inject_adapter_in_model(config, value)
  for name, param in value.named_parameters():
    param.requires_grad = "lora_" in name or name.startswith("score.")
  if not any(p.requires_grad for n, p in value.named_parameters() if "lora_" in n):
    raise RuntimeError("peft injected no adapters into the value model")


def record_lengths(model, pad_id: int) -> list[int]:
  """A list that gathers, at each ``model.generate`` call (trl's rollout calls it with
  ``input_ids`` and ``return_dict_in_generate``), each new response's length as trl counts it:
  the index of its first ``pad_id``, or its width where it has none."""
  lengths, generate = [], model.generate

  def recording(*args, **kwargs):
    out = generate(*args, **kwargs)
    new = out.sequences[:, kwargs["input_ids"].shape[1]:]
    for row in new.tolist():
      lengths.append(row.index(pad_id) if pad_id in row else len(row))
    return out

  model.generate = recording
  return lengths


def main():
  parser = peer_env.ppo_arguments(__doc__.splitlines()[0])
  parser.add_argument("--lora-rank", type=int, default=0,
                      help="train LoRA adapters (peft) on every linear layer of the policy's "
                      "blocks; the reference is the policy with its adapters off (0: full)")
  parser.add_argument("--lora-alpha", type=float, default=32.0)
  parser.add_argument("--lora-critic", action="store_true",
                      help="with --lora-rank: the value model trains adapters of the same rank, "
                      "alpha and layers plus its score head (the rest frozen), not in full")
  parser.add_argument("--gradient-checkpointing", action="store_true",
                      help="recompute the trained models' layer activations in the backward "
                      "pass (transformers' gradient checkpointing on policy and value model; "
                      "trl's PPOTrainer does not apply the TrainingArguments flag itself)")
  args = parser.parse_args()
  if args.lora_critic and not args.lora_rank:
    raise SystemExit("--lora-critic needs --lora-rank")

  # pylint: disable=import-outside-toplevel
  import torch
  import transformers
  import trl
  from datasets import Dataset
  from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
  try:
    from trl import PPOConfig, PPOTrainer
  except ImportError as e:  # trl >= 1.13: no PPO at all (trl.experimental.ppo was removed)
    raise SystemExit(f"trl {trl.__version__} has no PPOTrainer ({e}); this script needs trl "
                     "0.17 (TRL_REQUIREMENTS)") from e

  torch.set_num_threads(os.cpu_count())
  prompts = json.loads(Path(args.prompts).read_text())
  if len({len(p) for p in prompts}) != 1:
    raise ValueError("every prompt must have the same number of tokens")
  batch = len(prompts)
  n_iterations = args.warmup + args.iterations

  tokenizer = hf_tokenizer(args.policy)
  load = lambda cls, path, **kw: cls.from_pretrained(  # noqa: E731
      path, torch_dtype=torch.float32, **kw)
  policy = load(AutoModelForCausalLM, args.policy)
  # no pad or eos id in a response, as ppojax bans its stop ids (see the docstring)
  policy.generation_config.suppress_tokens = sorted({tokenizer.pad_token_id,
                                                     tokenizer.eos_token_id})
  lengths = record_lengths(policy, tokenizer.pad_token_id)
  ref_policy, peft_config = None, None  # with peft: the policy with its adapters disabled
  if args.lora_rank:
    peft_config = lora_config(args.lora_rank, args.lora_alpha, "CAUSAL_LM")
  else:
    ref_policy = load(AutoModelForCausalLM, args.policy)
  reward = load(AutoModelForSequenceClassification, args.reward, num_labels=1)
  value = load(AutoModelForSequenceClassification, args.reward, num_labels=1)
  if args.lora_critic:
    lora_value_model(value, lora_config(args.lora_rank, args.lora_alpha, None))
  if args.gradient_checkpointing:  # non-reentrant: the frozen embeddings need no grad (peft)
    for model in (policy, value):
      model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
  data = Dataset.from_dict({"input_ids": prompts * n_iterations})

  clock = step_clock()
  with tempfile.TemporaryDirectory() as out:
    config = PPOConfig(
        output_dir=out, per_device_train_batch_size=batch, gradient_accumulation_steps=1,
        num_mini_batches=1, num_ppo_epochs=1, response_length=args.response_length,
        local_rollout_forward_batch_size=batch, total_episodes=batch * n_iterations,
        num_sample_generations=0, stop_token=None, missing_eos_penalty=None,
        learning_rate=args.lr, report_to="none", save_strategy="no", logging_steps=10**6,
        disable_tqdm=True, use_cpu=True, bf16=False, fp16=False, seed=0)
    trainer = PPOTrainer(args=config, processing_class=tokenizer, model=policy,
                         ref_model=ref_policy, reward_model=reward, value_model=value,
                         train_dataset=data, eval_dataset=data.select(range(batch)),
                         callbacks=[clock], peft_config=peft_config)
    trainer.train()

  steps = [b - a for a, b in zip(clock.marks, clock.marks[1:])]
  if len(steps) != n_iterations:
    raise RuntimeError(f"trl ran {len(steps)} iterations, expected {n_iterations}")
  if len(lengths) != batch * n_iterations:
    raise RuntimeError(f"trl generated {len(lengths)} responses, expected "
                       f"{batch * n_iterations}")
  peer_env.check_lengths(lengths, args.response_length, "trl's responses")
  timed = steps[args.warmup:]
  print(json.dumps({
      "seconds_per_iteration": statistics.median(timed), "iterations": timed,
      "warmup_seconds": steps[:args.warmup], "batch": batch,
      "prompt_length": len(prompts[0]), "response_length": args.response_length,
      "trl": trl.__version__, "transformers": transformers.__version__,
      "torch": torch.__version__, "threads": torch.get_num_threads(),
      "lora_rank": args.lora_rank, "lora_critic": args.lora_critic,
      "trainable_value_parameters": sum(p.numel() for p in value.parameters()
                                        if p.requires_grad),
      "response_lengths": sorted(set(lengths)),
      "gradient_checkpointing": args.gradient_checkpointing,
      "peak_rss_mb": peak_rss_mb()}))


if __name__ == "__main__":
  sys.exit(main())
