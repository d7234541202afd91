"""What a checkpoint's leaves are (``checkpoint.Checkpointer``): the manifest of every leaf's
path, shape and dtype, its differences from a restore target's, typed PRNG keys stored as key
data and wrapped back, and the abstract leaves orbax restores into.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec


def is_key(x) -> bool:
  dtype = getattr(x, "dtype", None)
  return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def key_impl_name(x) -> str:
  """The PRNG implementation name of a typed key array or ShapeDtypeStruct ("threefry2x32")."""
  if isinstance(x, jax.Array):
    return str(jax.random.key_impl(x))
  impls = []
  jax.eval_shape(lambda k: impls.append(str(jax.random.key_impl(k))),
                 jax.ShapeDtypeStruct(x.shape, x.dtype))
  return impls[0]


def path_str(path) -> str:
  return jax.tree_util.keystr(path, simple=True, separator="/") or "<root>"


def shape_dtype(x) -> tuple[tuple[int, ...], np.dtype]:
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return tuple(x.shape), x.dtype
  return np.shape(x), np.result_type(x)


def manifest(tree) -> dict[str, dict]:
  """Shape and dtype (and PRNG impl for typed keys) of every leaf, by path."""
  leaves = {}
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    shape, dtype = shape_dtype(x)
    if is_key(x):
      leaves[path_str(path)] = {"shape": list(shape), "dtype": "key", "impl": key_impl_name(x)}
    else:
      leaves[path_str(path)] = {"shape": list(shape), "dtype": str(np.dtype(dtype))}
  return leaves


def unwrap_keys(tree):
  return jax.tree.map(lambda x: jax.random.key_data(x) if is_key(x) else x, tree)


def default_sharding() -> jax.sharding.Sharding:
  """Where a target leaf without a sharding goes: JAX's default device, replicated if multi-host."""
  if jax.process_count() == 1:
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return NamedSharding(jax.sharding.Mesh(np.asarray(jax.devices()), ("all",)), PartitionSpec())


def abstract_leaf(x) -> jax.ShapeDtypeStruct:
  """What orbax restores a target leaf into (typed keys: their uint32 key data)."""
  sharding = getattr(x, "sharding", None) or default_sharding()
  if is_key(x):
    data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
    return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)
  shape, dtype = shape_dtype(x)
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def rewrap_key(target_leaf, restored):
  """A restored leaf, wrapped back into a typed key if the target's leaf is one. (JAX itself writes
  a replicated key array's spec as P(None,): equivalent to, but not equal to, a target's P().)"""
  if not is_key(target_leaf):
    return restored
  return jax.random.wrap_key_data(restored, impl=key_impl_name(target_leaf))


def mismatches(saved: dict[str, dict], wanted: dict[str, dict]) -> list[str]:
  """Human-readable differences between a checkpoint's manifest and the target's."""
  problems = [f"{p}: in the checkpoint but not in the target" for p in saved if p not in wanted]
  problems += [f"{p}: in the target but not in the checkpoint" for p in wanted if p not in saved]
  for p in saved.keys() & wanted.keys():
    s, w = saved[p], wanted[p]
    if s["shape"] != w["shape"]:
      problems.append(f"{p}: shape {tuple(s['shape'])} in the checkpoint, "
                      f"{tuple(w['shape'])} in the target")
    elif (s["dtype"] == "key") != (w["dtype"] == "key") or s.get("impl") != w.get("impl"):
      problems.append(f"{p}: {s.get('impl', s['dtype'])} in the checkpoint, "
                      f"{w.get('impl', w['dtype'])} in the target")
  return sorted(problems)
