"""The quickstart's task by CISPO (MiniMax-M1): GRPO's group advantages in a REINFORCE term
weighted by the clipped, constant importance ratio, so clipped tokens keep their gradient;
the ratio capped above at 1 + 0.28 (DAPO's clip-higher), every token weighing the same.

    python -m ppojax.train --config configs/cispo_arith.py --workdir runs/cispo_arith

Everything else as configs/grpo_arith.py (8 prompts × 4 samples, SmolLM2-135M-Instruct).
"""

import pathlib
import runpy

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  grpo = runpy.run_path(str(pathlib.Path(__file__).with_name("grpo_arith.py")))
  c = grpo["get_config"]("cispo")
  c.rl.clip_eps_high = 0.28  # the weight's cap 1 + ε_high; below, 1 − clip_eps (0.2)
  return c
