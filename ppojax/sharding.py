"""Device meshes and parameter placement from partition rules."""

from __future__ import annotations

import re
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXES = ("data", "fsdp", "tensor")


def make_mesh(shape: Sequence[int] = (-1, 1, 1), axes: Sequence[str] = AXES,
              devices=None) -> Mesh:
  """A Mesh of ``shape`` over ``axes``; one entry may be −1 (all remaining devices)."""
  devices = list(devices if devices is not None else jax.devices())
  shape = list(shape)
  if shape.count(-1) > 1:
    raise ValueError(f"mesh shape {tuple(shape)}: at most one entry may be -1")
  known = int(np.prod([s for s in shape if s != -1]))
  if -1 in shape:
    if len(devices) % known:
      raise ValueError(f"mesh shape {tuple(shape)} does not divide {len(devices)} devices")
    shape[shape.index(-1)] = len(devices) // known
  if int(np.prod(shape)) != len(devices):
    raise ValueError(
        f"mesh shape {tuple(shape)} needs {int(np.prod(shape))} devices, {len(devices)} present")
  return Mesh(np.asarray(devices).reshape(shape), tuple(axes))


def _path_str(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def spec_for(path: str, shape: tuple[int, ...], rules, mesh: Mesh) -> PartitionSpec:
  """The first matching rule's spec, with any axis that does not divide its dimension dropped."""
  for pattern, spec in rules:
    if re.search(pattern, path):
      spec = tuple(spec)[:len(shape)]
      fitted = []
      for dim, axis in zip(shape, spec):
        size = mesh.shape[axis] if axis is not None else 1
        fitted.append(axis if axis is not None and dim % size == 0 else None)
      return PartitionSpec(*fitted)
  raise ValueError(f"no partition rule matches parameter {path!r}")


def param_shardings(params, mesh: Mesh, rules):
  """A pytree of ``NamedSharding`` matching ``params`` (arrays or ShapeDtypeStructs)."""
  return jax.tree_util.tree_map_with_path(
      lambda p, x: NamedSharding(mesh, spec_for(_path_str(p), tuple(x.shape), rules, mesh)),
      params)


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
  """Leading (batch) axis over ("data", "fsdp"), the rest replicated."""
  return NamedSharding(mesh, PartitionSpec(("data", "fsdp"), *([None] * (ndim - 1))))
