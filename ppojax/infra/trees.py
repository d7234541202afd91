"""Whole-tree dtype changes: the one place a tree of parameters or optimizer state is cast."""

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
