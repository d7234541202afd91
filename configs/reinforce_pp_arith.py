"""The quickstart's task by REINFORCE++: discounted returns of the KL-shaped token rewards (k2),
whitened over the whole batch: no critic, no groups needed (the batch is the baseline).

    python -m ppojax.train --config configs/reinforce_pp_arith.py --workdir runs/reinforce_pp_arith

Everything else as configs/grpo_arith.py (8 prompts × 4 samples, SmolLM2-135M-Instruct).
"""

import pathlib
import runpy

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  grpo = runpy.run_path(str(pathlib.Path(__file__).with_name("grpo_arith.py")))
  return grpo["get_config"]("reinforce_pp")
