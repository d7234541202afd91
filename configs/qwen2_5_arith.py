"""Qwen2.5-0.5B-Instruct learns small-number arithmetic by PPO with a verifiable text reward, on
one accelerator (bfloat16 compute, 128 prompts per iteration).

    python -m ppojax.train --config configs/qwen2_5_arith.py --workdir runs/qwen_arith
    python -m ppojax.train --config configs/qwen2_5_arith.py --workdir runs/qwen_arith \
        --config.model.policy=/path/to/Qwen2.5-0.5B-Instruct     # a local Hugging Face directory

``model.policy`` is a hub id (downloaded once with huggingface_hub, so the machine must be online)
or a local directory with config.json, *.safetensors and the tokenizer files
(``hf download Qwen/Qwen2.5-0.5B-Instruct --local-dir DIR`` on a connected machine). Any Qwen2,
Llama or Mistral instruct checkpoint works the same way; set ``sampling.stop_ids`` to its
end-of-turn tokens.

Prompts are one- and two-digit additions and subtractions ("What is 23 + 45?", ppojax/tasks/arith.py)
through the model's chat template; the reward is ``ppojax.tasks.arith:reward`` (1 for the right final
number, plus 0.1 for ending on a number), with a KL penalty against the initial model. Greedy
exact-match accuracy on 112 held-out problems (never trained on) is measured before and after
training, per digit count (eval.json).
"""

from __future__ import annotations

import ml_collections

from ppojax.run.config import defaults


def get_config() -> ml_collections.ConfigDict:
  c = defaults()
  c.num_iterations = 200
  c.sample_every = 20
  c.save_every = 50

  c.model.policy = "Qwen/Qwen2.5-0.5B-Instruct"  # or a local Hugging Face directory
  c.model.critic_init = "policy"  # no reward model: the critic starts from the policy backbone
  c.model.dtype = "bfloat16"  # compute dtype; parameters and optimizer states stay float32

  c.data.task = "arith"
  c.data.max_prompt_len = 64  # Qwen's template adds its default system prompt (~40 tokens in all)
  c.data.eval_per_digits = 64  # 48 one-digit (all there are) + 64 two-digit test problems
  c.reward.kind = "text"
  c.reward.fn = "ppojax.tasks.arith:reward"
  c.eval.batch_size = 112
  c.eval.group_by = "digits"
  c.eval.metrics = ml_collections.ConfigDict(
      {"accuracy": "ppojax.tasks.arith:accuracy", "score": "ppojax.tasks.arith:reward"})
  c.eval.baselines = ml_collections.ConfigDict({"instructed": "Reply with just the number."})

  c.sampling.max_new_tokens = 64
  c.sampling.temperature = 0.8
  c.sampling.stop_ids = [151645, 151643]  # <|im_end|> (end of turn), <|endoftext|>
  c.sampling.pad_id = 151643  # the tokenizer's pad token (<|endoftext|>)

  c.rl.batch_size = 128
  c.rl.num_epochs = 2
  c.rl.num_minibatches = 4  # 32 responses per update
  c.rl.kl_coef = 0.02
  c.rl.missing_stop_penalty = 0.5  # cut off by max_new_tokens without <|im_end|>

  c.optim.actor.update(lr=1e-6, warmup_steps=10, decay="constant")
  c.optim.critic.update(lr=1e-5, warmup_steps=10, decay="constant")
  return c
