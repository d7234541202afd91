"""A batch of left-padded prompts as the compiled step receives it, and the prefix its rows share.

Prompts that all begin with the same C tokens (a chat template's header and system prompt) can
carry them as ``Prompts.prefix`` [C] (``with_prefix``): every forward pass then runs those C
tokens once for the batch instead of once per row, and generation prefills them once. The rows
keep their full prompts.

A batch is padded to the *bucket* of its longest prompt (``bucket_length``: the next multiple of
``data.prompt_bucket``, at most ``data.max_prompt_len``), not always to the maximum: each bucket is
one compiled program, and a batch of short prompts runs short. ``repad`` moves left-padded rows to
another width without touching their real tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np

Array = jax.Array


class Prompts(NamedTuple):
  """A batch of left-padded prompts: tokens and mask [B, P], and optionally ``prefix`` [C], the
  first C real tokens of every row (each row has at least one more; ``with_prefix``)."""

  tokens: Array
  mask: Array
  prefix: Array | None = None


def with_prefix(prompts: Prompts, prefix) -> Prompts:
  """``prompts`` (host arrays) with ``prefix`` [C] as their shared prefix when every row begins
  with those C tokens and has at least one token after them; otherwise without one (the
  passes then run every row whole: the same numbers, another compiled program)."""
  prefix = np.asarray(prefix, np.int32).reshape(-1)
  tokens, mask = np.asarray(prompts.tokens), np.asarray(prompts.mask, bool)
  c = prefix.size
  lengths = mask.sum(axis=1)
  if not c or tokens.shape[1] <= c or (lengths <= c).any():
    return prompts._replace(prefix=None)
  starts = tokens.shape[1] - lengths  # left-padded: each row's first real token
  heads = np.take_along_axis(tokens, starts[:, None] + np.arange(c)[None], axis=1)
  if (np.diff(mask.astype(np.int8), axis=1) < 0).any() or (heads != prefix).any():
    return prompts._replace(prefix=None)
  return prompts._replace(prefix=prefix)


def bucket_length(longest: int, step: int, maximum: int) -> int:
  """The padded length of a batch whose longest prompt has ``longest`` tokens: the smallest
  multiple of ``step`` ≥ ``longest``, at most ``maximum`` (``step`` = 0: always ``maximum``).
  A few lengths per run, so a few compiled programs, and short batches run short."""
  if step < 0 or maximum < 1 or longest < 0:
    raise ValueError(f"bucket_length: needs step >= 0, maximum >= 1 and longest >= 0; got "
                     f"step={step}, maximum={maximum}, longest={longest}")
  if step == 0:
    return maximum
  return min(maximum, max(step, -(-longest // step) * step))


def real_width(mask) -> int:
  """Columns from a left-padded [N, P] ``mask``'s first column with a real token to its end:
  the narrowest width that keeps every row's tokens (0 without any)."""
  mask = np.asarray(mask, bool)
  used = mask.any(axis=0)
  return int(mask.shape[1] - np.argmax(used)) if used.any() else 0


def repad(tokens, mask, length: int, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """Left-padded host rows [N, P] as [N, ``length``]: columns cut from the left (only padding:
  a real token there raises) or ``pad_id`` columns added on the left; the real tokens keep
  their place at the end of each row."""
  tokens, mask = np.asarray(tokens), np.asarray(mask, bool)
  if tokens.ndim != 2 or tokens.shape != mask.shape:
    raise ValueError(f"repad: tokens and mask must both be [N, P]; got {tokens.shape}, "
                     f"{mask.shape}")
  width = tokens.shape[1]
  if length < real_width(mask):
    raise ValueError(f"repad: cutting to {length} columns would drop real tokens (the longest "
                     f"row needs {real_width(mask)}); pad to at least that")
  if length <= width:
    return tokens[:, width - length:], mask[:, width - length:]
  extra = length - width
  return (np.pad(tokens, ((0, 0), (extra, 0)), constant_values=pad_id),
          np.pad(mask, ((0, 0), (extra, 0)), constant_values=False))


def to_bucket(prompts: Prompts, step: int, maximum: int) -> Prompts:
  """Host ``prompts`` cut from the left to ``bucket_length`` of their longest row (every column
  cut is padding); the prefix, if any, as it was."""
  length = bucket_length(real_width(prompts.mask), step, maximum)
  tokens, mask = repad(prompts.tokens, prompts.mask, min(length, np.shape(prompts.tokens)[1]))
  return prompts._replace(tokens=tokens, mask=mask)
