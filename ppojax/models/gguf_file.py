"""A GGUF file's header as Python values, and its tensors as views of the memory-mapped file.

The ``gguf`` package's ``GGUFReader`` turns every element of every metadata array into its own
NumPy view of the file: SmolLM2-135M's header (49,152 tokens, their types and 48,900 merges)
takes it 2.3-2.8 s on a 2-core EPYC, more than half of ``load_model("smollm2")``
(benchmarks/gguf_load.py). This reads the same header with ``struct`` in about a tenth of a
second and hands each tensor over as that reader does (same dtype and shape), for
``gguf.quants.dequantize``. Little-endian GGUF, versions 2 and 3
(ggml's docs/gguf.md):

  "GGUF" · u32 version · u64 tensor count · u64 key count
  key count × (string key · u32 value type · value)      string: u64 length, UTF-8 bytes
                                                        array: u32 element type, u64 count, items
  tensor count × (string name · u32 n_dims · u64 dims, fastest-moving first · u32 ggml type ·
                  u64 offset into the data section)
  data section: where the header ends, rounded up to ``general.alignment`` (default 32)
"""

from __future__ import annotations

import pathlib
import struct
from typing import Any, NamedTuple

import gguf
import numpy as np

_MAGIC = b"GGUF"
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}  # GGUF value type -> struct format
_STRING, _ARRAY = 8, 9
# ggml types whose data is stored as plain items (the others are quantised blocks of bytes)
_ITEM_TYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
               "I16": np.int16, "I32": np.int32, "I64": np.int64}


class GGUFError(ValueError):
  """The GGUF file is corrupt or holds something this loader does not support."""


class Tensor(NamedTuple):
  name: str
  tensor_type: gguf.GGMLQuantizationType
  shape: tuple[int, ...]  # GGUF's order: fastest-moving dimension first
  data: np.ndarray  # a view of the file: items, or a quantised type's bytes per row


class GGUFFile(NamedTuple):
  metadata: dict[str, Any]  # key -> str, int, float, bool or (nested) list
  tensors: list[Tensor]


class _Cursor:
  """Reads GGUF's little-endian values from ``buf`` onwards from ``pos``."""

  def __init__(self, buf: memoryview):
    self.buf, self.pos = buf, 0

  def scalar(self, fmt: str):
    size = struct.calcsize(fmt)
    if self.pos + size > len(self.buf):
      raise EOFError(f"the header runs past the end of the file ({len(self.buf)} bytes)")
    (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
    self.pos += size
    return value

  def string(self) -> str:
    n = self.scalar("Q")
    if self.pos + n > len(self.buf):
      raise EOFError(f"a string of {n} bytes runs past the end of the file")
    self.pos += n
    return str(self.buf[self.pos - n:self.pos], "utf-8")

  def value(self, kind: int):
    if kind in _SCALARS:
      return self.scalar(_SCALARS[kind])
    if kind == _STRING:
      return self.string()
    if kind != _ARRAY:
      raise ValueError(f"unknown metadata value type {kind}")
    item, n = self.scalar("I"), self.scalar("Q")
    if item in _SCALARS and item != 7:  # numbers: one NumPy read instead of n
      dtype = np.dtype("<" + _SCALARS[item])
      if self.pos + n * dtype.itemsize > len(self.buf):
        raise EOFError(f"an array of {n} numbers runs past the end of the file")
      values = np.frombuffer(self.buf, dtype, n, self.pos).tolist()
      self.pos += n * dtype.itemsize
      return values
    return [self.value(item) for _ in range(n)]


def read(path: str | pathlib.Path) -> GGUFFile:
  """The header of the GGUF file at ``path`` and views of its tensors (nothing is copied: the
  file is memory-mapped). Raises GGUFError, naming the file, for anything else than a whole
  little-endian GGUF file of version 2 or 3."""
  path = pathlib.Path(path)
  data = np.memmap(path, np.uint8, mode="r") if path.stat().st_size else np.zeros(0, np.uint8)
  cursor = _Cursor(memoryview(data))
  try:
    if bytes(cursor.buf[:4]) != _MAGIC:
      raise ValueError(f"it does not start with {_MAGIC!r}: not a GGUF file")
    cursor.pos = 4
    version = cursor.scalar("I")
    if version not in (2, 3):
      swapped = struct.unpack("<I", struct.pack(">I", version))[0]
      raise GGUFError(f"{path}: " + ("big-endian GGUF files are not supported" if swapped in (2, 3)
                                     else f"GGUF version {version} is not supported (2, 3 are)"))
    n_tensors, n_keys = cursor.scalar("Q"), cursor.scalar("Q")
    metadata = {}
    for _ in range(n_keys):
      key = cursor.string()
      metadata[key] = cursor.value(cursor.scalar("I"))
    infos = [_tensor_info(cursor) for _ in range(n_tensors)]
  except GGUFError:
    raise
  except (struct.error, EOFError, UnicodeDecodeError, ValueError) as e:
    raise GGUFError(f"{path} is not a readable GGUF file (truncated or corrupt?): {e}") from e
  alignment = metadata.get("general.alignment", 32)
  if not isinstance(alignment, int) or alignment <= 0:
    raise GGUFError(f"{path}: general.alignment is {alignment!r}, not a positive integer")
  start = -(-cursor.pos // alignment) * alignment
  return GGUFFile(metadata, _tensors(data, start, infos, path))


def _tensor_info(cursor: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
  name = cursor.string()
  shape = tuple(cursor.scalar("Q") for _ in range(cursor.scalar("I")))
  return name, shape, cursor.scalar("I"), cursor.scalar("Q")


def _tensors(data: np.ndarray, start: int, infos: list, path: pathlib.Path) -> list[Tensor]:
  """Each tensor's bytes in the data section at ``start``, viewed as gguf's reader views them."""
  tensors, seen = [], set()
  for name, shape, raw_type, offset in infos:
    where = f"{path}: tensor {name}"
    if name in seen:
      raise GGUFError(f"{where} appears twice")
    seen.add(name)
    try:
      kind = gguf.GGMLQuantizationType(raw_type)
    except ValueError as e:
      raise GGUFError(f"{where} has the unknown ggml type {raw_type}") from e
    block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    dims = tuple(reversed(shape))  # row-major, as NumPy and torch hold it
    n_bytes = int(np.prod(shape, dtype=np.int64)) * block_bytes // block
    begin = start + offset
    if begin + n_bytes > data.size:
      raise GGUFError(f"{path} is not a readable GGUF file (truncated or corrupt?): {name}'s "
                      f"data ends at byte {begin + n_bytes}, the file has {data.size}")
    raw = data[begin:begin + n_bytes]
    try:
      if kind.name in _ITEM_TYPES:
        view = raw.view(_ITEM_TYPES[kind.name]).reshape(dims)
      else:  # a row of whole blocks, as bytes
        view = raw.reshape(gguf.quants.quant_shape_to_byte_shape(dims, kind))
    except ValueError as e:
      raise GGUFError(f"{where} ({kind.name}) has the shape {dims}, which its data cannot "
                      f"take: {e}") from e
    tensors.append(Tensor(name, kind, shape, view))
  return tensors


def required_key(meta: dict, key: str, path: pathlib.Path) -> Any:
  """``meta[key]``, or a GGUFError naming the file and the missing key."""
  if key not in meta:
    raise GGUFError(f"{path}: required metadata key {key} is missing")
  return meta[key]
