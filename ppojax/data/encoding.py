"""Prompt, preference and SFT data: chat templates, padding, encoding and batching (reading
and writing records: ``ppojax.data.records``).

    records  = read_records("prefs.jsonl", required=("prompt", "chosen", "rejected"))
    pairs    = encode_pairs(tokenizer, records, max_prompt_len=256, max_response_len=256)
    rows     = batch_indices(len(records), batch_size=32, seed=0, position=step)

Records come from JSONL, a JSON list, a ``datasets`` ``save_to_disk`` directory or a
parquet/csv/arrow file. A prompt is a string or a list of chat messages; with a chat template it
is rendered with the generation prompt appended (and the template's own variables,
``data.chat_template_kwargs``; a system message that a template rejects, as Gemma 2's does, is
folded into the first user message: ``prompt_ids``). Prompts are left-padded (right-aligned, so
generation continues from the last column); responses are right-padded and end with the stop
token (DESIGN: a response is the tokens up to and including the first stop token). Masks, never
pad ids, say which tokens count. Bad input raises ``DataError`` naming the file, line and field;
nothing is dropped silently.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from ppojax.data.chat import (  # noqa: F401  (encoding.prompt_ids etc., as before)
  PREFIX_PROBES,
  RESERVED_TEMPLATE_KWARGS,
  fold_system,
  plain_ids,
  prompt_ids,
  template_kwargs,
  template_prefix,
)
from ppojax.data.records import DataError

_PROMPT_TRUNCATE = ("left", "error")
_RESPONSE_TRUNCATE = ("right", "error")
_warned_no_pad: weakref.WeakSet = weakref.WeakSet()


class Encoded(NamedTuple):
  tokens: np.ndarray  # int32 [N, L]
  mask: np.ndarray  # bool [N, L]: real tokens (not padding)
  truncated: np.ndarray  # bool [N]: the sequence was longer than L and was cut


class Pairs(NamedTuple):
  prompt: Encoded
  chosen: Encoded
  rejected: Encoded


class SFTData(NamedTuple):
  prompt: Encoded
  response: Encoded


# ---------------------------------------------------------------------------------------------
# Tokenizing


def pad_token_id(tokenizer) -> int:
  """The tokenizer's pad id; the eos id (with a one-time warning) when it has no pad token."""
  if getattr(tokenizer, "pad_token_id", None) is not None:
    return int(tokenizer.pad_token_id)
  eos = getattr(tokenizer, "eos_token_id", None)
  if eos is None:
    raise DataError("the tokenizer has neither a pad token nor an eos token; set "
                    "tokenizer.pad_token (any id works: masks decide which tokens count)")
  try:
    first = tokenizer not in _warned_no_pad
    _warned_no_pad.add(tokenizer)
  except TypeError:  # not weak-referenceable / hashable: warn every time
    first = True
  if first:
    warnings.warn(f"the tokenizer has no pad token; padding with the eos token (id {eos}). "
                  "This is safe: masks, not pad ids, decide which tokens count.", stacklevel=2)
  return int(eos)


def response_ids(tokenizer, text: str, stop_id: int) -> list[int]:
  """Token ids of a response: the text without special tokens, then the stop token."""
  if not isinstance(text, str):
    raise DataError(f"a response must be a string, got {type(text).__name__}")
  return plain_ids(tokenizer.encode(text, add_special_tokens=False)) + [int(stop_id)]


# ---------------------------------------------------------------------------------------------
# Padding


def _check_pad_args(length: int, truncate: str, allowed: tuple[str, ...], fn: str) -> None:
  """Raises on a non-positive length or an unknown truncation mode."""
  if length < 1:
    raise DataError(f"{fn}: length must be >= 1, got {length}")
  if truncate not in allowed:
    raise DataError(f"{fn}: truncate must be one of {allowed}, got {truncate!r}")


def _pad(seqs: Sequence[Sequence[int]], length: int, pad_id: int, truncate: str,
         left: bool) -> Encoded:
  """Shared body of left_pad / right_pad."""
  n = len(seqs)
  tokens = np.full((n, length), pad_id, np.int32)
  mask = np.zeros((n, length), bool)
  truncated = np.zeros((n,), bool)
  for i, seq in enumerate(seqs):
    seq = list(seq)
    if not seq:
      raise DataError(f"row {i} is empty (zero tokens); every sequence needs at least one token")
    if len(seq) > length:
      if truncate == "error":
        raise DataError(f"row {i} has {len(seq)} tokens, more than the limit of {length}; raise "
                        f"the limit or allow truncation (truncate={'left' if left else 'right'!r})")
      seq, truncated[i] = (seq[-length:] if left else seq[:length]), True
    cols = slice(length - len(seq), length) if left else slice(0, len(seq))
    tokens[i, cols], mask[i, cols] = seq, True
  return Encoded(tokens, mask, truncated)


def left_pad(seqs: Sequence[Sequence[int]], length: int, pad_id: int,
             truncate: str = "left") -> Encoded:
  """Right-aligned rows padded on the left (prompts). Too-long rows keep their last ``length``
  tokens (``truncate="left"``) or raise (``"error"``)."""
  _check_pad_args(length, truncate, _PROMPT_TRUNCATE, "left_pad")
  return _pad(seqs, length, pad_id, truncate, left=True)


def right_pad(seqs: Sequence[Sequence[int]], length: int, pad_id: int,
              truncate: str = "right") -> Encoded:
  """Left-aligned rows padded on the right (responses). Too-long rows keep their first
  ``length`` tokens (``truncate="right"``) or raise (``"error"``)."""
  _check_pad_args(length, truncate, _RESPONSE_TRUNCATE, "right_pad")
  return _pad(seqs, length, pad_id, truncate, left=False)


# ---------------------------------------------------------------------------------------------
# Encoding datasets


def _field(record: Mapping, name: str, i: int) -> Any:
  """``record[name]``, or a DataError naming the record index and its fields."""
  if not isinstance(record, Mapping):
    raise DataError(f"record {i} is a {type(record).__name__}, not a dict")
  if name not in record:
    raise DataError(f"record {i} has no field {name!r} (fields: "
                    f"{', '.join(map(repr, record)) or 'none'})")
  return record[name]


def encode_prompts(tokenizer, records: Sequence[dict], max_len: int, *, field: str = "prompt",
                   system: str | None = None, chat_template: bool = True,
                   truncate: str = "left", chat_template_kwargs: Mapping | None = None
                   ) -> Encoded:
  """Left-padded prompt tokens [N, max_len] of ``record[field]`` for every record
  (``prompt_ids``: the chat template, ``system`` and ``chat_template_kwargs``)."""
  _check_pad_args(max_len, truncate, _PROMPT_TRUNCATE, "encode_prompts")
  pad, kwargs = pad_token_id(tokenizer), template_kwargs(chat_template_kwargs)
  seqs = []
  for i, record in enumerate(records):
    prompt = _field(record, field, i)
    try:
      seqs.append(prompt_ids(tokenizer, prompt, system=system, chat_template=chat_template,
                             chat_template_kwargs=kwargs))
    except DataError as e:
      raise DataError(f"record {i}, field {field!r}: {e}") from e
  try:
    return left_pad(seqs, max_len, pad, truncate)
  except DataError as e:
    raise DataError(f"prompts (field {field!r}): {e}") from e


def _encode_responses(tokenizer, records: Sequence[dict], field: str, max_len: int,
                      stop_id: int, pad: int) -> Encoded:
  """Right-padded response tokens [N, max_len] (cut on the right, flagged in ``truncated``)."""
  seqs = []
  for i, record in enumerate(records):
    text = _field(record, field, i)
    if not isinstance(text, str):
      raise DataError(f"record {i}, field {field!r}: a response must be a string (the "
                      f"assistant's text), got {type(text).__name__}")
    seqs.append(response_ids(tokenizer, text, stop_id))
  return right_pad(seqs, max_len, pad, "right")


def _stop_id(tokenizer, stop_id: int | None) -> int:
  """``stop_id``, defaulting to the tokenizer's eos id."""
  if stop_id is not None:
    return int(stop_id)
  if getattr(tokenizer, "eos_token_id", None) is None:
    raise DataError("the tokenizer has no eos token to end responses with; pass stop_id")
  return int(tokenizer.eos_token_id)


def encode_pairs(tokenizer, records: Sequence[dict], max_prompt_len: int,
                 max_response_len: int, *, stop_id: int | None = None,
                 system: str | None = None, chat_template: bool = True,
                 truncate: str = "left", chat_template_kwargs: Mapping | None = None) -> Pairs:
  """Preference pairs from records with "prompt", "chosen" and "rejected" fields."""
  stop, pad = _stop_id(tokenizer, stop_id), pad_token_id(tokenizer)
  prompt = encode_prompts(tokenizer, records, max_prompt_len, system=system,
                          chat_template=chat_template, truncate=truncate,
                          chat_template_kwargs=chat_template_kwargs)
  return Pairs(prompt,
               _encode_responses(tokenizer, records, "chosen", max_response_len, stop, pad),
               _encode_responses(tokenizer, records, "rejected", max_response_len, stop, pad))


def encode_sft(tokenizer, records: Sequence[dict], max_prompt_len: int, max_response_len: int,
               *, stop_id: int | None = None, system: str | None = None,
               chat_template: bool = True, truncate: str = "left",
               chat_template_kwargs: Mapping | None = None) -> SFTData:
  """Supervised fine-tuning data from records with "prompt" and "response" fields."""
  stop, pad = _stop_id(tokenizer, stop_id), pad_token_id(tokenizer)
  prompt = encode_prompts(tokenizer, records, max_prompt_len, system=system,
                          chat_template=chat_template, truncate=truncate,
                          chat_template_kwargs=chat_template_kwargs)
  return SFTData(prompt,
                 _encode_responses(tokenizer, records, "response", max_response_len, stop, pad))


# ---------------------------------------------------------------------------------------------
# Batching


def batch_indices(n: int, batch_size: int, seed: int, position: int) -> np.ndarray:
  """Row indices (int64 [batch_size]) of batch ``position`` of an endless stream that shuffles
  the ``n`` rows anew each epoch (``np.random.default_rng([seed, epoch])``). Batches straddle
  epoch boundaries; a pure function of its arguments, so a resumed run sees identical data."""
  if n <= 0:
    raise DataError(f"batch_indices: no rows to draw from (n={n}); the data set is empty")
  if batch_size <= 0:
    raise DataError(f"batch_indices: batch_size must be >= 1, got {batch_size}")
  if position < 0 or seed < 0:
    raise DataError(f"batch_indices: seed and position must be >= 0, got seed={seed}, "
                    f"position={position}")
  start = position * batch_size
  first, last = start // n, (start + batch_size - 1) // n
  stream = np.concatenate([np.random.default_rng([seed, epoch]).permutation(n)
                           for epoch in range(first, last + 1)])
  offset = start - first * n
  return stream[offset:offset + batch_size].astype(np.int64)
