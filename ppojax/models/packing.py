"""Padding-free rows for the learn phase: B prompt + response sequences packed into N < B rows of
the same length, each sequence a segment of its row (attention within a segment only, positions
restarting at each segment's start), so the update's FLOPs follow the tokens sampled, not
``max_new_tokens``.

    lengths ℓ_i = real prompt tokens p_i + response tokens r_i
    (row_i, offset_i) = first-fit decreasing of ℓ into N rows of L slots   (``first_fit``)
    packed[row_i, offset_i + j] = the i-th sequence's j-th real token      (``pack``)
    log π(response_i,t) = packed output at (row_i, offset_i + p_i − 1 + t)  (``unpack``)

Shapes are static (N and L are fixed per program): where a batch's sequences do not fit, ``fits``
is False and the caller runs the padded rows instead (``learner.loss.packed_or_padded``).
The segment ids ride in the model's ``kv_mask`` (int32: 0 padding, i + 1 sequence i;
``attention.allowed_keys``). verl's ``use_remove_padding`` packs into one token stream of
dynamic length (flash-attention varlen); here the row count is static and the shape compiles
once.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp

Array = jax.Array


class Packing(NamedTuple):
  """B sequences in N rows of L slots, and where to read each response token's prediction."""

  tokens: Array  # [N, L] int32, 0 in free slots
  positions: Array  # [N, L] int32, each segment's own positions
  segments: Array  # [N, L] int32: i + 1 at sequence i's tokens, 0 in free slots
  targets: Array  # [N, L] int32: the next slot's token (what the head there predicts)
  read: Array  # [B, R] int32: the flat slot (row·L + column) predicting response token t
  fits: Array  # bool: every sequence found room (else the layout is not to be used)
  placed: Array  # [B] bool: the sequence holds slots (one without a real token is left out)


def valid_fractions(fractions) -> bool:
  """``rl.pack_fractions``: numbers in (0, 1], ascending, each once."""
  return (all(isinstance(f, (int, float)) and not isinstance(f, bool) and 0 < f <= 1
              for f in fractions) and list(fractions) == sorted(set(fractions)))


def packed_rows(batch: int, fraction: float) -> int:
  """N = ⌈fraction·B⌉ rows (at least 1) for a micro-batch of B rows."""
  return max(1, math.ceil(fraction * batch - 1e-9))


def first_fit(lengths: Array, rows: int, row_len: int) -> tuple[Array, Array, Array]:
  """First-fit decreasing: (row [B], offset [B], fits) placing sequences of ``lengths`` [B]
  into ``rows`` rows of ``row_len`` slots. Longest first (ties in index order), each into the
  first row with room; ``fits`` is False when some sequence found none (its row and offset
  are then meaningless)."""
  chex.assert_rank(lengths, 1)
  lengths = lengths.astype(jnp.int32)
  order = jnp.argsort(-lengths, stable=True)

  def place(fill, i):
    room = fill + lengths[i] <= row_len
    k = jnp.argmax(room)  # the first row with room (0 if none: then ok is False)
    ok = room[k]
    return fill.at[k].add(jnp.where(ok, lengths[i], 0)), (k, fill[k], ok)

  _, (row, offset, ok) = jax.lax.scan(place, jnp.zeros((rows,), jnp.int32), order)
  unsort = lambda x: jnp.zeros_like(x).at[order].set(x)  # noqa: E731
  return unsort(row).astype(jnp.int32), unsort(offset).astype(jnp.int32), jnp.all(ok)


def pack(tokens: Array, mask: Array, positions: Array, response_len: int, rows: int,
         placement: tuple[Array, Array, Array] | None = None) -> Packing:
  """The sequences of ``tokens``/``mask``/``positions`` [B, T] (left-padded prompt + response,
  the response in the last ``response_len`` columns: ``passes.sequence``) packed into
  ``rows`` rows of T slots. Each sequence's real tokens keep their order and positions, the
  masked-out columns between them (a multi-turn trajectory's holes) left out; a sequence needs
  at least one prompt token, or none at all: a sequence whose ``mask``
  row is all False takes no slot (``Packing.placed``; ``unpack`` gives it 0). ``placement``:
  ``first_fit``'s (row, offset, fits) for these lengths and rows, where the caller has it."""
  chex.assert_equal_shape([tokens, mask, positions])
  b, t = tokens.shape
  mask = mask.astype(jnp.bool_)
  row, offset, fits = (first_fit(jnp.sum(mask, axis=1), rows, t) if placement is None
                       else placement)
  rank = jnp.cumsum(mask, axis=1) - 1  # each real token's index within its sequence
  dest = jnp.where(mask, row[:, None] * t + offset[:, None] + rank, rows * t).reshape(-1)

  def scatter(values):  # [B, T] → [N, L]: the real tokens' values at their slots, 0 elsewhere
    flat = jnp.zeros((rows * t,), jnp.int32)
    return flat.at[dest].set(values.reshape(-1).astype(jnp.int32), mode="drop").reshape(rows, t)

  packed = scatter(tokens)
  segments = scatter(jnp.broadcast_to(jnp.arange(1, b + 1)[:, None], (b, t)))
  # the slot before each response token's own (its rank), which predicts it: a multi-turn
  # response's holes take no slot, and the token before a policy token is always real
  read = (row * t + offset)[:, None] + rank[:, t - response_len:] - 1
  targets = jnp.concatenate([packed[:, 1:], jnp.zeros((rows, 1), jnp.int32)], axis=1)
  return Packing(packed, scatter(positions), segments, targets,
                 jnp.clip(read, 0, rows * t - 1).astype(jnp.int32), fits, jnp.any(mask, axis=1))


def unpack(x: Array, packing: Packing, response_mask: Array) -> Array:
  """Per-slot outputs [N, L] back to the responses [B, R]: the output at the slot before each
  response token (where the model predicts it), 0 off ``response_mask`` and in the sequences
  left out (``Packing.placed``)."""
  chex.assert_equal_shape([x, packing.tokens])
  chex.assert_equal_shape([packing.read, response_mask])
  keep = response_mask & packing.placed[:, None]
  return jnp.where(keep, x.reshape(-1)[packing.read], 0).astype(x.dtype)


def fill(packing: Packing) -> Array:
  """The share of the packed slots holding a real token."""
  return jnp.mean((packing.segments > 0).astype(jnp.float32))

