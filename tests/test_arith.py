"""Tests of ppojax.tasks.arith: the stable train/test split, problem sampling, the held-out set, answer
parsing, the reward and accuracy, preference pairs, SFT examples and the data-writing CLI."""

from __future__ import annotations

import re

import pytest

from ppojax.data import records as records_lib
from ppojax.tasks import arith

ALL_1 = [(a, op, b) for a in range(10) for b in range(10) for op in "+-" if op == "+" or a >= b]
ALL_2 = [(a, op, b) for a in range(10, 100) for b in range(10, 100) for op in "+-"
         if op == "+" or a >= b]


def _value(a: int, op: str, b: int) -> int:
  return a + b if op == "+" else a - b


def _parse(prompt: str) -> tuple[int, str, int]:
  m = re.fullmatch(r"What is (\d+) ([+-]) (\d+)\?", prompt)
  assert m, prompt
  return int(m[1]), m[2], int(m[3])


# ----------------------------------------------------------------------------- problems, splits


@pytest.mark.parametrize("digits, everything", [(1, ALL_1), (2, ALL_2)])
def test_splits_are_disjoint_and_cover_every_problem(digits, everything):
  train, test = arith.all_problems(digits, "train"), arith.all_problems(digits, "test")
  assert not set(train) & set(test)
  assert sorted(train + test) == sorted(everything)
  assert len(set(train)) == len(train) and len(set(test)) == len(test)
  assert 0.25 < len(test) / len(everything) < 0.42  # about a third
  assert all(arith.split_of(*p) == "train" for p in train)
  assert all(arith.split_of(*p) == "test" for p in test)
  assert arith.all_problems(digits, "test") == test  # a fixed order


def test_problem_record_and_bad_arguments():
  assert arith.problem(23, "+", 45) == {"prompt": "What is 23 + 45?", "answer": "68", "a": 23,
                                        "op": "+", "b": 45, "digits": 2}
  assert arith.problem(7, "-", 3)["answer"] == "4"
  for op in ("*", "", "+-"):
    with pytest.raises(ValueError, match="op must be"):
      arith.problem(1, op, 2)
  with pytest.raises(ValueError, match="digits must be 1 or 2"):
    arith.all_problems(3, "train")
  with pytest.raises(ValueError, match="split must be"):
    arith.all_problems(1, "valid")


@pytest.mark.parametrize("split", ["train", "test"])
def test_problems_are_deterministic_valid_and_in_their_split(split):
  drawn = arith.problems(5, 300, split)
  assert drawn == arith.problems(5, 300, split)
  assert drawn != arith.problems(6, 300, split)
  assert arith.problems((5, 1), 50, split) != arith.problems((5, 2), 50, split)
  for p in drawn:
    a, op, b = _parse(p["prompt"])
    assert (a, op, b) == (p["a"], p["op"], p["b"])
    assert arith.split_of(a, op, b) == split
    lo, hi = (0, 9) if p["digits"] == 1 else (10, 99)
    assert lo <= a <= hi and lo <= b <= hi
    assert int(p["answer"]) == _value(a, op, b) >= 0  # subtraction never goes below zero
  ones = sum(p["digits"] == 1 for p in drawn) / len(drawn)
  assert 0.35 < ones < 0.65  # the digit count is uniform over (1, 2)
  assert {p["digits"] for p in arith.problems(0, 40, split, digits=(2,))} == {2}
  assert {p["op"] for p in drawn} == {"+", "-"}


def test_eval_problems_are_fixed_distinct_and_held_out():
  held_out = arith.eval_problems(64)
  assert held_out == arith.eval_problems(64)
  ones = [p for p in held_out if p["digits"] == 1]
  twos = [p for p in held_out if p["digits"] == 2]
  assert len(ones) == len(arith.all_problems(1, "test")) == 48  # all of them (fewer than 64)
  assert len(twos) == 64
  keys = [(p["a"], p["op"], p["b"]) for p in held_out]
  assert len(set(keys)) == len(keys)
  assert all(arith.split_of(*k) == "test" for k in keys)
  assert arith.eval_problems(5, digits=(2,)) == [p for p in arith.eval_problems(5)
                                                 if p["digits"] == 2]


# ----------------------------------------------------------------------------- parsing, scores


@pytest.mark.parametrize("text, number", [
    ("68", 68),
    ("The answer is 68.", 68),
    ("12.", 12),
    ("The answer is 12. Done", 12),
    ("3 + 4 = 7 apples", 7),
    ("1,234", 1234),
    ("It costs 1,000,000 dollars", 1000000),
    ("-5", -5),
    ("from 3 down to -1,000", -1000),
    ("7 - 3 = 4", 4),  # "- 3" with a space is an operator, not a negative number
    ("no number here", None),
    ("", None),
    ("x\n42\n\n", 42),
])
def test_final_number(text, number):
  assert arith.final_number(text) == number


def test_final_number_of_a_decimal_with_zero_fraction():
  assert arith.final_number("The answer is 68.0") == 68
  assert arith.exact_match(["68.0"], ["68"]) == [1.0]


def test_reward_and_accuracy_on_hand_examples():
  completions = ["68", "The answer is 68.", "68 is the answer", "67", "no idea", "68!",
                 "23 + 45 = 68\n", "-68"]
  answer = ["68"] * len(completions)
  bonus = arith.FORMAT_BONUS
  expected = [1 + bonus, 1 + bonus, 1.0, bonus, 0.0, 1 + bonus, 1 + bonus, bonus]
  got = arith.reward(prompts=["What is 23 + 45?"] * 8, completions=completions, answer=answer,
                     digits=[2] * 8)  # extra columns are accepted and ignored
  assert got == pytest.approx(expected)
  assert arith.accuracy(prompts=[""] * 8, completions=completions, answer=answer) == [
      1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
  assert arith.exact_match(["4", "5"], [4, "4"]) == [1.0, 0.0]  # int answers (JSON) work too
  with pytest.raises(ValueError):  # one answer per completion
    arith.exact_match(["1", "2"], ["1"])


# ----------------------------------------------------------------------------- pairs, SFT


def _without_last_number(text: str) -> str:
  return re.sub(r"-?\d+(?=\D*$)", "<N>", text)


def test_preference_pairs_differ_only_in_a_wrong_number():
  pairs = arith.preference_pairs(3, 200)
  assert pairs == arith.preference_pairs(3, 200)
  templates = set()
  for p in pairs:
    a, op, b = _parse(p["prompt"])
    assert arith.split_of(a, op, b) == "train"
    assert int(p["answer"]) == _value(a, op, b)
    assert arith.final_number(p["chosen"]) == int(p["answer"])
    wrong = arith.final_number(p["rejected"])
    assert wrong is not None and wrong != int(p["answer"]) and wrong >= 0
    assert p["chosen"] != p["rejected"]
    assert _without_last_number(p["chosen"]) == _without_last_number(p["rejected"])
    assert p["chosen"] in {t.format(a=a, op=op, b=b, c=p["answer"]) for t in arith.RESPONSES}
    templates.add(_without_last_number(p["chosen"]).replace(f"{a} {op} {b}", "<Q>"))
  assert len(templates) == len(arith.RESPONSES)  # every wording is used
  assert all(arith.split_of(*_parse(p["prompt"])) == "test"
             for p in arith.preference_pairs(0, 30, "test"))


def test_sft_examples_have_correct_answers():
  examples = arith.sft_examples(1, 200)
  assert examples == arith.sft_examples(1, 200)
  for e in examples:
    a, op, b = _parse(e["prompt"])
    assert e["answer"] == str(_value(a, op, b))
    assert e["response"] in {t.format(a=a, op=op, b=b, c=e["answer"]) for t in arith.RESPONSES}
    assert arith.exact_match([e["response"]], [e["answer"]]) == [1.0]
    assert arith.reward([e["prompt"]], [e["response"]], [e["answer"]]) == [
        pytest.approx(1 + arith.FORMAT_BONUS)]


# ----------------------------------------------------------------------------- CLI


@pytest.mark.parametrize("kind, make, fields", [
    ("prompts", arith.problems, ("prompt",)),
    ("pairs", arith.preference_pairs, ("prompt", "chosen", "rejected")),
    ("sft", arith.sft_examples, ("prompt", "response")),
])
def test_cli_writes_jsonl_that_read_records_reads(kind, make, fields, tmp_path, capsys):
  out = tmp_path / "sub" / f"{kind}.jsonl"
  arith.main([kind, "--n", "7", "--split", "test", "--seed", "4", "--out", str(out)])
  assert f"wrote 7 {kind} (test) to {out}" in capsys.readouterr().out
  records = records_lib.read_records(out, required=fields)
  assert records == make(4, 7, "test")
  assert all(r["answer"] for r in records)
