"""Reading numbers from token ids inside a traced environment: a table of the vocabulary's
digit tokens, and the first number in a turn.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
MAX_VALUE = 10**5  # a number is capped here (no int32 overflow: digit tokens hold <= 3 digits)


class DigitTable(NamedTuple):
  """Per vocabulary entry: the value of a token that is ASCII digits (a leading space allowed)
  or −1, and its digit count; tuples, so that an environment holding one stays hashable."""

  value: tuple[int, ...]
  length: tuple[int, ...]
  spaced: tuple[bool, ...]  # the token starts with a space: it begins a new number


def digit_table(tokenizer) -> DigitTable:
  """The ``DigitTable`` of a tokenizer (each id decoded once)."""
  return _digit_table(tokenizer, len(tokenizer))


@functools.lru_cache(maxsize=4)
def _digit_table(tokenizer, size: int) -> DigitTable:
  value, length, spaced = np.full(size, -1, np.int64), np.zeros(size, np.int64), np.zeros(
      size, bool)
  for i in range(size):
    text = tokenizer.decode([i])
    core = text.lstrip(" ")
    if core and len(core) <= 3 and all("0" <= c <= "9" for c in core):
      value[i], length[i], spaced[i] = int(core), len(core), core != text
  return DigitTable(tuple(value.tolist()), tuple(length.tolist()), tuple(spaced.tolist()))


def first_number(table: DigitTable, tokens: Array, mask: Array) -> tuple[Array, Array]:
  """(value [B], found [B]): the first run of digit tokens in each row of ``tokens`` [B, L]
  under ``mask`` read as one number (a spaced digit token after a digit ends the run), capped
  at ``MAX_VALUE``."""
  value = jnp.asarray(np.asarray(table.value, np.int32))
  length = jnp.asarray(np.asarray(table.length, np.int32))
  spaced = jnp.asarray(np.asarray(table.spaced, bool))
  tokens = jnp.clip(tokens, 0, value.shape[0] - 1)
  v, n, s = value[tokens], length[tokens], spaced[tokens]
  digit = (v >= 0) & mask

  def read(carry, x):
    number, started, ended = carry
    d, vt, nt, st = x
    go_on = d & ~ended & ~(started & st)
    number = jnp.where(go_on, jnp.minimum(number * 10**nt + vt, MAX_VALUE), number)
    ended = ended | (started & ~go_on)
    return (number, started | go_on, ended), None

  init = (jnp.zeros(tokens.shape[:1], jnp.int32), jnp.zeros(tokens.shape[:1], bool),
          jnp.zeros(tokens.shape[:1], bool))
  (number, found, _), _ = jax.lax.scan(read, init, (digit.T, v.T, n.T, s.T))
  return number, found
