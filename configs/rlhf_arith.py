"""RLHF on the arithmetic task: PPO against a LEARNED reward model, the critic initialised from
it (the original RLHF recipe). The last stage of the SFT -> reward model -> PPO pipeline:

    python -m ppojax.sft --config configs/sft_arith.py --workdir runs/sft_arith
    python -m ppojax.train_rm --config configs/rm_arith.py --workdir runs/rm_arith
    python -m ppojax.train --config configs/rlhf_arith.py --workdir runs/rlhf_arith

or all of it, with the SFT policy's own mistakes as the reward model's preference pairs and
the over-optimisation figure: ``python benchmarks/rlhf.py --out runs/rlhf``.

The learned reward is what PPO maximises (objective/scores); the programmatic exact-match
accuracy is only watched: on every batch of sampled responses (monitor/accuracy) and greedily on
held-out problems before and after (eval.json), where every evaluation also carries the reward
model's score of the same greedy completions (eval/reward_model). Learned reward up while true
accuracy goes down is reward hacking (docs/learning.md measures it).
"""

import ml_collections

from ppojax.run.config import defaults


def get_config() -> ml_collections.ConfigDict:
  c = defaults()
  c.num_iterations = 15
  c.sample_every = 5
  c.save_every = 5

  c.model.policy = "runs/sft_arith/policy"  # the SFT stage's output ("smollm2" to skip SFT)
  c.model.reward = "runs/rm_arith/reward_model"  # the reward-model stage's output
  c.model.critic_init = "reward"

  c.data.task = "arith"
  c.data.max_prompt_len = 40
  c.reward.kind = "model"
  c.eval.batch_size = 56
  c.eval.group_by = "digits"
  c.eval.monitor = True
  c.eval.metrics = ml_collections.ConfigDict(
      {"accuracy": "ppojax.tasks.arith:accuracy", "score": "ppojax.tasks.arith:reward"})
  c.eval.baselines = ml_collections.ConfigDict({"instructed": "Reply with just the number."})

  c.sampling.max_new_tokens = 24
  c.sampling.temperature = 0.7

  c.rl.batch_size = 32
  c.rl.num_epochs = 2
  c.rl.num_minibatches = 2
  c.rl.kl_coef = 0.05

  c.optim.actor.update(lr=3e-6, warmup_steps=4, decay="constant")
  c.optim.critic.update(lr=1e-5, warmup_steps=4, decay="constant")
  return c
