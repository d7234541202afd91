"""Guess the number with SmolLM2-135M-Instruct: a multi-turn game traced into the step
(ppojax/envs/guess_number.py). The environment holds a number from 1 to 10 and answers each
guess with "Higher." or "Lower." through the chat template; the episode ends on the right guess
(reward 1, less 0.1 per turn spent before it) or after 4 turns, and each guess that is a number
in range earns 0.1. GRPO: 8 games per prompt on the same secret, compared whole.

    python -m ppojax.train --config configs/guess_number.py --workdir runs/guess_number
"""

import ml_collections

from ppojax.run.config import defaults


def get_config() -> ml_collections.ConfigDict:
  c = defaults()
  c.algorithm = "grpo"
  c.num_iterations = 30
  c.sample_every = 10
  c.save_every = 10

  c.model.policy = "smollm2"
  c.data.task = "guess_number"
  c.data.max_prompt_len = 64
  c.env.name = "guess_number"
  c.env.low, c.env.high = 1, 10
  c.env.max_turns = 4
  c.env.obs_tokens = 25  # the longest answer, framed by the chat template
  c.env.reward_per_turn = 0.1
  c.env.format_reward = 0.1
  c.reward.kind = "env"
  c.eval.metrics = ml_collections.ConfigDict()  # no held-out set: the game's secrets are drawn

  c.sampling.max_new_tokens = 8  # a guess and the end of the turn
  c.sampling.temperature = 0.8
  c.sampling.num_samples_per_prompt = 8

  c.rl.batch_size = 4  # prompts per iteration: 32 games
  c.rl.num_epochs = 1
  c.rl.num_minibatches = 2
  c.optim.actor.update(lr=3e-6, warmup_steps=2, decay="constant")
  return c
