"""The quickstart's task (configs/quickstart.py: SmolLM2-135M-Instruct, one- and two-digit
arithmetic, exact-match reward) learned by GRPO: no critic, 4 samples per prompt compared within
their group, the KL to the reference as a k3 loss term.

    python -m ppojax.train --config configs/grpo_arith.py --workdir runs/grpo_arith

The same iteration shape as the quickstart: 8 prompts × 4 samples = 32 responses, 4 minibatches.
``get_config(algorithm)`` serves the other critic-free configs (dr_grpo_arith.py, rloo_arith.py,
reinforce_pp_arith.py), and ``--config configs/grpo_arith.py:rloo`` too.
"""

import pathlib
import runpy

import ml_collections


def get_config(algorithm: str = "grpo") -> ml_collections.ConfigDict:
  quickstart = runpy.run_path(str(pathlib.Path(__file__).with_name("quickstart.py")))
  c = quickstart["get_config"]()  # task, model, reward, evaluation, sampling, lr: the same
  c.algorithm = algorithm  # estimator, KL placement, aggregation: ppojax/core/algorithms.py
  c.sampling.num_samples_per_prompt = 4
  c.rl.batch_size = 8  # prompts: 8 × 4 = 32 responses per iteration, as the quickstart's 32
  c.rl.kl_coef = 0.04  # GRPO's β (DeepSeekMath); in the loss for grpo / dr_grpo
  return c
