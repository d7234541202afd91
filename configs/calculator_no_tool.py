"""The baseline of configs/calculator.py: the same warm-started SmolLM2, task, reward and PPO
settings for the same iterations, with no tool offered (one turn, the default system message):
the products must be done in the model's head.

    python -m ppojax.train --config configs/calculator_no_tool.py --workdir runs/calculator_no_tool
"""

import pathlib
import runpy

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  tool = runpy.run_path(str(pathlib.Path(__file__).with_name("calculator.py")))
  c = tool["get_config"]()
  c.data.system = ""  # the template's default: no tool offered
  c.env.name = ""  # one turn
  return c
