"""Whole-tree operations: the one place a tree of parameters or optimizer state is cast, and
where one is freed before its replacement is read (a resume)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cast_floats(tree, dtype, copy: bool = False):
  """``tree``'s floating-point leaves in ``dtype``; other leaves (ints, bools) as they are.

  Leaves may be arrays or ``jax.ShapeDtypeStruct``s (their sharding kept). ``dtype`` "" or
  None keeps every leaf's dtype. ``copy``: every array leaf becomes a new buffer even where its
  dtype is unchanged (for trees that are donated beside the tree they were cast from)."""
  to = jnp.dtype(dtype) if dtype else None

  def one(x):
    target = to if to is not None and jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
    if isinstance(x, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(x.shape, target, sharding=x.sharding)
    if target != x.dtype:
      return x.astype(target)
    return jnp.copy(x) if copy else x

  return jax.tree.map(one, tree)


def _arrays(tree) -> list[jax.Array]:
  """``tree``'s live arrays, typed PRNG keys left out (their buffers are not exposed)."""
  return [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array) and not x.is_deleted()
          and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)]


def _buffers(x: jax.Array) -> set[int]:
  return {shard.data.unsafe_buffer_pointer() for shard in x.addressable_shards}


def free(tree, keep=()) -> int:
  """Deletes the device buffers of ``tree``'s arrays now, as donating them to a step would, but
  none that an array of ``keep`` (a tree) shares. Returns the bytes freed (on this process's
  devices). For a tree about to be replaced by one read from elsewhere: without it both are
  held while the new one is read, and the old one for as long as anything refers to it."""
  kept = set().union(*map(_buffers, _arrays(keep)))
  freed = 0
  for x in _arrays(tree):
    if not _buffers(x) & kept:
      freed += sum(shard.data.nbytes for shard in x.addressable_shards)
      x.delete()
  return freed
