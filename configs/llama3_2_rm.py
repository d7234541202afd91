"""RLHF with a reward model: Llama-3.2-1B-Instruct is trained by PPO against a learned reward
model, on prompts from a file (the original InstructGPT recipe: the critic starts from the reward
model). Written for one or more accelerators (bfloat16 compute, FSDP over all devices).

    # 1. a reward model on the policy's tokenizer, from pairs {"prompt", "chosen", "rejected"}:
    python -m ppojax.train_rm --config configs/rm_arith.py --workdir runs/llama_rm \
        --config.model.init=meta-llama/Llama-3.2-1B-Instruct --config.model.dtype=bfloat16 \
        --config.data.train=prefs_train.jsonl --config.data.eval=prefs_test.jsonl \
        --config.data.max_prompt_len=256 --config.data.max_response_len=128
    # 2. PPO against it:
    python -m ppojax.train --config configs/llama3_2_rm.py --workdir runs/llama_ppo \
        --config.data.path=prompts.jsonl --config.model.reward=runs/llama_rm/reward_model

``model.policy`` and ``model.reward`` are hub ids (downloaded once; meta-llama models are gated:
accept the licence and ``hf auth login`` first) or local Hugging Face directories. The reward
model is any checkpoint with a scalar ``score`` head (``*ForSequenceClassification`` with one
label, as ``ppojax.supervised.train_rm`` writes); it reads the policy's tokens, so it must use the same
tokenizer. It scores the last response token.

``data.path`` holds the prompts: JSONL, JSON, parquet/csv/arrow or a ``datasets`` save_to_disk
directory, with a "prompt" column (``data.field``) that is a string or a list of chat messages.
Held-out prompts (``data.eval_path``) are completed greedily before and after training
(eval_samples_before/after.jsonl); add text metrics in ``eval.metrics`` as
``{"name": "module:function"}``, each ``fn(prompts, completions, **columns) -> list[float]``.
"""

from __future__ import annotations

import ml_collections

from ppojax.run.config import defaults


def get_config() -> ml_collections.ConfigDict:
  c = defaults()
  c.num_iterations = 500
  c.sample_every = 25
  c.save_every = 50

  c.model.policy = "meta-llama/Llama-3.2-1B-Instruct"
  c.model.reward = "runs/llama_rm/reward_model"  # a reward-model directory (or hub id)
  c.model.critic_init = "reward"  # the critic starts as a copy of the reward model
  c.model.dtype = "bfloat16"
  c.model.remat = False  # True: recompute layer activations in the backward pass (less memory)

  c.data.task = "file"
  c.data.path = "prompts.jsonl"
  c.data.eval_path = ""  # held-out prompts, optional
  c.data.field = "prompt"
  c.data.max_prompt_len = 256  # longer prompts keep their end; counted in data/truncated_prompts
  c.data.system = ""  # "" : the template's default system header

  c.reward.kind = "model"
  c.reward.fn = ""  # unused with a reward model
  c.eval.batch_size = 64
  c.eval.metrics = ml_collections.ConfigDict()  # none built in: add text metrics by import path

  c.sampling.max_new_tokens = 128
  c.sampling.temperature = 0.7
  c.sampling.stop_ids = [128009, 128001, 128008]  # <|eot_id|>, <|end_of_text|>, <|eom_id|>
  c.sampling.pad_id = 128009  # the tokenizer has no pad token; masks decide what counts

  c.rl.batch_size = 64
  c.rl.num_epochs = 2
  c.rl.num_minibatches = 4
  c.rl.grad_accum = 2  # 8 sequences of up to 384 tokens per micro-batch
  c.rl.kl_coef = 0.05
  c.rl.missing_stop_penalty = 1.0  # a response cut off without <|eot_id|> loses 1
  c.rl.score_clip = 10.0
  c.rl.vf_coef = 0.1

  c.optim.actor.update(lr=1e-6, warmup_steps=10, decay="linear", end_factor=0.1)
  c.optim.critic.update(lr=5e-6, warmup_steps=10, decay="linear", end_factor=0.1)

  c.mesh.shape = (1, -1, 1)  # FSDP: parameters and optimizer states sharded over all devices
  return c
