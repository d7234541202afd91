"""DAPO (Yu et al. 2025) on configs/rg_chain_sum.py's reasoning-gym task, over the same step:
GRPO's group advantages with every token weighing the same (token_mean), clip-higher
(ε_low 0.2, ε_high 0.28), no KL penalty (no reference held), dynamic sampling (twice the
prompts sampled, the groups whose scores differ learned from first) and the soft overlong
punishment over the last 8 tokens before the length limit; the update packs the rows in the
loss, so the fill's rows (groups without a score spread) cost it nothing. docs/algorithms.md,
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
  c.rl.dynamic_sampling, c.rl.oversample = True, 2.0  # 16 prompts sampled, 8 learned from
  c.rl.overlong_buffer, c.rl.overlong_factor = 8, 1.0  # of sampling.max_new_tokens
  # the fill's rows take no slot: 2, 4 or 6 rows of a micro-batch's 8 where the rows in the
  # loss fit (GRPO's rows, all in the loss with its KL term, fill 66-75 % of theirs: none fit)
  c.rl.pack_fractions = (0.25, 0.5, 0.75)
  return c
