"""The quickstart's task by GSPO: GRPO's group advantages under one importance ratio per
sequence, the length-normalised (π_θ/π_old)^{1/|y|}, clipped per sequence to [1 − 3e-4,
1 + 4e-4] (the GSPO paper's and verl's recipe ranges; a sequence ratio stays near 1).

    python -m ppojax.train --config configs/gspo_arith.py --workdir runs/gspo_arith

Everything else as configs/grpo_arith.py (8 prompts × 4 samples, SmolLM2-135M-Instruct).
"""

import pathlib
import runpy

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  grpo = runpy.run_path(str(pathlib.Path(__file__).with_name("grpo_arith.py")))
  c = grpo["get_config"]("gspo")
  c.rl.clip_eps_low, c.rl.clip_eps_high = 3e-4, 4e-4  # the sequence ratio's range
  return c
