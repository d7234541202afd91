"""Text reward and metric functions for tests/test_sources.py, given to the runner by import path
("text_reward_fn:reward"): pytest puts tests/ on sys.path, as ``python -m ppojax.train`` puts the
working directory there for a user's own module."""

from __future__ import annotations

from ppojax.tasks import arith

CALLS: list[dict] = []  # what ``reward`` was called with, one entry per call


def reward(prompts, completions, answer, **columns) -> list[float]:
  """``ppojax.tasks.arith.reward``, recording its arguments."""
  CALLS.append({"prompts": list(prompts), "completions": list(completions),
                "answer": list(answer), "columns": sorted(columns)})
  return arith.reward(prompts, completions, answer)


def length(prompts, completions, **_) -> list[float]:
  """The completion length in characters (a metric)."""
  del prompts
  return [float(len(c)) for c in completions]
