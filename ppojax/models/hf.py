"""Hugging Face checkpoints ↔ ppojax parameters: state-dict conversion, safetensors directories,
hub ids, export.

A Hugging Face state dict (names and [out, in] layouts of transformers' PyTorch models) is the one
interchange format: safetensors directories and GGUF files are both read into it, and export
writes it back. ``params_from_hf`` / ``params_to_hf`` are exact inverses (each family's tensor
names and shapes: ``hf_names``).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import tempfile
from typing import Any

import numpy as np

from ppojax.infra import files, hostmem
from ppojax.models import hf_names
from ppojax.models.config import ModelConfig

StateDict = dict[str, np.ndarray]
HEADS = ("lm", "value")


class CheckpointError(ValueError):
  """A checkpoint file is missing, unreadable or does not match its config."""


class TensorFiles(dict):
  """A state dict read from files: ``files[name]`` is the file each tensor came from, so
  errors about a tensor can name its file."""

  def __init__(self, tensors=(), files: dict[str, str] | None = None):
    super().__init__(tensors)
    self.files = dict(files or {})


# ---------------------------------------------------------------------------------------------
# State dict ↔ params (each family's names and shapes: hf_names)
# ---------------------------------------------------------------------------------------------


def _strip_prefix(sd: StateDict, cfg: ModelConfig, consume: bool = False
                  ) -> tuple[StateDict, dict[str, str]]:
  """Names relative to the backbone: drop 'model.' / 'transformer.' (kept for heads); and
  where each came from: stripped name → "FULL_NAME in FILE" (or "FULL_NAME"). ``consume``:
  the tensors are moved out of ``sd``, which is left empty."""
  prefix = "transformer." if cfg.is_gpt2 else "model."
  files = getattr(sd, "files", {})
  out, origin = {}, {}
  for name in list(sd):
    value = sd.pop(name) if consume else sd[name]
    if name.endswith((".attn.bias", ".attn.masked_bias")) and cfg.is_gpt2 and value.ndim == 4:
      continue  # GPT-2's stored causal-mask buffers
    short = name[len(prefix):] if name.startswith(prefix) else name
    out[short] = value
    origin[short] = f"{name} in {files[name]}" if name in files else name
  return out, origin


class _Taker:
  """Pops tensors by (stripped) name, checking their shapes; errors name the tensor, the file
  it came from, and the shapes found and implied by the config."""

  def __init__(self, sd: StateDict, cfg: ModelConfig, consume: bool, dtype: np.dtype):
    self.sd, self.origin = _strip_prefix(sd, cfg, consume)
    self.prefix = "transformer." if cfg.is_gpt2 else "model."
    files = sorted(set(getattr(sd, "files", {}).values()))
    self.where = ", ".join(files) if files else "the checkpoint"
    self.num_layers, self.consume, self.dtype = cfg.num_layers, consume, dtype

  def __call__(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name not in self.sd:
      full = name if name.split(".")[0] in ("lm_head", "score") else self.prefix + name
      raise CheckpointError(f"tensor {name!r} is missing from the checkpoint (no {full!r} in "
                            f"{self.where})")
    value = self.sd.pop(name)
    if tuple(value.shape) != tuple(shape):
      raise CheckpointError(
          f"tensor {name!r} ({self.origin[name]}) has shape {tuple(value.shape)}, but the "
          f"config implies {tuple(shape)}")
    return value

  def stack(self, fmt: str, shape: tuple[int, ...], transpose: bool = False) -> np.ndarray:
    """The tensors ``fmt.format(i)`` of every layer i, stacked [L, ...] in ``dtype``."""
    arrays = [self(fmt.format(i), shape) for i in range(self.num_layers)]
    out = np.stack([a.T if transpose else a for a in arrays]).astype(self.dtype, copy=False)
    if self.consume:  # the layers' tensors, freed into the C heap, back to the system: else the
      del arrays  # next stacked weight (a fresh mapping) comes on top of them
      hostmem.release()
    return out


def params_from_hf(cfg: ModelConfig, sd: StateDict, head: str = "lm", dtype=None,
                   consume: bool = False) -> dict:
  """Hugging Face state dict → ppojax params for ``CausalLM`` (head="lm") or ``ValueModel``
  (head="value", reading ``score.weight``). Leftover or missing tensors raise ``CheckpointError``.

  ``consume``: the tensors are moved out of ``sd`` (left empty) and each is freed once it is
  stacked, so that the state dict and the params are never both whole in memory (a loader's
  peak is then the params plus one layer-stacked weight, not twice the model)."""
  if head not in HEADS:
    raise ValueError(f"head must be one of {HEADS}, got {head!r}")
  dtype = np.dtype(dtype or cfg.param_dtype)
  _take = _Taker(sd, cfg, consume, dtype)
  sd, d = _take.sd, cfg.hidden_size
  family = hf_names.gpt2_from_hf if cfg.is_gpt2 else hf_names.llama_from_hf
  params: dict[str, Any] = {"model": family(cfg, _take, _take.stack)}
  if head == "value":
    params["score"] = {"kernel": _take("score.weight", (1, d)).T}
    sd.pop("lm_head.weight", None)  # a policy checkpoint used to initialise a critic
  elif not cfg.tie_word_embeddings:
    params["lm_head"] = {"kernel": _take("lm_head.weight", (cfg.vocab_size, d)).T}
  else:
    sd.pop("lm_head.weight", None)  # some tied checkpoints store the copy anyway
  if sd:
    raise CheckpointError(f"unexpected tensors in the checkpoint ({_take.where}): "
                          f"{sorted(sd)[:8]}")
  return _cast(params, dtype)


def _cast(tree, dtype):
  if isinstance(tree, dict):
    return {k: _cast(v, dtype) for k, v in tree.items()}
  return np.array(tree, dtype=dtype, order="C")  # a writable copy (torch.from_numpy needs one)


def params_to_hf(cfg: ModelConfig, params: dict, head: str = "lm") -> StateDict:
  """ppojax params → Hugging Face state dict (float32 NumPy), the inverse of ``params_from_hf``."""
  if "layers" not in params["model"]:  # scan_layers=False: one subtree per layer
    from ppojax.models.layout import stack_layers  # pylint: disable=import-outside-toplevel
    params = stack_layers(params)
  p = _cast(params, np.float32)
  m = p["model"]
  sd = (hf_names.gpt2_to_hf if cfg.is_gpt2 else hf_names.llama_to_hf)(cfg, m)
  if head == "lm":
    sd["lm_head.weight"] = (m["embed"]["embedding"] if cfg.tie_word_embeddings
                            else p["lm_head"]["kernel"].T)
  if head == "value":
    sd["score.weight"] = p["score"]["kernel"].T
  return {k: np.ascontiguousarray(v) for k, v in sd.items()}


def to_transformers(cfg: ModelConfig, params: dict, head: str = "lm"):
  """The same model as a transformers PyTorch module (eval mode, float32), built in memory.

  For comparisons and hand-offs without a round trip through disk; needs torch
  (``pip install 'ppojax[torch]'``).
  """
  try:
    import torch  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError("to_transformers builds a PyTorch module and needs torch, which is not "
                      "installed: pip install 'ppojax[torch]'") from e
  import transformers  # pylint: disable=import-outside-toplevel

  hf_config = cfg.to_hf()
  auto = transformers.AutoModelForCausalLM
  if head == "value":
    hf_config["num_labels"] = 1
    auto = transformers.AutoModelForSequenceClassification
  try:  # transformers >= 5: no random initialisation of weights that are overwritten below
    from transformers import initialization  # pylint: disable=import-outside-toplevel
    no_init_weights = initialization.no_init_weights
  except (ImportError, AttributeError):
    no_init_weights = contextlib.nullcontext
  with no_init_weights():  # SmolLM2-135M: 0.02 instead of 3.0 s
    model = auto.from_config(transformers.AutoConfig.for_model(**hf_config))
  state = {k: torch.from_numpy(v) for k, v in params_to_hf(cfg, params, head).items()}
  model.load_state_dict(state)  # strict: every parameter of the model is in ``state``
  model.tie_weights()  # tied embeddings one tensor again, as after a random initialisation
  return model.eval()


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------


def read_safetensors(directory: str | os.PathLike) -> TensorFiles:
  """All tensors of ``model.safetensors`` or of the shards listed in its index, as float32.

  Raises ``CheckpointError`` naming the file (and tensor) for: no weights, an unreadable index,
  a missing shard, a truncated or corrupt file, a tensor the index places in a shard that lacks
  it, a tensor stored twice, and NaN or Inf in a tensor (a corrupt or diverged checkpoint).
  """
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel

  directory = pathlib.Path(directory)
  index = directory / "model.safetensors.index.json"
  if index.exists():
    try:
      weight_map = json.loads(index.read_text())["weight_map"]
      expected = {str(name): str(file) for name, file in weight_map.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
      raise CheckpointError(f"{index} is not a valid safetensors index (a JSON object with a "
                            f"'weight_map' of tensor name → shard file): {e!r}") from e
    files = sorted(set(expected.values()))
  elif (directory / "model.safetensors").exists():
    files, expected = ["model.safetensors"], {}
  else:
    raise CheckpointError(
        f"{directory} has neither model.safetensors nor model.safetensors.index.json "
        "(PyTorch .bin checkpoints are not supported: convert them with safetensors first)")
  sd = TensorFiles()
  for name in files:
    path = directory / name
    if not path.exists():
      raise CheckpointError(f"shard {path} listed in the index is missing")
    key = None
    try:
      with safe_open(str(path), framework="numpy") as f:  # bfloat16 too (ml_dtypes)
        for key in f.keys():
          if key in sd:
            raise CheckpointError(f"tensor {key!r} is stored twice: in {sd.files[key]} and "
                                  f"in {path}")
          sd[key] = np.asarray(f.get_tensor(key)).astype(np.float32)
          sd.files[key] = str(path)
    except CheckpointError:
      raise
    except Exception as e:  # safetensors raises several types for corrupt files
      what = f"tensor {key!r} of " if key is not None else ""
      raise CheckpointError(f"cannot read {what}{path} (truncated or corrupt?): {e}") from e
  for key, name in expected.items():
    if sd.files.get(key) != str(directory / name):
      raise CheckpointError(f"{index} places tensor {key!r} in {name}, but "
                            + (f"it is in {sd.files[key]}" if key in sd.files
                               else f"{directory / name} does not hold it"))
  for key, value in sd.items():
    if not np.isfinite(value).all():
      raise CheckpointError(f"tensor {key!r} in {sd.files[key]} holds NaN or Inf values "
                            f"({int(np.size(value) - np.isfinite(value).sum())} of "
                            f"{np.size(value)}): the file is corrupt or the model diverged")
  return sd


def resolve(name_or_path: str) -> pathlib.Path:
  """A local directory, or a hub id downloaded (once) with huggingface_hub."""
  path = pathlib.Path(name_or_path).expanduser()
  if path.is_dir():
    return path
  if path.exists() or name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1:
    where = ("" if path.exists() else " (nothing is there)" if path.is_absolute()
             else f" (nothing is there; a relative path is read from {os.getcwd()})")
    raise CheckpointError(f"{name_or_path} is not a model directory{where}")
  try:
    from huggingface_hub import snapshot_download  # pylint: disable=import-outside-toplevel
    return pathlib.Path(snapshot_download(
        name_or_path, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]))
  except Exception as e:
    why = " ".join(str(e).split())  # huggingface_hub's messages run over several lines
    raise CheckpointError(
        f"{name_or_path!r} is not a local directory and could not be downloaded from the "
        f"Hugging Face Hub ({type(e).__name__}: {why}). Offline? Download it on a connected "
        "machine (hf download NAME --local-dir DIR) and pass DIR.") from e


def read_config(directory: str | os.PathLike) -> dict[str, Any]:
  """The ``config.json`` dict of a model directory."""
  path = pathlib.Path(directory) / "config.json"
  if not path.exists():
    raise CheckpointError(f"{path} is missing")
  try:
    return json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{path} is not valid JSON: {e}") from e


def load_config(directory: str | os.PathLike, **overrides) -> ModelConfig:
  hf = read_config(directory)
  try:
    return ModelConfig.from_hf(hf, **overrides)
  except (ValueError, KeyError) as e:  # unsupported architecture or option, missing field
    raise CheckpointError(f"{pathlib.Path(directory) / 'config.json'}: {e}") from e


def save_pretrained(directory: str | os.PathLike, cfg: ModelConfig, params: dict,
                    tokenizer=None, head: str = "lm") -> pathlib.Path:
  """Write a Hugging Face directory (config.json, model.safetensors, tokenizer files). A model
  with tied embeddings stores them once, without ``lm_head.weight``, as transformers does.

  Written to a temporary sibling and renamed into place, so an interrupted export never leaves
  a half-written model where a complete one is expected.
  """
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel

  directory = pathlib.Path(directory)
  directory.parent.mkdir(parents=True, exist_ok=True)
  tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
  try:
    hf = cfg.to_hf()
    if head == "value":
      hf.update(architectures=[cfg.family.value_architecture], num_labels=1,
                id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    (tmp / "config.json").write_text(json.dumps(hf, indent=2))
    tensors = params_to_hf(cfg, params, head)
    if cfg.tie_word_embeddings:  # as transformers saves a tied model: it ties it again on load
      tensors.pop("lm_head.weight", None)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
      tokenizer.save_pretrained(str(tmp))
    files.ordinary_permissions(tmp)  # mkdtemp and safetensors make them owner-only
    if directory.exists():
      shutil.rmtree(directory)
    os.replace(tmp, directory)
  except Exception as e:  # safetensors' errors are no OSError
    if files.is_disk_full(e):
      raise files.disk_full("the exported model", directory, "free disk space and run the same "
                            "command again (a run resumes from its last checkpoint)") from e
    raise
  finally:
    if tmp.exists():
      shutil.rmtree(tmp, ignore_errors=True)
  return directory
