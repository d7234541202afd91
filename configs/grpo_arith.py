"""The quickstart's task (configs/quickstart.py: SmolLM2-135M-Instruct, one- and two-digit
arithmetic, exact-match reward) learned by GRPO: no critic, 4 samples per prompt compared within
their group, the KL to the reference as a k3 loss term.

    python -m ppojax.train --config configs/grpo_arith.py --workdir runs/grpo_arith

The same iteration shape as the quickstart: 8 prompts × 4 samples = 32 responses, 4 minibatches.
``get_config(algorithm)`` serves the other critic-free configs (dr_grpo_arith.py, rloo_arith.py,
reinforce_pp_arith.py), and ``--config configs/grpo_arith.py:rloo`` too.
"""

import ml_collections

from ppojax.config import defaults


def get_config(algorithm: str = "grpo") -> ml_collections.ConfigDict:
  c = defaults()
  c.algorithm = algorithm  # estimator, KL placement, aggregation: ppojax/algorithms.py
  c.num_iterations = 20
  c.sample_every = 10
  c.save_every = 10

  c.model.policy = "smollm2"

  c.data.task = "arith"
  c.data.max_prompt_len = 40
  c.data.eval_per_digits = 64  # 48 one-digit (all there are) + 64 two-digit test problems
  c.reward.kind = "text"
  c.reward.fn = "ppojax.arith:reward"
  c.eval.batch_size = 56
  c.eval.group_by = "digits"
  c.eval.metrics = ml_collections.ConfigDict(
      {"accuracy": "ppojax.arith:accuracy", "score": "ppojax.arith:reward"})

  c.sampling.max_new_tokens = 32
  c.sampling.temperature = 0.7
  c.sampling.num_samples_per_prompt = 4

  c.ppo.batch_size = 8  # prompts: 8 × 4 = 32 responses per iteration
  c.ppo.num_epochs = 1
  c.ppo.num_minibatches = 4
  c.ppo.kl_coef = 0.04  # GRPO's β (DeepSeekMath); in the loss for grpo / dr_grpo

  c.optim.actor.update(lr=5e-6, warmup_steps=4, decay="constant")
  return c
