"""Verifiable tasks from reasoning-gym (``pip install -e ".[reasoning]"``): its procedural
generators as a task source, its verifiers as the reward.

    data.task = "reasoning_gym"
    data.rg.dataset = "chain_sum"                        # any reasoning_gym dataset name
    data.rg.options = {"min_digits": 1, "max_digits": 2}  # its config's fields
    reward.fn = "ppojax.tasks.reasoning:reward"                 # the dataset's own score_answer
    eval.metrics = {"accuracy": "ppojax.tasks.reasoning:accuracy",
                    "score": "ppojax.tasks.reasoning:reward"}

Every question comes from ``reasoning_gym.create_dataset(name, seed=s, size=k, **options)``:

- **held-out set**: ``seed = data.rg.eval_seed``, ``size = data.rg.eval_size``, its entries in
  order with repeated questions dropped (the same set for every run seed, like arith's);
- **training batch at data position p**: seeds s_0, s_1, ... drawn from
  ``np.random.default_rng([seed, p, 31])``; dataset k (size ``rl.batch_size``) is read in order,
  every entry whose question is held out skipped, until the batch is full. A pure function of
  (seed, p), so a resumed run gets the batches the interrupted one would have.

Held-out and training questions are therefore disjoint as texts, exactly (not by seed: many
generators seed item i with ``seed + i``, so datasets of nearby seeds share items, and a small
space such as one-digit sums repeats questions under any seeds). Training may repeat a
question across batches, as arith's draws with replacement do.

A record is ``{"prompt": question, "answer": answer, "entry": the dataset's entry,
"rg_dataset": name, "rg_options": options, "rg_extract": data.rg.extract}`` plus the entry's
scalar metadata fields (e.g. chain_sum's ``num_terms``, ``num_digits``: usable as
``eval.group_by``). The reward reads ``entry``, ``rg_dataset``, ``rg_options`` and
``rg_extract`` from those columns (trl's convention: a text reward gets every column as a
keyword list).

Answer extraction (``extract``, rule ``data.rg.extract``): the content of the completion's last
``<answer>…</answer>`` (``reasoning_gym.utils.extract_answer``, the format reasoning-gym's
system prompts ask for) where there is one, else

    "last_line"    the completion's last non-empty line, stripped (any answer type)
    "last_number"  the completion's last number, commas dropped ("2 + 9 = 11" -> "11"; for
                   numeric answers: the same rule as arith's exact match)

The score is then the dataset's ``score_answer(answer, entry)``, unchanged: for chain_sum 1 for
the exact number and len(answer) / len(text) partial credit where the text contains it; for
gsm_symbolic 1 when the first number of the answer is right, 0.01 for another number.
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping, Sequence

import numpy as np

INSTALL = 'pip install -e ".[reasoning]"'
# reasoning-gym's own answer instruction, reasoning_gym.utils.SYSTEM_PROMPTS["direct"] (0.1.25;
# a copy, so that configs load without the package): an eval.baselines instruction
DIRECT = ("Answer the question directly. Provide your answer between <answer> and </answer> "
          "tags. Do not return any preamble, explanation, or reasoning.")
EXTRACT_RULES = ("last_line", "last_number")  # data.rg.extract (see ``extract``)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
MAX_DRAWS = 64  # datasets drawn per batch before the held-out set is called too large
_SCALARS = (bool, int, float, str)


def require():
  """The ``reasoning_gym`` module, or an ImportError saying how to install it."""
  try:
    import reasoning_gym  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError(f'data.task="reasoning_gym" needs the reasoning-gym package, which is not '
                      f"installed: {INSTALL} (in the ppojax checkout) or pip install "
                      f"reasoning-gym. The error was: {e}") from e
  return reasoning_gym


def create(name: str, options: Mapping[str, Any], seed: int, size: int):
  """``reasoning_gym.create_dataset(name, seed=seed, size=size, **options)``, with errors that
  name the dataset, the options and the dataset's config fields."""
  rg = require()
  if name not in rg.factory.DATASETS:
    raise ValueError(f"data.rg.dataset={name!r} is not a reasoning-gym dataset; some are: "
                     f"{', '.join(sorted(rg.factory.DATASETS)[:12])}, ... "
                     f"({len(rg.factory.DATASETS)} in all)")
  try:
    return rg.create_dataset(name, seed=int(seed), size=int(size), **dict(options))
  except (TypeError, AssertionError, ValueError) as e:
    fields = [f for f in rg.factory.DATASETS[name][1].__dataclass_fields__
              if f not in ("seed", "size")]
    raise ValueError(f"data.rg.options={dict(options)!r} do not make a {name!r} dataset "
                     f"({type(e).__name__}: {e}); its options are: {', '.join(fields)}") from e


def check_config(config) -> None:
  """With ``data.task="reasoning_gym"``: ``data.rg`` names a dataset that its options make
  (tried with size 1), a held-out size >= 0, and the prompt column "prompt"; ValueError if not."""
  d = config.data
  if d.task != "reasoning_gym":
    return
  if not d.rg.dataset:
    raise ValueError('data.task="reasoning_gym" needs data.rg.dataset, a reasoning-gym dataset '
                     'name such as "chain_sum" or "gsm_symbolic"')
  if d.rg.eval_size < 0:
    raise ValueError(f"data.rg.eval_size={d.rg.eval_size} must be >= 0 (held-out questions "
                     "generated; 0: no held-out evaluation)")
  if d.rg.extract not in EXTRACT_RULES:
    raise ValueError(f"data.rg.extract={d.rg.extract!r} is not one of "
                     f"{', '.join(map(repr, EXTRACT_RULES))}: the answer is the last <answer> "
                     "tag, else the last line or the last number of the completion")
  if d.field != "prompt":
    raise ValueError(f"data.field={d.field!r}: reasoning-gym records hold the question in "
                     '"prompt"; leave data.field at "prompt"')
  create(d.rg.dataset, d.rg.options.to_dict(), d.rg.eval_seed, 1)


def record(entry: Mapping[str, Any], name: str, options: Mapping[str, Any],
           rule: str = "last_line") -> dict:
  """The record of one entry (see the module docstring): prompt, answer, the entry itself, the
  dataset's name and options, the extraction rule, and the entry's scalar metadata as columns
  of their own."""
  out = {"prompt": entry["question"], "answer": entry["answer"], "entry": dict(entry),
         "rg_dataset": name, "rg_options": dict(options), "rg_extract": rule}
  for key, value in entry.get("metadata", {}).items():
    if isinstance(value, _SCALARS) and key not in out:
      out[key] = value
  return out


def held_out(name: str, options: Mapping[str, Any], eval_seed: int, eval_size: int,
             rule: str = "last_line") -> list[dict]:
  """The held-out records: the dataset of ``eval_seed`` and ``eval_size``, in order, each
  question once (so there may be fewer than ``eval_size`` where the question space is small)."""
  dataset, seen, out = create(name, options, eval_seed, eval_size), set(), []
  for i in range(eval_size):
    entry = dataset[i]
    if entry["question"] not in seen:
      seen.add(entry["question"])
      out.append(record(entry, name, options, rule))
  return out


def train_records(name: str, options: Mapping[str, Any], seed: int, position: int, n: int,
                  exclude: frozenset[str] = frozenset(), rule: str = "last_line"
                  ) -> list[dict]:
  """Training batch ``position``: ``n`` records from datasets of seeds drawn from
  ``default_rng([seed, position, 31])``, read in order, questions in ``exclude`` skipped (a pure
  function of its arguments)."""
  rng = np.random.default_rng([int(seed), int(position), 31])
  out, seen = [], 0
  for _ in range(MAX_DRAWS):
    dataset = create(name, options, int(rng.integers(2**31)), n)
    for i in range(n):
      entry = dataset[i]
      seen += 1
      if entry["question"] not in exclude:
        out.append(record(entry, name, options, rule))
        if len(out) == n:
          return out
  raise ValueError(f"data.rg: {seen - len(out)} of {seen} generated {name!r} questions are held "
                   f"out ({len(exclude)} held-out questions): the held-out set covers nearly "
                   "every question these options can make; lower data.rg.eval_size or widen "
                   "data.rg.options")


def extract(completion: str, rule: str = "last_line") -> str | None:
  """The answer in a completion: the content of its last ``<answer>…</answer>``
  (``reasoning_gym.utils.extract_answer``) if it has one, else by ``rule``: its last non-empty
  line, stripped ("last_line"), or its last number, commas dropped ("last_number"); None if
  there is none."""
  if rule not in EXTRACT_RULES:
    raise ValueError(f"data.rg.extract={rule!r} is not one of {', '.join(EXTRACT_RULES)}")
  tagged = require().utils.extract_answer(completion)
  if tagged is not None:
    return tagged
  if rule == "last_number":
    numbers = _NUMBER.findall(completion.replace(",", ""))
    return numbers[-1] if numbers else None
  lines = [line.strip() for line in completion.splitlines() if line.strip()]
  return lines[-1] if lines else None


_SCORERS: dict[tuple[str, str], Any] = {}  # (name, options as JSON) -> score_answer


def score(completion: str, entry: Mapping[str, Any], name: str,
          options: Mapping[str, Any], rule: str = "last_line") -> float:
  """``score_answer(extract(completion, rule), entry)`` of the dataset ``name`` with ``options``
  (one dataset instance per name and options, made once)."""
  key = (name, json.dumps(dict(options), sort_keys=True, default=repr))
  if key not in _SCORERS:
    _SCORERS[key] = create(name, options, 0, 1).score_answer
  return float(_SCORERS[key](extract(completion, rule), dict(entry)))


def reward(prompts: Sequence[str], completions: Sequence[str], entry: Sequence[dict],
           rg_dataset: Sequence[str], rg_options: Sequence[dict],
           rg_extract: Sequence[str] | None = None, **_) -> list[float]:
  """The dataset's own ``score_answer`` of each completion's extracted answer (a trl-style
  reward: the record's columns arrive as keyword lists; no ``rg_extract``: "last_line")."""
  del prompts
  rules = rg_extract or ["last_line"] * len(completions)
  return [score(c, e, n, o, r) for c, e, n, o, r in
          zip(completions, entry, rg_dataset, rg_options, rules, strict=True)]


def accuracy(prompts: Sequence[str], completions: Sequence[str], entry: Sequence[dict],
             rg_dataset: Sequence[str], rg_options: Sequence[dict],
             rg_extract: Sequence[str] | None = None, **_) -> list[float]:
  """1.0 where the dataset scores the extracted answer as fully right (score 1), else 0.0."""
  return [float(s >= 1.0) for s in
          reward(prompts, completions, entry, rg_dataset, rg_options, rg_extract)]
