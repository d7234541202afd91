"""The calculator tool on the host, in multi-turn PPO: SmolLM2-135M-Instruct (after
configs/sft_calc.py's warm start) is offered ``calculate(expression)`` in its system message,
calls it in the hermes/Qwen format, reads the result in the next turn and answers; the reward is
the answer's exact match (ppojax/tasks/arith.py's, on 3-digit × 2-digit products that a 135M
model cannot do in its head: ppojax/tasks/calc.py). The calculator parses arithmetic with
``ast`` from a whitelist, never ``eval`` (ppojax/envs/calculator.py).

    python -m ppojax.sft --config configs/sft_calc.py --workdir runs/sft_calc
    python -m ppojax.train --config configs/calculator.py --workdir runs/calculator

configs/calculator_no_tool.py is the same run without the tool (the baseline of
docs/multiturn.md).
"""

import pathlib
import runpy

import ml_collections

from ppojax.envs.calculator import tool_prompt


def get_config() -> ml_collections.ConfigDict:
  quickstart = runpy.run_path(str(pathlib.Path(__file__).with_name("quickstart.py")))
  c = quickstart["get_config"]()  # reward, metrics, instructed baseline, PPO settings
  c.num_iterations = 5
  c.sample_every = 5
  c.save_every = 5
  c.model.policy = "runs/sft_calc/policy"

  c.data.task = "calc"
  c.data.system = tool_prompt()
  c.data.max_prompt_len = 128
  c.data.eval_size = 128
  c.env.name = "tools"
  c.env.tools = "ppojax.envs.calculator:calculate"
  c.env.tool_format = "qwen3"
  c.env.max_turns = 3  # a call, the answer, one spare
  c.env.obs_tokens = 16  # the tool's message: the result framed by the chat template
  c.eval.batch_size = 64
  c.eval.group_by = ""

  c.sampling.max_new_tokens = 40  # a call is about 30 tokens
  c.rl.batch_size = 16
  return c
