"""The quickstart's task by Dr. GRPO: group-centred advantages without the std scaling, token sums
over the constant length limit (no length bias), the KL as a k3 loss term.

    python -m ppojax.train --config configs/dr_grpo_arith.py --workdir runs/dr_grpo_arith

Everything else as configs/grpo_arith.py (8 prompts × 4 samples, SmolLM2-135M-Instruct).
"""

import pathlib
import runpy

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  grpo = runpy.run_path(str(pathlib.Path(__file__).with_name("grpo_arith.py")))
  return grpo["get_config"]("dr_grpo")
