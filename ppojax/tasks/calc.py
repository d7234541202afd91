"""Products too large to do in one's head: the calculator-tool task (docs/multiturn.md).

    prompt  "What is 347 * 28?"        answer "9716"

Three-digit × two-digit products (100-999 × 10-99); every pair belongs to one split by a stable
hash (a third held out), as in ``tasks.arith``, whose reward and metric score the answer: the
final number of the policy's text. The calculator and the warm-start dialogues that use it are
``envs.calculator``'s.
"""

from __future__ import annotations

import json
from typing import Sequence

import numpy as np

from ppojax.tasks.arith import split_of

TOOL = "calculate"


def problem(a: int, b: int) -> dict:
  """The record of a × b."""
  return {"prompt": f"What is {a} * {b}?", "answer": str(a * b), "a": a, "b": b}


def problems(seed: int | Sequence[int], n: int, split: str = "train") -> list[dict]:
  """``n`` problems of ``split`` drawn with replacement (a pure function of the seed)."""
  rng = np.random.default_rng([*map(int, np.atleast_1d(seed)), 13])
  out = []
  while len(out) < n:
    a, b = int(rng.integers(100, 1000)), int(rng.integers(10, 100))
    if split_of(a, "*", b) == split:
      out.append(problem(a, b))
  return out


def eval_problems(n: int) -> list[dict]:
  """A fixed held-out set of ``n`` test problems, the same for every seed."""
  return problems(12345, n, "test")


def tool_call(a: int, b: int) -> str:
  """The call in the hermes/Qwen format (``data.tool_formats``' "qwen3")."""
  return ("<tool_call>\n" + json.dumps({"name": TOOL, "arguments": {"expression": f"{a} * {b}"}})
          + "\n</tool_call>")
