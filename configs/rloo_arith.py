"""The quickstart's task by RLOO: each sample's baseline is the mean of the other samples of its
prompt; the KL in the sequence reward (s − β·Σ KL_t), as trl's RLOOTrainer.

    python -m ppojax.train --config configs/rloo_arith.py --workdir runs/rloo_arith

Everything else as configs/grpo_arith.py (8 prompts × 4 samples, SmolLM2-135M-Instruct).
"""

import pathlib
import runpy

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  grpo = runpy.run_path(str(pathlib.Path(__file__).with_name("grpo_arith.py")))
  return grpo["get_config"]("rloo")
