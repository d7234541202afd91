"""The prompts' shared prefix, found on the host: ``sampling.generate(..., prefix=...)`` then
prefills it once, for one row, and keeps its keys and values once for the batch."""

from __future__ import annotations

import numpy as np


def split_shared_prefix(tokens, mask, max_prefix: int | None = None):
  """(prefix [C], rest [B, W], rest_mask [B, W]) for left-padded host prompts [B, P]: the
  longest run of leading real tokens that every row shares, and each row's remaining tokens,
  still left-padded (W = the longest remainder: the last W columns of ``tokens``; the tokens
  under ``~rest_mask`` are left as they were). Every row keeps at least one token of its own, so
  the prefill of ``rest`` ends on each row's last prompt token. ``max_prefix`` caps C (a fixed C
  keeps one compiled program across batches)."""
  tokens, mask = np.asarray(tokens), np.asarray(mask, bool)
  if tokens.ndim != 2 or tokens.shape != mask.shape:
    raise ValueError(f"tokens and mask must both be [B, P]; got {tokens.shape}, {mask.shape}")
  lengths = mask.sum(axis=1)
  if not lengths.all():
    raise ValueError(f"rows {np.flatnonzero(lengths == 0).tolist()} have no prompt token")
  if (np.diff(mask.astype(np.int8), axis=1) < 0).any():
    raise ValueError("prompts must be left-padded: in each row, no pad after a real token")
  limit = int(lengths.min()) - 1
  if max_prefix is not None:
    limit = max(0, min(limit, max_prefix))
  starts = tokens.shape[1] - lengths  # each row's first real token
  heads = np.take_along_axis(tokens, starts[:, None] + np.arange(limit)[None, :], axis=1)
  same = (heads == heads[:1]).all(axis=0)
  shared = limit if same.all() else int(np.argmin(same))
  width = int(lengths.max()) - shared
  rest_mask = np.arange(width)[None, :] >= (width - (lengths - shared))[:, None]
  return heads[0, :shared].copy(), tokens[:, tokens.shape[1] - width:].copy(), rest_mask
