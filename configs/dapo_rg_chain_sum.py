"""DAPO (Yu et al. 2025) on configs/rg_chain_sum.py's reasoning-gym task, over the same step:
GRPO's group advantages with every token weighing the same (token_mean), clip-higher
(ε_low 0.2, ε_high 0.28), no KL penalty (no reference held), dynamic sampling (one and a half
times the prompts sampled, the groups whose scores differ learned from first) and the soft
overlong punishment over the last 8 tokens before the length limit. docs/algorithms.md,
"DAPO's pieces".

    python -m ppojax.train --config configs/dapo_rg_chain_sum.py --workdir runs/dapo_chain_sum

Everything else as configs/rg_chain_sum.py (8 prompts × 4 samples learned from per iteration,
SmolLM2-135M-Instruct, the dataset's verifier as the reward). Needs the extra:
``pip install -e ".[reasoning]"``.
"""

import pathlib
import runpy

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  base = runpy.run_path(str(pathlib.Path(__file__).with_name("rg_chain_sum.py")))
  c = base["get_config"]()
  c.rl.aggregation = "token_mean"  # DAPO's token-level loss
  c.rl.clip_eps_low, c.rl.clip_eps_high = 0.2, 0.28  # clip-higher
  c.rl.kl_coef = 0.0  # no KL term: no reference model
  c.rl.dynamic_sampling, c.rl.oversample = True, 1.5  # 12 prompts sampled, 8 learned from
  c.rl.overlong_buffer, c.rl.overlong_factor = 8, 1.0  # of sampling.max_new_tokens
  return c
