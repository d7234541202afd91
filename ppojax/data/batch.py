"""A batch of left-padded prompts as the compiled step receives it, and the prefix its rows share.

Prompts that all begin with the same C tokens (a chat template's header and system prompt) can
carry them as ``Prompts.prefix`` [C] (``with_prefix``): every forward pass then runs those C
tokens once for the batch instead of once per row, and generation prefills them once. The rows
keep their full prompts.
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
