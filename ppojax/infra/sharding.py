"""Device meshes and parameter placement from partition rules."""

from __future__ import annotations

import math
import re
from typing import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXES = ("data", "fsdp", "tensor")
BATCH = ("data", "fsdp")  # the axes that rows (sequences) are sharded over


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


def shard_rows(x: jax.Array, tensor_dim: int | None = None, row_dim: int = 0) -> jax.Array:
  """``x`` [B, ...] with its rows (dimension ``row_dim``) over the mesh's batch axes, and
  dimension ``tensor_dim`` (e.g. a KV cache's heads) over "tensor", the rest replicated, when
  traced under a mesh that has those axes (``jax.sharding.use_abstract_mesh``;
  ``step.make_step`` sets the run's) and they divide; ``x`` unchanged where nothing would be split.

  The activations need saying so: with FSDP the weights are sharded over "fsdp" along their
  feature dimension, and XLA's propagation may then keep activations whole on every device
  instead of splitting the rows. Without this constraint the Qwen2.5-0.5B PPO step compiled for
  v5e:2x4 held the whole batch's logits on every device ([16, 256, 151936] in float32)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not set(BATCH) <= set(mesh.axis_names):
    return x
  spec = [None] * x.ndim
  n = math.prod(mesh.shape[a] for a in BATCH)
  if n > 1 and x.shape[row_dim] % n == 0:
    spec[row_dim] = BATCH
  t = mesh.shape.get("tensor", 1)
  if tensor_dim is not None and t > 1 and x.shape[tensor_dim] % t == 0:
    spec[tensor_dim] = "tensor"
  if not any(spec):
    return x
  return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec(*spec))


# The axes a vocabulary-parallel table splits its rows over, in the order of the embedding's
# partition rule (V over "tensor", D over "fsdp"): from there one all-to-all over "fsdp" gives
# each device whole rows. Other orders need the table whole first (XLA's SPMD partitioner
# "cannot go from" one to the other).
VOCAB = ("tensor", "fsdp")


def _mesh_with(axes) -> jax.sharding.AbstractMesh | None:
  """The abstract mesh traced under (``jax.sharding.use_abstract_mesh``) if it has ``axes``."""
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh.empty or not set(axes) <= set(mesh.axis_names) else mesh


def _constrain(x: jax.Array, *spec) -> jax.Array:
  return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec(*spec))


def _data_rows(x: jax.Array, *rest) -> jax.Array:
  """``x`` with its rows (dimension 0) over "data" only (every row of a data replica's batch on
  each of its devices), ``rest`` the specs of the following dimensions."""
  mesh = jax.sharding.get_abstract_mesh()
  d = mesh.shape.get("data", 1)
  rows = "data" if d > 1 and x.shape[0] % d == 0 else None
  return _constrain(x, rows, *rest)


def vocab_axes(vocab_size: int) -> tuple[str, ...] | None:
  """The mesh axes (of "tensor", "fsdp") a vocabulary of ``vocab_size`` rows splits over under
  the current mesh: those with more than one device, if together they divide it; else None."""
  mesh = _mesh_with(VOCAB)
  if mesh is None:
    return None
  axes = tuple(a for a in VOCAB if mesh.shape[a] > 1)
  if not axes or vocab_size % math.prod(mesh.shape[a] for a in axes):
    return None
  return axes


def vocab_parallel_logits(x: jax.Array, table: jax.Array, dot) -> jax.Array:
  """``dot(x, table)``: logits [..., V] of hidden states x [..., D] against a table [V, D]
  (tied embeddings: x·Eᵀ), computed vocabulary-parallel under a mesh whose "tensor" × "fsdp"
  devices divide V (``vocab_axes``): every row of x on every device of its "data" replica
  (rows × D, small), V/n whole rows of the table per device (an all-to-all of its shards), and
  each device the logits of its V/n vocabulary entries for all rows (``shard_rows`` puts the
  rows back over the batch axes: an all-to-all of the logits). The table's gradient is then
  each device's own V/n rows, Σ over all rows of dlogits·x, formed locally: no partial sum of
  the whole [V, D] gradient on every device, no all-reduce of it.

  Without it, XLA gathered the whole table for the head and formed its gradient whole on every
  device before an all-reduce (Qwen2.5-0.5B on v5e 2x4: f32[151936, 896], 519 MiB, and the
  bf16 all-reduced copy, 260 MiB, at the update's peak)."""
  axes = vocab_axes(table.shape[0])
  if axes is None:
    return dot(x, table)
  logits = dot(_data_rows(x), _constrain(table, axes, None))
  return _data_rows(logits, *([None] * (logits.ndim - 2)), axes)


def constrain(tree, shardings):
  """``tree`` laid out as ``shardings`` (a matching pytree) inside a jitted function; None:
  ``tree`` as it is. For gradients, so that each arrives sharded like its parameter (a
  reduce-scatter) rather than whole on every device: a micro-batch loop's float32 accumulator
  of Llama-3.1-8B's LM head alone is 2 GB unsharded."""
  if shardings is None:
    return tree
  return jax.tree.map(jax.lax.with_sharding_constraint, tree, shardings)


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
  return NamedSharding(mesh, PartitionSpec(BATCH, *([None] * (ndim - 1))))


def place_prompts(prompts, mesh: Mesh):
  """A batch of ``experience.Prompts`` on the mesh: tokens and mask [B, P] over the batch axes
  (``batch_sharding``), a shared prefix [C] (every row's) replicated."""
  rows = batch_sharding(mesh)
  prefix = None if prompts.prefix is None else NamedSharding(mesh, PartitionSpec())
  return place(prompts, prompts._replace(tokens=rows, mask=rows, prefix=prefix))


def to_host(tree):
  """NumPy copies of a pytree's arrays, whole on every process.

  ``jax.device_get`` cannot read an array that spans devices of other processes (a batch
  sharded over a multi-host mesh, or even a replicated metric); those are all-gathered across
  processes first. Single-process arrays are copied as they are."""
  def gather(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return multihost_utils.process_allgather(x, tiled=True)
    return x
  return jax.tree.map(np.asarray, jax.device_get(jax.tree.map(gather, tree)))  # one transfer


def place(tree, shardings):
  """``jax.device_put(tree, shardings)``, also where a sharding spans other processes' devices
  (a multi-host mesh): every process holds the same values (the same checkpoint, seed and
  data) and fills the shards on its own devices. ``shardings``: a pytree matching ``tree``, or
  one sharding for every leaf."""
  if jax.process_count() == 1:
    return jax.device_put(tree, shardings)
  if isinstance(shardings, jax.sharding.Sharding):
    shardings = jax.tree.map(lambda _: shardings, tree)

  def one(x, sharding):
    if sharding.is_fully_addressable:
      return jax.device_put(x, sharding)
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):  # typed PRNG keys: place their data
      impl = jax.random.key_impl(x)
      return jax.random.wrap_key_data(one(jax.random.key_data(x), sharding), impl=impl)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
  return jax.tree.map(one, tree, shardings)


def compile_platform(params=None) -> str:
  """The platform ("cpu", "gpu", "tpu", ...) that a program over ``params`` (a tree of arrays,
  ShapeDtypeStructs or tracers; None: none) is compiled for:
  that of the devices their first leaf is placed on — a concrete array's or a
  ``ShapeDtypeStruct``'s sharding, or, traced, the mesh of its sharding or the abstract mesh
  traced under (a deviceless TPU compile traces on a CPU host) — else ``jax.default_backend()``."""
  for leaf in jax.tree.leaves(params)[:1]:
    if not isinstance(leaf, jax.core.Tracer) and getattr(leaf, "sharding", None) is not None:
      return next(iter(leaf.sharding.device_set)).platform
    mesh = getattr(getattr(jax.typeof(leaf), "sharding", None), "mesh", None)
    if mesh is not None and not mesh.empty:
      return mesh.abstract_device.platform
  mesh = jax.sharding.get_abstract_mesh()
  return jax.default_backend() if mesh.empty else mesh.abstract_device.platform
