"""The toy task in turns (ppojax/envs/count_turns.py): a tiny random-init transformer and a traced
environment take turns continuing a run of digits; the whole multi-turn iteration is one compiled
program. The multi-turn smoke test.

    python -m ppojax.train --config configs/toy_turns.py --workdir /tmp/toy_turns
"""

import pathlib
import runpy

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  toy = runpy.run_path(str(pathlib.Path(__file__).with_name("toy.py")))
  c = toy["get_config"]()  # model, prompts, PPO settings: the toy's
  c.env.name = "count_turns"
  c.env.max_turns = 3
  c.env.obs_tokens = 2  # the environment's answer: BOS and the run's next digit
  c.reward.kind = "env"  # each turn's reward on its last token, nothing else
  c.sampling.max_new_tokens = 4  # two digits and the stop token, one spare
  return c
