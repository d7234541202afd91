"""A calculator tool whose input is the policy's text, which is untrusted: arithmetic is parsed
with Python's ``ast`` and evaluated node by node from a whitelist (numbers, + − × ÷ // % **,
unary signs, parentheses), never by ``eval`` or ``exec``. Sizes are bounded: the expression's
length, its node count, exponents, and every intermediate result's magnitude, so no input can
make it run long or allocate much.

    calculate("347 * 28")       == "9716"
    calculate("2 ** 100000")    == "error: exponent too large (at most 64)"
    calculate("__import__('os')") == "error: not arithmetic: Call"

``sft_examples`` writes warm-start dialogues that use it (``tasks.calc``'s problems).
"""

from __future__ import annotations

import ast
import math
import operator

from ppojax.envs import tools
from ppojax.tasks import calc

MAX_CHARS = 200  # longest expression read
MAX_NODES = 64  # syntax-tree nodes
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e30  # any intermediate result beyond this is an error

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
  """An expression the calculator refuses; its message is the observation the policy gets."""


def calculate(expression: str) -> str:
  """Evaluate an arithmetic expression and return the result.

  Args:
      expression: The arithmetic to compute, with numbers and + - * / // % ** and parentheses,
          e.g. "347 * 28".
  """
  try:
    return _format(evaluate(expression))
  except CalculatorError as e:
    return f"error: {e}"


def evaluate(expression: str) -> int | float:
  """The value of ``expression`` (``CalculatorError`` for anything else than bounded
  arithmetic)."""
  if not isinstance(expression, str):
    raise CalculatorError(f"the expression must be text, got {type(expression).__name__}")
  text = expression.strip().replace("×", "*").replace("÷", "/").replace("^", "**")
  if len(text) > MAX_CHARS:
    raise CalculatorError(f"expression too long ({len(text)} characters, at most {MAX_CHARS})")
  try:
    tree = ast.parse(text, mode="eval")
  except SyntaxError as e:
    raise CalculatorError(f"cannot parse {text!r}: {e.msg}") from None
  if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
    raise CalculatorError(f"expression too large (more than {MAX_NODES} parts)")
  return _value(tree.body)


def _value(node: ast.AST) -> int | float:
  if isinstance(node, ast.Constant) and type(node.value) in (int, float):
    return _bounded(node.value)
  if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
    return _UNARY[type(node.op)](_value(node.operand))
  if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
    left, right = _value(node.left), _value(node.right)
    if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
      raise CalculatorError(f"exponent too large (at most {MAX_EXPONENT})")
    if isinstance(node.op, ast.Pow) and abs(left) > 1 and right > 0 and (
        right * math.log10(abs(left)) > math.log10(MAX_MAGNITUDE)):
      raise CalculatorError("result too large")
    try:
      return _bounded(_BINARY[type(node.op)](left, right))
    except ZeroDivisionError:
      raise CalculatorError("division by zero") from None
    except (OverflowError, ValueError, TypeError) as e:  # e.g. a negative base to a fraction
      raise CalculatorError(str(e)) from None
  raise CalculatorError(f"not arithmetic: {type(node).__name__}")


def _bounded(x):
  if isinstance(x, complex) or not math.isfinite(x) or abs(x) > MAX_MAGNITUDE:
    raise CalculatorError("result too large or not a real number")
  return x


def _format(x: int | float) -> str:
  """An integer as digits; a float rounded to 10 significant digits, whole ones as integers."""
  if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
    return str(int(x))
  return str(x) if isinstance(x, int) else f"{x:.10g}"


def sft_examples(seed: int, n: int, split: str = "train") -> list[dict]:
  """``n`` warm-start pairs of ``tasks.calc``'s ``split`` for ``ppojax.sft`` (``data.train``
  "calc"), three per problem: offered the calculator (``tool_prompt``'s system message), the
  first turn (→ the call) and the second (the call, the tool's result → the answer); not
  offered it, the answer directly."""
  system = {"role": "system", "content": tool_prompt()}
  out = []
  for p in calc.problems((seed, 1), -(-n // 3), split):
    user = {"role": "user", "content": p["prompt"]}
    call = calc.tool_call(p["a"], p["b"])
    out.append({"prompt": [system, user], "response": call})
    out.append({"prompt": [system, user, {"role": "assistant", "content": call},
                           {"role": "tool", "content": p["answer"]}],
                "response": p["answer"]})
    out.append({"prompt": [user], "response": p["answer"]})
  return out[:n]


def tool_prompt() -> str:
  """The system message that offers the calculator (``tools.system_prompt``)."""
  return tools.system_prompt([calculate], "qwen3")
