"""Reading and writing training records: JSONL, a JSON list, a ``datasets`` ``save_to_disk``
directory or a parquet/csv/arrow file, each record a JSON object.

    records = read_records("prefs.jsonl", required=("prompt", "chosen", "rejected"))
    write_jsonl(records, "out.jsonl")

Bad input raises ``DataError`` naming the file, line and field; nothing is dropped silently.
"""

from __future__ import annotations

import json
import os
import pathlib
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ppojax.infra import files

_DATASET_SUFFIXES = (".parquet", ".csv", ".arrow")


class DataError(ValueError):
  """Bad or missing training data; the message says what was wrong, where, and what to do."""


def read_records(source: str | os.PathLike, required: Sequence[str] = (),
                 split: str = "train") -> list[dict]:
  """Records (dicts) from a .jsonl/.json file, a ``save_to_disk`` directory (``split`` picks one
  of a DatasetDict's splits; a plain Dataset has none and ignores it) or a .parquet/.csv/.arrow
  file (these three and directories need the ``datasets`` package).

  Every ``required`` field must be present in every record and be a string or a list of chat
  messages ({"role", "content"} dicts).
  """
  path = pathlib.Path(source)
  if isinstance(required, str):
    required = (required,)
  if not path.exists():
    raise DataError(f"data file not found: {path} (no such file or directory)")
  suffix = path.suffix.lower()
  if path.is_dir():
    located = _read_saved_dataset(path, split)
  elif suffix == ".jsonl":
    located = _read_jsonl(path)
  elif suffix == ".json":
    located = _read_json(path)
  elif suffix in _DATASET_SUFFIXES:
    located = _read_dataset_file(path)
  else:
    raise DataError(f"{path}: unsupported data file type {path.suffix!r}; use .jsonl, .json, "
                    f"{', '.join(_DATASET_SUFFIXES)} or a datasets save_to_disk directory")
  if not located:
    where = f"{path} (split {split!r})" if path.is_dir() else str(path)
    raise DataError(f"{where} contains no records")
  for where, record in located:
    for name in required:
      _check_field(record, name, where)
  return [record for _, record in located]


def _read_jsonl(path: pathlib.Path) -> list[tuple[str, dict]]:
  """(location, record) per non-blank line of a JSONL file."""
  out = []
  with open(path, "rb") as f:
    for lineno, raw in enumerate(f, start=1):
      where = f"{path}:{lineno}"
      try:
        line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
      except UnicodeDecodeError as e:
        raise DataError(f"{where}: not valid UTF-8 text: {e}") from e
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise DataError(f"{where}: not a JSON object: {e}") from e
      if not isinstance(record, dict):
        raise DataError(f"{where}: not a JSON object: got a JSON {_json_type(record)}; "
                        "each line must hold one object like {\"prompt\": ...}")
      out.append((where, record))
  return out


def _read_json(path: pathlib.Path) -> list[tuple[str, dict]]:
  """(location, record) per element of a .json file holding a list of objects."""
  try:
    data = json.loads(path.read_text(encoding="utf-8-sig"))
  except UnicodeDecodeError as e:
    raise DataError(f"{path}: not valid UTF-8 text: {e}") from e
  except json.JSONDecodeError as e:
    raise DataError(f"{path}:{e.lineno}: not valid JSON: {e}") from e
  if not isinstance(data, list):
    raise DataError(f"{path}: a .json data file must hold a list of objects, got a JSON "
                    f"{_json_type(data)}; use a list, or JSONL with one object per line")
  out = []
  for i, record in enumerate(data):
    where = f"{path}: record {i}"
    if not isinstance(record, dict):
      raise DataError(f"{where}: not a JSON object: got a JSON {_json_type(record)}")
    out.append((where, record))
  return out


def _json_type(value: Any) -> str:
  """JSON's name for the type of a decoded value."""
  names = {list: "array", str: "string", bool: "boolean", int: "number", float: "number",
           type(None): "null", dict: "object"}
  return names.get(type(value), type(value).__name__)


def _import_datasets(path: pathlib.Path):
  """The ``datasets`` module, or a DataError saying how to install it."""
  try:
    import datasets  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise DataError(f"reading {path} needs the Hugging Face `datasets` package, a dependency "
                    "of ppojax that is missing here: pip install datasets") from e
  return datasets


def _read_saved_dataset(path: pathlib.Path, split: str) -> list[tuple[str, dict]]:
  """(location, record) per row of a Dataset / DatasetDict written by ``save_to_disk``.

  Only the chosen split is loaded. A split saved with zero rows has no arrow files, which
  ``datasets`` itself cannot load; it reads here as no records.
  """
  where = str(path)
  if (path / "dataset_dict.json").is_file():
    try:
      splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
    except (ValueError, KeyError, TypeError) as e:
      raise DataError(f"{path}/dataset_dict.json is corrupt: {e}") from e
    if split not in splits:
      raise DataError(f"{path}: no split {split!r}; the splits are {sorted(splits)} "
                      "(set the data split to one of them)")
    path, where = path / split, f"{path} (split {split!r})"
  if not (path / "state.json").is_file():
    raise DataError(f"{where} is a directory but not one written by datasets' save_to_disk "
                    "(Dataset or DatasetDict: no state.json or dataset_dict.json)")
  try:
    if not json.loads((path / "state.json").read_text()).get("_data_files"):
      return []
  except (ValueError, AttributeError) as e:
    raise DataError(f"{path}/state.json is corrupt: {e}") from e
  datasets = _import_datasets(path)
  try:
    ds = datasets.Dataset.load_from_disk(str(path))
  except Exception as e:  # arrow errors on corrupt shards
    raise DataError(f"{where}: could not load the saved dataset: {e}") from e
  return _dataset_rows(ds, where)


def _read_dataset_file(path: pathlib.Path) -> list[tuple[str, dict]]:
  """(location, record) per row of a .parquet, .csv or .arrow file, read with ``datasets``."""
  datasets, suffix = _import_datasets(path), path.suffix.lower()
  try:
    if suffix == ".arrow":
      return _dataset_rows(datasets.Dataset.from_file(str(path), in_memory=True), str(path))
    load = datasets.Dataset.from_parquet if suffix == ".parquet" else datasets.Dataset.from_csv
    with tempfile.TemporaryDirectory() as cache:  # keep datasets' cache out of ~/.cache
      return _dataset_rows(load(str(path), cache_dir=cache, keep_in_memory=True), str(path))
  except DataError:
    raise
  except Exception as e:  # pyarrow / pandas errors on corrupt or foreign files
    raise DataError(f"{path}: could not read it as a {suffix[1:]} file: {e}") from e


def _dataset_rows(ds, where: str) -> list[tuple[str, dict]]:
  """(location, record) per row of a ``datasets.Dataset``."""
  return [(f"{where}: record {i}", record) for i, record in enumerate(ds.to_list())]


def _check_field(record: Mapping, name: str, where: str) -> None:
  """Raises unless ``record[name]`` is a string or a list of chat messages."""
  if name not in record:
    raise DataError(f"{where}: record has no field {name!r} (fields: "
                    f"{', '.join(map(repr, record)) or 'none'})")
  value = record[name]
  if isinstance(value, str):
    return
  if isinstance(value, list) and value:
    for j, message in enumerate(value):
      if not (isinstance(message, Mapping) and {"role", "content"} <= set(message)
              and isinstance(message["role"], str) and isinstance(message["content"], str)):
        raise DataError(f"{where}: field {name!r} is a list but message {j} is not a "
                        f"{{'role': str, 'content': str}} dict (got {message!r:.80})")
    return
  kind = "an empty list" if isinstance(value, list) else f"type {type(value).__name__}"
  raise DataError(f"{where}: field {name!r} must be a string or a list of chat messages "
                  f"({{'role', 'content'}} dicts), got {kind}")


def write_jsonl(records: Iterable[dict], path: str | os.PathLike) -> None:
  """Writes one JSON object per line, atomically: a temp file in the same directory is renamed
  into place, so readers never see a half-written file. Creates parent directories."""
  with files.atomic_write(path) as f:
    for i, record in enumerate(records):
      if not isinstance(record, Mapping):
        raise DataError(f"writing {path}: record {i} is a {type(record).__name__}, not a dict")
      try:
        f.write(json.dumps(dict(record), ensure_ascii=False) + "\n")
      except (TypeError, ValueError) as e:
        raise DataError(f"writing {path}: record {i} is not JSON-serialisable: {e}") from e
