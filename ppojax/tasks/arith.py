"""Small-number arithmetic: a verifiable-reward task for real instruct models (the quickstart).

A problem is one- or two-digit addition or subtraction, asked in plain words:

    prompt   "What is 23 + 45?"                    answer  "68"
    prompt   "What is 7 - 3?"                      answer  "4"

Both operands have the same number of digits (0-9 or 10-99); subtractions never go below zero.
Every problem belongs to exactly one split: ``"test"`` holds the problems whose stable hash is
divisible by 3, ``"train"`` the rest, so held-out accuracy is measured on problems that training
never shows.

The reward (``reward``, a trl-style reward function of the decoded texts) is

    score = 1 · [last number in the completion == answer] + FORMAT_BONUS · [it ends on a number]

and ``preference_pairs`` / ``sft_examples`` build data for the reward-model and SFT stages.
``python -m ppojax.tasks.arith {prompts,pairs,sft} --n N --split S --out FILE.jsonl`` writes them.
"""

from __future__ import annotations

import argparse
import re
from decimal import Decimal
from typing import Sequence

import numpy as np

from ppojax.data import records as records_lib

FORMAT_BONUS = 0.1
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_ENDS_ON_NUMBER = re.compile(r"-?\d+\s*[.!]?\s*$")
RESPONSES = ("{a} {op} {b} = {c}", "The answer is {c}.", "{c}", "{a} {op} {b} is {c}.")


def _result(a: int, op: str, b: int) -> int:
  return a + b if op == "+" else a - b


def problem(a: int, op: str, b: int) -> dict:
  """The record of one problem: prompt text, answer (a string, as in JSONL data), parts."""
  if op not in "+-" or len(op) != 1:
    raise ValueError(f"op must be '+' or '-', got {op!r}")
  return {"prompt": f"What is {a} {op} {b}?", "answer": str(_result(a, op, b)), "a": a, "op": op,
          "b": b, "digits": len(str(a))}


def split_of(a: int, op: str, b: int) -> str:
  """"test" for a third of all problems (a stable hash, the same on every machine), else "train"."""
  h = (a * 1_000_003 + b * 10_007 + (op == "-") * 101) * 2_654_435_761 % 2**32
  return "test" if (h >> 7) % 3 == 0 else "train"


def all_problems(digits: int, split: str) -> list[tuple[int, str, int]]:
  """Every (a, op, b) with ``digits``-digit operands in ``split``, in a fixed order."""
  if digits not in (1, 2):
    raise ValueError(f"digits must be 1 or 2, got {digits}")
  if split not in ("train", "test"):
    raise ValueError(f"split must be 'train' or 'test', got {split!r}")
  lo, hi = (0, 10) if digits == 1 else (10, 100)
  return [(a, op, b) for a in range(lo, hi) for b in range(lo, hi) for op in "+-"
          if (op == "+" or a >= b) and split_of(a, op, b) == split]


def problems(seed: int | Sequence[int], n: int, split: str = "train",
             digits: Sequence[int] = (1, 2)) -> list[dict]:
  """``n`` problems drawn with replacement from ``split``, the digit count uniform over
  ``digits`` (a pure function of its arguments; ``seed`` may be a tuple such as (seed, batch))."""
  rng = np.random.default_rng([*map(int, np.atleast_1d(seed)), 7])
  pools = {d: all_problems(d, split) for d in digits}
  out = []
  for d in rng.choice(list(digits), size=n):
    pool = pools[int(d)]
    out.append(problem(*pool[rng.integers(len(pool))]))
  return out


def eval_problems(n_per_digits: int, digits: Sequence[int] = (1, 2)) -> list[dict]:
  """A fixed held-out set: up to ``n_per_digits`` distinct test problems of each digit count
  (all of them when there are fewer), the same for every seed."""
  out = []
  for d in digits:
    pool = all_problems(d, "test")
    pick = np.random.default_rng([d, 11]).permutation(len(pool))[:n_per_digits]
    out += [problem(*pool[i]) for i in sorted(pick)]
  return out


def final_number(text: str) -> int | float | None:
  """The last number in ``text`` (thousands separators ignored): an int when it is whole
  ("68", "68.0"), else a float (never equal to an integer answer); None if there is none."""
  found = _NUMBER.findall(text.replace(",", ""))
  if not found:
    return None
  value = Decimal(found[-1])
  return int(value) if value == value.to_integral_value() else float(value)


def exact_match(completions: Sequence[str], answer: Sequence[str]) -> list[float]:
  """1.0 where the completion's last number equals the answer, else 0.0."""
  return [float(final_number(c) == int(a)) for c, a in zip(completions, answer, strict=True)]


def accuracy(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str], **_
             ) -> list[float]:
  """``exact_match`` as a trl-style metric function (see ``reward``)."""
  del prompts
  return exact_match(completions, answer)


def reward(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str], **_
           ) -> list[float]:
  """exact match + ``FORMAT_BONUS`` when the completion ends on a number (a trl-style reward
  function: dataset columns such as ``answer`` arrive as keyword lists)."""
  del prompts
  return [m + FORMAT_BONUS * bool(_ENDS_ON_NUMBER.search(c))
          for m, c in zip(exact_match(completions, answer), completions)]


def _wrong_answers(a: int, op: str, b: int, rng: np.random.Generator, k: int) -> list[int]:
  """Plausible mistakes: off by one or ten, the other operation, swapped digits."""
  c = _result(a, op, b)
  other = _result(a, "-" if op == "+" else "+", b)
  candidates = {c + 1, c - 1, c + 10, c - 10, other, int(str(abs(c))[::-1]) if c else 1}
  candidates = sorted(x for x in candidates if x != c and x >= 0)
  return [int(x) for x in rng.choice(candidates, size=min(k, len(candidates)), replace=False)]


def preference_pairs(seed: int, n: int, split: str = "train") -> list[dict]:
  """``n`` (prompt, chosen, rejected) pairs: the chosen response has the right answer, the
  rejected one the same wording with a plausible wrong answer (so only correctness differs)."""
  rng = np.random.default_rng([seed, 13])
  out = []
  for p in problems(seed, n, split):
    template = RESPONSES[rng.integers(len(RESPONSES))]
    wrong = _wrong_answers(p["a"], p["op"], p["b"], rng, 1)[0]
    fill = lambda c, p=p: template.format(a=p["a"], op=p["op"], b=p["b"], c=c)  # noqa: E731
    out.append({"prompt": p["prompt"], "chosen": fill(p["answer"]), "rejected": fill(wrong),
                "answer": p["answer"]})
  return out


def sft_examples(seed: int, n: int, split: str = "train") -> list[dict]:
  """``n`` (prompt, response) examples with correct, concise answers."""
  rng = np.random.default_rng([seed, 17])
  out = []
  for p in problems(seed, n, split):
    template = RESPONSES[rng.integers(len(RESPONSES))]
    out.append({"prompt": p["prompt"], "answer": p["answer"],
                "response": template.format(a=p["a"], op=p["op"], b=p["b"], c=p["answer"])})
  return out


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("kind", choices=("prompts", "pairs", "sft"))
  parser.add_argument("--n", type=int, default=1000)
  parser.add_argument("--split", choices=("train", "test"), default="train")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", required=True)
  args = parser.parse_args(argv)
  make = {"prompts": problems, "pairs": preference_pairs, "sft": sft_examples}[args.kind]
  records_lib.write_jsonl(make(args.seed, args.n, args.split), args.out)
  print(f"wrote {args.n} {args.kind} ({args.split}) to {args.out}")


if __name__ == "__main__":
  main()
