"""GPT-2 (124M, no chat template) trained by PPO on prompts from a file, with a text reward
function of your own given by import path. Runs on a CPU (slowly) or an accelerator.

    python -m ppojax.tasks.arith prompts --n 4000 --out data/arith_train.jsonl
    python -m ppojax.tasks.arith prompts --n 200 --split test --out data/arith_test.jsonl
    python -m ppojax.train --config configs/gpt2_file.py --workdir runs/gpt2
    python -m ppojax.train --config configs/gpt2_file.py --workdir runs/gpt2_mine \
        --config.data.path=my_prompts.jsonl --config.data.eval_path="" \
        --config.reward.fn=my_rewards:reward --config.eval.metrics.score=my_rewards:reward

``model.policy`` is a hub id (downloaded once, online) or a local Hugging Face directory
(``--config.model.policy=/path/to/gpt2``). GPT-2 has no chat template, so prompts are fed as raw
text (``data.chat_template=False``) and continued. Its only special token is <|endoftext|>
(id 50256, also used for padding); responses stop at it or at the end of the line.

A reward function has the trl signature and is found as ``module:function`` (the working
directory is on the import path, so ``my_rewards.py`` next to you works):

    def reward(prompts: list[str], completions: list[str], **columns) -> list[float]:
      # prompts: the raw prompt texts; completions: the decoded responses (special tokens
      # dropped); columns: every other field of the batch's records as lists, e.g. answer=[...]
      return [float(c.strip() == a) for c, a in zip(completions, columns["answer"])]

It must return one float per completion. The default here is the arithmetic reward
(``ppojax.tasks.arith:reward``, needing an "answer" column) on prompts made by ``ppojax.tasks.arith``; the
metrics in ``eval.metrics`` (same signature) score greedy completions of ``data.eval_path``.
"""

from __future__ import annotations

import ml_collections

from ppojax.run.config import defaults


def get_config() -> ml_collections.ConfigDict:
  c = defaults()
  c.num_iterations = 100
  c.sample_every = 10
  c.save_every = 25

  c.model.policy = "openai-community/gpt2"  # or a local Hugging Face directory
  c.model.critic_init = "policy"

  c.data.task = "file"
  c.data.path = "data/arith_train.jsonl"  # JSONL / JSON / parquet / datasets directory
  c.data.eval_path = "data/arith_test.jsonl"  # "" : no held-out evaluation
  c.data.field = "prompt"  # a string column: raw text, no chat template
  c.data.chat_template = False
  c.data.max_prompt_len = 64

  c.reward.kind = "text"
  c.reward.fn = "ppojax.tasks.arith:reward"  # your own: "my_rewards:reward"
  c.eval.batch_size = 50
  c.eval.metrics = ml_collections.ConfigDict(
      {"accuracy": "ppojax.tasks.arith:accuracy", "score": "ppojax.tasks.arith:reward"})
  c.eval.baselines = ml_collections.ConfigDict({"instructed": "Reply with just the number."})

  c.sampling.max_new_tokens = 24
  c.sampling.temperature = 1.0
  c.sampling.min_new_tokens = 1  # an empty answer is not an option
  c.sampling.stop_ids = [50256, 198, 628]  # <|endoftext|>, "\n", "\n\n"
  c.sampling.pad_id = 50256

  c.rl.batch_size = 64
  c.rl.num_epochs = 2
  c.rl.num_minibatches = 2
  c.rl.kl_coef = 0.05

  c.optim.actor.update(lr=5e-6, warmup_steps=5, decay="constant")
  c.optim.critic.update(lr=2e-5, warmup_steps=5, decay="constant")
  return c
