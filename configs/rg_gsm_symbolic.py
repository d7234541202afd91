"""A reasoning-gym task: grade-school word problems from reasoning-gym's ``gsm_symbolic`` (GSM8K
templates with fresh names and numbers), by GRPO with the dataset's own verifier as the reward.
Needs the extra: ``pip install -e ".[reasoning]"``.

    python -m ppojax.train --config configs/rg_gsm_symbolic.py --workdir runs/rg_gsm_symbolic

Questions come from ``reasoning_gym.create_dataset("gsm_symbolic", seed=..., size=...)``: 64
held-out ones from seed 10000, training batches from seeds drawn per data position, held-out
questions skipped (ppojax/tasks/reasoning.py). The reward is gsm_symbolic's ``score_answer`` of the
completion's answer (its last ``<answer>`` tag, else its last number: where a worked solution
ends): 1 when it is right, 0.01 for another number, 0 without one. Prompts run to about 190
tokens and answers need room to reason (256 new tokens): an accelerator's job more than a
2-core CPU's. Untrained, SmolLM2-135M solves 1 of the 64 held-out problems (0 with either
instruction; docs/learning.md), too few for GRPO's groups to compare: a larger instruct model
(model.policy) suits the task better.
"""

import pathlib
import runpy

import ml_collections

from ppojax.tasks import reasoning


def get_config() -> ml_collections.ConfigDict:
  grpo = runpy.run_path(str(pathlib.Path(__file__).with_name("grpo_arith.py")))
  c = grpo["get_config"]("grpo")
  c.num_iterations = 100
  c.save_every = 20
  c.sample_every = 20

  c.data.task = "reasoning_gym"
  c.data.rg.dataset = "gsm_symbolic"
  c.data.rg.options = ml_collections.ConfigDict()  # difficulty 1.0, the only one it supports
  c.data.rg.eval_seed = 10_000
  c.data.rg.extract = "last_number"  # "... = 15 apples." answers 15 (the default: the last line)
  c.data.rg.eval_size = 64
  c.data.max_prompt_len = 192  # the longest question through the chat template: 182

  c.reward.kind = "text"
  c.reward.fn = "ppojax.tasks.reasoning:reward"
  c.eval.group_by = ""
  c.eval.batch_size = 32
  c.eval.metrics = ml_collections.ConfigDict(
      {"accuracy": "ppojax.tasks.reasoning:accuracy", "score": "ppojax.tasks.reasoning:reward"})
  c.eval.baselines = ml_collections.ConfigDict(
      {"instructed": "Reply with just the number.", "rg_direct": reasoning.DIRECT})
  c.sampling.max_new_tokens = 256
  return c
