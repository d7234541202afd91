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

import re
import warnings
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

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


def _messages(prompt: str | list[dict], system: str | None) -> list[dict]:
  """Chat messages for a prompt: a string becomes one user message; ``system`` is prepended
  when given and the prompt has no system message of its own."""
  if isinstance(prompt, str):
    messages = [{"role": "user", "content": prompt}]
  elif isinstance(prompt, list):
    messages = [dict(m) for m in prompt]
  else:
    raise DataError(f"a prompt must be a string or a list of chat messages, got "
                    f"{type(prompt).__name__}")
  if system is not None and not any(m.get("role") == "system" for m in messages):
    messages.insert(0, {"role": "system", "content": system})
  return messages


def _plain_ids(ids: Any) -> list[int]:
  """A flat list of ints from whatever ``apply_chat_template`` returned (list, array, dict /
  BatchEncoding with "input_ids", or a batch of one)."""
  if isinstance(ids, Mapping) or hasattr(ids, "input_ids"):
    ids = ids["input_ids"]
  if hasattr(ids, "tolist"):
    ids = ids.tolist()
  ids = list(ids)
  if len(ids) == 1 and isinstance(ids[0], (list, tuple)):
    ids = list(ids[0])
  return [int(t) for t in ids]


def prompt_ids(tokenizer, prompt: str | list[dict], *, system: str | None = None,
               chat_template: bool = True, chat_template_kwargs: Mapping | None = None
               ) -> list[int]:
  """Token ids of a prompt: through the chat template with the generation prompt appended, or
  (``chat_template=False``) the raw text with the tokenizer's special tokens.

  ``chat_template_kwargs`` (``data.chat_template_kwargs``) reach the template as variables, e.g.
  ``{"enable_thinking": False}`` for Qwen3 (``template_kwargs``). A template that rejects a
  leading system message (Gemma 2's raises "System role not supported") gets it folded into the
  first user message the way Gemma 3's template folds it itself: the system text, a blank line,
  the user text (``fold_system``). Whether to fold is decided by trying the template, never by
  the model's name; a template that rejects the folded messages too (it objects to something
  else) gives a ``DataError`` with both of its errors."""
  kwargs = template_kwargs(chat_template_kwargs)
  if chat_template:
    if not getattr(tokenizer, "chat_template", None):
      raise DataError("the tokenizer has no chat template; set data.chat_template=False to feed "
                      "prompts as raw text")
    messages = _messages(prompt, system)
    try:
      return _render(tokenizer, messages, kwargs)
    except DataError as rejected:
      if (folded := fold_system(messages)) is None:
        raise
      try:
        return _render(tokenizer, folded, kwargs)
      except DataError as again:
        why = again.__cause__ or again
        raise DataError(f"{rejected}; with the system message folded into the first user "
                        f"message (as Gemma 3's template folds it) it failed too: "
                        f"{type(why).__name__}: {why}") from rejected.__cause__
  if not isinstance(prompt, str):
    raise DataError(f"the prompt is a {type(prompt).__name__} (chat messages?) but "
                    "data.chat_template=False feeds prompts as raw text; set "
                    "data.chat_template=True or give string prompts")
  if system is not None:
    raise DataError("a system prompt needs the chat template; set data.chat_template=True or "
                    "drop data.system")
  if kwargs:
    raise DataError("data.chat_template_kwargs are the chat template's variables; set "
                    "data.chat_template=True or drop data.chat_template_kwargs")
  return _plain_ids(tokenizer(prompt)["input_ids"])


def _render(tokenizer, messages: list[dict], kwargs: dict) -> list[int]:
  """``apply_chat_template``'s ids of ``messages`` with the generation prompt; a template error
  becomes a ``DataError`` naming the messages' roles, a missing package an ``ImportError``."""
  try:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        **kwargs)
  except ImportError as e:  # a missing package (transformers renders templates with jinja2)
    raise _missing_package(e, "rendering the tokenizer's chat template") from e
  except Exception as e:  # jinja errors, e.g. a template that rejects system messages
    raise DataError(f"the tokenizer's chat template failed on the messages "
                    f"{[m.get('role') for m in messages]}: {type(e).__name__}: {e}") from e
  return _plain_ids(ids)


def fold_system(messages: list[dict]) -> list[dict] | None:
  """``messages`` with a leading system message folded into the first user message as Gemma 3's
  template folds it: ``f"{system}\\n\\n{user}"``. None where there is nothing to fold this way
  (no leading system message, no user message, or content that is not text)."""
  if not messages or messages[0].get("role") != "system":
    return None
  system, rest = messages[0].get("content"), [dict(m) for m in messages[1:]]
  users = [m for m in rest if m.get("role") == "user"]
  if not isinstance(system, str) or not users or not isinstance(users[0].get("content"), str):
    return None
  users[0]["content"] = f"{system}\n\n{users[0]['content']}"
  return rest


# apply_chat_template's own arguments, which ppojax sets (or which change what it returns):
# data.chat_template_kwargs may not set them
RESERVED_TEMPLATE_KWARGS = (
    "conversation", "add_generation_prompt", "continue_final_message", "tokenize", "return_dict",
    "return_tensors", "return_assistant_tokens_mask", "padding", "truncation", "max_length",
    "tokenizer_kwargs")


def template_kwargs(kwargs: Mapping | None) -> dict:
  """``data.chat_template_kwargs`` as a plain dict for ``apply_chat_template`` (None: ``{}``): a
  mapping (a ``ConfigDict`` too) with string keys, none of them ``RESERVED_TEMPLATE_KWARGS``.
  As trl's and verl's ``chat_template_kwargs``: each key is a variable the template reads."""
  if kwargs is None:
    return {}
  if hasattr(kwargs, "to_dict"):  # an ml_collections ConfigDict
    kwargs = kwargs.to_dict()
  if not isinstance(kwargs, Mapping):
    raise DataError(f"data.chat_template_kwargs must be a dict of the chat template's variables, "
                    f"e.g. {{'enable_thinking': False}}; got the {type(kwargs).__name__} "
                    f"{kwargs!r}")
  if bad := [k for k in kwargs if not isinstance(k, str) or not k]:
    raise DataError(f"data.chat_template_kwargs: the keys must be the names (strings) of the chat "
                    f"template's variables, e.g. 'enable_thinking'; got {bad!r}")
  if reserved := sorted(set(kwargs) & set(RESERVED_TEMPLATE_KWARGS)):
    raise DataError(f"data.chat_template_kwargs sets {reserved}: ppojax sets these arguments of "
                    "apply_chat_template itself (prompts are tokenized with the generation "
                    "prompt appended); remove them")
  return dict(kwargs)


def _missing_package(e: ImportError, what: str) -> ImportError:
  """An ImportError naming the missing package and how to install it. Python's own name it in
  ``e.name``; transformers' ("apply_chat_template requires jinja2 to be installed") in the text."""
  found = re.search(r"No module named '([\w.]+)'|requires (\w+)", str(e))
  name = (e.name or (found and (found.group(1) or found.group(2))) or "").split(".")[0]
  if not name:
    return ImportError(f"{what} needs a package that is not installed here ({e}); "
                       "`pip install -e .` in the ppojax checkout installs every dependency")
  if "cannot import name" in str(e):  # installed, but a version without what is needed
    return ImportError(f"{what} needs a newer `{name}` than the one installed: "
                       f"pip install -U {name}. The error was: {e}", name=name)
  return ImportError(f"{what} needs the Python package `{name}`, which is not installed here: "
                     f"pip install {name} (or `pip install -e .` in the ppojax checkout, which "
                     f"installs every dependency of ppojax). The error was: {e}", name=name)


# Probe prompts for ``template_prefix``: letters, a digit, a leading space and a leading newline,
# so that the prefix stops before any token a prompt's first characters could merge into.
PREFIX_PROBES = ("a", "Z", "1", " a", "\na")


def template_prefix(tokenizer, *, system: str | None = None, chat_template: bool = True,
                    chat_template_kwargs: Mapping | None = None) -> list[int]:
  """The token ids that every prompt encoded by ``prompt_ids`` with these settings begins with:
  the chat template's header and system prompt, or the tokenizer's BOS token. It is the common
  prefix of the ids of a few probe prompts (``PREFIX_PROBES``); a prompt whose first tokens
  differ anyway (a rare merge across the boundary, or one cut from the left) is caught where
  the prefix is used (``experience.with_prefix``)."""
  seqs = [prompt_ids(tokenizer, probe, system=system, chat_template=chat_template,
                     chat_template_kwargs=chat_template_kwargs) for probe in PREFIX_PROBES]
  n = 0
  while all(len(ids) > n for ids in seqs) and len({ids[n] for ids in seqs}) == 1:
    n += 1
  return seqs[0][:n]


def response_ids(tokenizer, text: str, stop_id: int) -> list[int]:
  """Token ids of a response: the text without special tokens, then the stop token."""
  if not isinstance(text, str):
    raise DataError(f"a response must be a string, got {type(text).__name__}")
  return _plain_ids(tokenizer.encode(text, add_special_tokens=False)) + [int(stop_id)]


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
