"""The calculator task's warm start: SmolLM2-135M-Instruct learns, by SFT, to call the
calculator when the system message offers it (``<tool_call>{"name": "calculate", ...}``), to
answer with the tool's result, and to answer directly when no tool is offered
(``ppojax.envs.calculator.sft_examples``: three pairs per problem).

    python -m ppojax.sft --config configs/sft_calc.py --workdir runs/sft_calc

Its policy (runs/sft_calc/policy) starts both RL runs of docs/multiturn.md: configs/calculator.py
(with the tool) and configs/calculator_no_tool.py.
"""

import ml_collections

from ppojax.run.config import supervised_defaults


def get_config() -> ml_collections.ConfigDict:
  c = supervised_defaults()
  c.data.train = c.data.eval = "calc"
  c.data.train_size = 384  # 128 problems
  c.data.eval_size = 96
  c.data.max_prompt_len = 128  # the system message offers the tool
  c.data.max_response_len = 48  # a call is about 30 tokens
  c.train.num_epochs = 2.0
  c.optim.lr = 2e-5
  return c
