"""Where a run's prompts come from, and how host-side text rewards see them.

``make_source(config, tokenizer)`` turns the ``data`` config section into a ``Source``: a pure
function from the data position (the iteration number) to a batch of left-padded prompts and
their records, so a resumed run gets exactly the batches the interrupted one would have got.
With ``data.shared_prefix`` (default) the prompts carry the tokens every one of them begins
with (the chat template's header: ``encoding.template_prefix``; BOS for the count task) as
``Prompts.prefix``, so the step runs them once per batch instead of once per row. Each batch
is padded to the bucket of its longest prompt (``data.prompt_bucket``: ``batch.bucket_length``),
so the step compiles once per bucket, not once per run at the longest length; the count task's
prompts keep their fixed length.

    data.task = "count"    the toy token task of ppojax/tasks/count.py (no tokenizer)
    data.task = "arith"    small-number arithmetic (ppojax/tasks/arith.py) through the chat template
    data.task = "calc"     3-digit × 2-digit products (ppojax/tasks/calc.py): the calculator tool
    data.task = "guess_number"  the guessing game's prompt (env.name = "guess_number")
    data.task = "file"     prompts from data.path: JSONL, JSON, a ``datasets`` directory, parquet
    data.task = "reasoning_gym"   a reasoning-gym generator, data.rg (ppojax/tasks/reasoning.py)

A *text reward* is a trl-style function ``fn(prompts, completions, **columns) -> scores``: it gets
the prompt texts, the decoded completions and every other column of the batch's records as
keyword lists (e.g. ``answer``).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from ppojax.core import selection
from ppojax.data import encoding
from ppojax.data import records as records_lib
from ppojax.data.batch import Prompts, repad, to_bucket, with_prefix
from ppojax.tasks import arith, calc, count, reasoning


class Batch(NamedTuple):
  prompts: Prompts  # host arrays [B, P]
  records: list[dict] | None  # one per row (None for token tasks)
  truncated: int  # prompts cut from the left to fit data.max_prompt_len


class Source(NamedTuple):
  batch: Callable[[int], Batch]  # data position → batch
  decode: Callable[[np.ndarray, np.ndarray], str]  # (tokens, mask) → text
  eval_records: list[dict] | None  # held-out prompts for evaluation, if the task has any
  encode: Callable[[list[dict]], encoding.Encoded] | None  # records → left-padded prompts
  prefix: list[int] | None = None  # the prompts' shared prefix (None: data.shared_prefix off)


GUESS_PROMPT = ("I am thinking of a whole number from {low} to {high}. Guess it! Reply with "
                "just your guess, a number. After each guess I will tell you whether my number "
                "is higher or lower.")


def guess_prompt(low: int, high: int) -> str:
  """The guessing game's prompt (``envs.guess_number``)."""
  return GUESS_PROMPT.format(low=low, high=high)


def prompts_per_batch(config) -> int:
  """The prompts a rollout samples: ``rl.batch_size``, × ``rl.oversample`` for dynamic
  sampling (``selection.sampled_prompts``)."""
  return selection.sampled_prompts(config.rl.batch_size, config.rl.get("oversample", 1.0))


def make_source(config, tokenizer, shared_prefix: bool | None = None) -> Source:
  """``shared_prefix`` overrides ``data.shared_prefix``."""
  d, batch_size = config.data, prompts_per_batch(config)
  if shared_prefix is None:
    shared_prefix = d.get("shared_prefix", True)
  share = lambda prompts, prefix: (  # noqa: E731
      with_prefix(prompts, prefix) if shared_prefix else prompts)
  if d.task == "count":
    prefix = [count.BOS]
    return Source(lambda pos: Batch(share(count.count_prompts(config.seed, pos, batch_size,
                                                              d.prompt_len), prefix), None, 0),
                  count.decode_count, None, None, prefix if shared_prefix else None)
  if d.task not in ("arith", "calc", "guess_number", "file", "reasoning_gym"):
    raise ValueError(f"data.task={d.task!r} is not known; choose count, arith, calc, "
                     "guess_number, file or reasoning_gym")
  if tokenizer is None:
    raise ValueError(f"data.task={d.task!r} needs a tokenizer, and model.policy="
                     f"{config.model.policy!r} ships none: set model.tokenizer")
  encode = prompt_encoder(config, tokenizer)
  prefix = (encoding.template_prefix(tokenizer, system=d.system or None,
                                     chat_template=d.chat_template,
                                     chat_template_kwargs=d.get("chat_template_kwargs"))
            if shared_prefix else None)
  if d.task == "arith":
    pick = lambda pos: arith.problems((config.seed, pos), batch_size, "train")  # noqa: E731
    held_out = arith.eval_problems(d.eval_per_digits) if d.eval_per_digits else None
  elif d.task == "calc":
    pick = lambda pos: calc.problems((config.seed, pos), batch_size, "train")  # noqa: E731
    held_out = calc.eval_problems(d.eval_size) if d.get("eval_size", 0) else None
  elif d.task == "guess_number":  # the game's one prompt; the environment draws the secrets
    text = guess_prompt(config.env.low, config.env.high)
    pick, held_out = (lambda pos: [{"prompt": text}] * batch_size), None  # noqa: E731
  elif d.task == "reasoning_gym":
    pick, held_out = reasoning_gym_task(config)
  else:
    records = records_lib.read_records(d.path, required=(d.field,))
    pick = lambda pos: [records[i] for i in encoding.batch_indices(  # noqa: E731
        len(records), batch_size, config.seed, pos)]
    held_out = (records_lib.read_records(d.eval_path, required=(d.field,)) if d.get("eval_path")
                else None)

  step = d.get("prompt_bucket", 64)

  def batch(pos: int) -> Batch:
    records = pick(pos)
    enc = encode(records)
    prompts = to_bucket(Prompts(enc.tokens, enc.mask), step, d.max_prompt_len)
    return Batch(share(prompts, prefix), records, int(enc.truncated.sum()))

  return Source(batch, lambda t, m: decode_text(tokenizer, t, m), held_out, encode, prefix)


def prompt_encoder(config, tokenizer, max_len: int | None = None, length: int | None = None
                   ) -> Callable[[list[dict]], encoding.Encoded]:
  """records → left-padded prompts [N, length] through the config's prompt format
  (``data.prompt_format``), chat template, system prompt, template variables
  (``data.chat_template_kwargs``) and truncation rule: each prompt cut to ``max_len`` tokens
  (default ``data.max_prompt_len``), then padded to ``length`` (default ``max_len``;
  ``padded``)."""
  d = config.data
  limit = max_len or d.max_prompt_len

  def encode(records: list[dict]) -> encoding.Encoded:
    records = formatted(records, d.field, d.get("prompt_format", "{prompt}"))
    return encoding.encode_prompts(tokenizer, records, limit, field=d.field,
                                   system=d.system or None, chat_template=d.chat_template,
                                   truncate=d.truncate,
                                   chat_template_kwargs=d.get("chat_template_kwargs"))

  if length is None or length == limit:
    return encode
  return padded(encode, length, encoding.pad_token_id(tokenizer))


def formatted(records: list[dict], field: str, fmt: str) -> list[dict]:
  """The records with each string prompt ``records[i][field]`` put in ``fmt``
  (``fmt.format(prompt=...)``); chat-message prompts and the format "{prompt}" leave them as
  they are."""
  if fmt == "{prompt}":
    return records
  return [dict(r, **{field: fmt.format(prompt=r[field])}) if isinstance(r[field], str) else r
          for r in records]


def padded(encode: Callable[[list[dict]], encoding.Encoded], length: int, pad_id: int
           ) -> Callable[[list[dict]], encoding.Encoded]:
  """``encode`` with its left-padded prompts re-padded to ``length`` columns (``batch.repad``:
  padding cut or added on the left; a prompt longer than ``length`` raises)."""

  def encode_padded(records: list[dict]) -> encoding.Encoded:
    enc = encode(records)
    tokens, mask = repad(enc.tokens, enc.mask, length, pad_id)
    return enc._replace(tokens=tokens, mask=mask)

  return encode_padded


def reasoning_gym_task(config) -> tuple[Callable[[int], list[dict]], list[dict] | None]:
  """(data position → the batch's records, the held-out records) of ``data.rg``: the held-out
  questions never appear in a training batch (ppojax/tasks/reasoning.py)."""
  rg = config.data.rg
  options = rg.options.to_dict()
  held_out = (reasoning.held_out(rg.dataset, options, rg.eval_seed, rg.eval_size, rg.extract)
              if rg.eval_size else [])
  exclude = frozenset(r["prompt"] for r in held_out)
  pick = lambda pos: reasoning.train_records(  # noqa: E731
      rg.dataset, options, config.seed, pos, prompts_per_batch(config), exclude, rg.extract)
  return pick, held_out or None


def decode_text(tokenizer, tokens: np.ndarray, mask: np.ndarray) -> str:
  """The text of the masked tokens, special tokens dropped."""
  return tokenizer.decode(np.asarray(tokens)[np.asarray(mask, bool)].tolist(),
                          skip_special_tokens=True)


def turns_text(decode, tokens: np.ndarray, mask: np.ndarray, seen: np.ndarray) -> str:
  """A multi-turn trajectory as text: the policy's turns as decoded, each observation between
  ⟦ ⟧ (its chat-template frame's special tokens as ``decode`` shows them)."""
  cols = np.flatnonzero(seen)
  parts, start = [], 0
  for j in range(1, len(cols) + 1):  # runs of columns with the same owner
    if j == len(cols) or mask[cols[j]] != mask[cols[start]]:
      run = cols[start:j]
      text = decode(tokens[run], np.ones(len(run), bool))
      parts.append(text if mask[cols[start]] else f" ⟦{text.strip()}⟧ ")
      start = j
  return "".join(parts)

def text_reward(fn: Callable, tokenizer, field: str = "prompt"
                ) -> Callable[[np.ndarray, np.ndarray, list[dict]], np.ndarray]:
  """``(responses, mask, records) → scores [B]`` from a trl-style text reward ``fn``."""

  def score(responses: np.ndarray, mask: np.ndarray, records: list[dict]) -> np.ndarray:
    completions = [decode_text(tokenizer, t, m) for t, m in zip(responses, mask)]
    return call_text_fn(fn, records, completions, field).astype(np.float32)

  return score


def call_text_fn(fn: Callable, records: list[dict], completions: list[str],
                 field: str = "prompt") -> np.ndarray:
  """``fn(prompts=..., completions=..., **columns)`` as float64 [N]: the prompts are the
  records' ``field``, every other column arrives as a keyword list (trl's convention)."""
  prompts = [r[field] for r in records]
  columns = {k: [r.get(k) for r in records] for k in records[0] if k != field}
  values = np.asarray(fn(prompts=prompts, completions=completions, **columns), np.float64)
  if values.shape != (len(records),):
    raise ValueError(f"{getattr(fn, '__name__', fn)} returned shape {values.shape} for "
                     f"{len(records)} completions; return one float per completion")
  return values
