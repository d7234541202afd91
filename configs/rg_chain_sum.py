"""A reasoning-gym task: SmolLM2-135M-Instruct trained on reasoning-gym's ``chain_sum`` (sums and
differences of two one- or two-digit numbers, negative results included) by GRPO, with the
dataset's own verifier as the reward (not yet trained here: docs/learning.md has its untrained
baselines). Needs the extra: ``pip install -e ".[reasoning]"``.

    python -m ppojax.train --config configs/rg_chain_sum.py --workdir runs/rg_chain_sum

Questions come from ``reasoning_gym.create_dataset("chain_sum", seed=..., size=..., **options)``:
128 held-out ones from seed 10000 (repeats dropped), training batches from seeds drawn per
data position, held-out questions skipped (ppojax/tasks/reasoning.py). The reward is chain_sum's
``score_answer`` of the completion's answer (its last ``<answer>`` tag, else its last number):
1 for the exact number (partial credit only for a tagged answer that contains it). Everything
else as configs/grpo_arith.py (8 prompts × 4 samples, SmolLM2-135M-Instruct). Held-out
accuracy (score 1) per digit count before and after training, and before training also with two
instructions: "Reply with just the number." and reasoning-gym's own answer-tag instruction.
"""

import pathlib
import runpy

import ml_collections

from ppojax.tasks import reasoning


def get_config() -> ml_collections.ConfigDict:
  grpo = runpy.run_path(str(pathlib.Path(__file__).with_name("grpo_arith.py")))
  c = grpo["get_config"]("grpo")
  c.num_iterations = 30

  c.data.task = "reasoning_gym"
  c.data.rg.dataset = "chain_sum"
  c.data.rg.options = ml_collections.ConfigDict(
      {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2})
  c.data.rg.eval_seed = 10_000
  c.data.rg.extract = "last_number"  # "2 + 9 = 11" answers 11 (the default: the last line)
  c.data.rg.eval_size = 128
  c.data.max_prompt_len = 48  # the longest: "99 - 99 =" through the chat template

  c.reward.kind = "text"
  c.reward.fn = "ppojax.tasks.reasoning:reward"
  c.eval.group_by = "num_digits"
  c.eval.metrics = ml_collections.ConfigDict(
      {"accuracy": "ppojax.tasks.reasoning:accuracy", "score": "ppojax.tasks.reasoning:reward"})
  c.eval.baselines = ml_collections.ConfigDict(
      {"instructed": "Reply with just the number.", "rg_direct": reasoning.DIRECT})
  return c
