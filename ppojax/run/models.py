"""The models of a run by config name: the policy, the reward model and a critic from the policy,
loaded or initialised ("tiny"), and their tokenizers; ``build`` assembles them
(ppojax/run/build.py).
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import ml_collections

from ppojax.data import encoding
from ppojax.models import (
  CausalLM,
  LoadedModel,
  ModelConfig,
  ValueModel,
  abstract_model,
  gguf_path,
  hf,
  init_params,
  load_model,
  model_config,
  public,
)
from ppojax.tasks import count


def tiny_model_config(c: ml_collections.ConfigDict) -> ModelConfig:
  """A small random-init Llama-style model (``model.policy = "tiny"``)."""
  return ModelConfig(
      model_type="llama", vocab_size=c.vocab_size, hidden_size=c.hidden_size,
      intermediate_size=c.intermediate_size, num_layers=c.num_layers, num_heads=c.num_heads,
      num_kv_heads=c.num_kv_heads, head_dim=c.hidden_size // c.num_heads,
      max_position_embeddings=c.max_position_embeddings, norm_eps=1e-5, tie_word_embeddings=True,
      bos_token_id=count.BOS, eos_token_id=count.STOP, pad_token_id=count.STOP)


def _numerics(config) -> dict:
  return dict(dtype=config.model.dtype, remat=config.model.remat,
              remat_policy=config.model.remat_policy, scan_layers=config.model.scan_layers,
              attention=config.model.get("attention", "auto"),
              decode_attention=config.model.get("decode_attention", "auto"))


def load_tokenizer(name: str):
  """The tokenizer of a Hugging Face directory or hub id, a GGUF file, "smollm2" or "gemma3"."""
  name = str(name)
  if (path := gguf_path(name)) is not None:
    from ppojax.models import gguf  # pylint: disable=import-outside-toplevel
    return gguf.read_tokenizer(path)
  from transformers import AutoTokenizer  # pylint: disable=import-outside-toplevel
  return AutoTokenizer.from_pretrained(str(hf.resolve(name)))


def load_named(name: str, key, *, tiny=None, tokenizer: str = "", head: str = "lm",
               abstract: bool = False, with_tokenizer: bool = True, option: str = "",
               **numerics) -> LoadedModel:
  """A model by config name: "tiny" (random init from the ``tiny`` section; with a
  ``tokenizer`` its vocabulary and special ids come from it, else from the token tasks of
  ppojax/tasks/count.py) or anything ``load_model`` accepts. ``tokenizer``, when set, replaces the
  checkpoint's. A value head is zero-initialised (V = 0, or r = 0 for a reward model).
  ``abstract``: the same model with ``jax.ShapeDtypeStruct`` params (``models.abstract_model``);
  no weights are read and no tokenizer is loaded; ``with_tokenizer=False``: none is read from
  a Hugging Face directory either (``load_model``). ``option`` (``"model.policy"``) prefixes a
  ``CheckpointError``'s message."""
  tok = load_tokenizer(tokenizer) if tokenizer and not abstract else None
  if name != "tiny":
    if abstract:
      return abstract_model(model_config(name, **numerics), head)
    try:
      model = load_model(name, head=head, with_tokenizer=with_tokenizer, **numerics)
    except hf.CheckpointError as e:
      if not option:
        raise
      raise hf.CheckpointError(f"{option}: {e}") from e
    return model._replace(tokenizer=tok) if tok is not None else model
  if tok is None:
    cfg = tiny_model_config(tiny)
  else:
    cfg = tiny_model_config(ml_collections.ConfigDict(dict(tiny.to_dict(),
                                                           vocab_size=len(tok)))).replace(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=encoding.pad_token_id(tok))
  cfg = cfg.replace(**numerics)
  if abstract:
    return abstract_model(cfg, head)
  module = ValueModel(cfg) if head == "value" else CausalLM(cfg)
  params = init_params(module, key)
  if head == "value":
    params = dict(params, score=jax.tree.map(jnp.zeros_like, params["score"]))
  return LoadedModel(cfg, params, tok, head)


def load_policy(config, key, abstract: bool = False) -> LoadedModel:
  m = config.model
  return load_named(m.policy, key, tiny=m.tiny, tokenizer=m.tokenizer, abstract=abstract,
                    option="model.policy", **_numerics(config))


def load_reward_model(config, policy: LoadedModel, key, abstract: bool = False) -> LoadedModel:
  """``model.reward`` with a value head. It reads the policy's tokens (no tokenizer of its own
  is loaded), so its vocabulary must cover the policy's."""
  reward_model = load_named(config.model.reward, key, tiny=config.model.tiny, head="value",
                            abstract=abstract, with_tokenizer=False, option="model.reward",
                            **_numerics(config))
  if reward_model.cfg.vocab_size < policy.cfg.vocab_size:  # its embedding would read past
    raise ValueError(  # its end (NaN scores): it cannot share the policy's tokenizer
        f"model.reward={config.model.reward!r} has a vocabulary of "
        f"{reward_model.cfg.vocab_size} tokens, the policy {config.model.policy!r} "
        f"{policy.cfg.vocab_size}: the reward model reads the policy's tokens, so it must be "
        "trained with the same tokenizer (e.g. ppojax.supervised.train_rm from the policy)")
  return reward_model


def critic_from_policy(policy: LoadedModel) -> LoadedModel:
  """A ValueModel with the policy's backbone and a zero head (V = 0 at the start)."""
  if _is_abstract(policy.params):
    return abstract_model(policy.cfg, "value")
  head = {"kernel": jnp.zeros((policy.cfg.hidden_size, 1), jnp.float32)}
  backbone = jax.tree.map(jnp.copy, policy.params["model"])  # own buffers: the state is donated
  return LoadedModel(policy.cfg, {"model": backbone, "score": head},
                     policy.tokenizer, "value")


def context_length(config) -> int | None:
  """The policy's context length from its config alone (None where that needs a download)."""
  name = str(config.model.policy)
  if name == "tiny":
    return config.model.tiny.max_position_embeddings
  if (path := gguf_path(name)) is not None:
    from ppojax.models import gguf  # pylint: disable=import-outside-toplevel
    return gguf.context_length(path)
  path = pathlib.Path(name).expanduser()
  hf_config = hf.read_config(path) if (path / "config.json").is_file() else public.lookup(name)
  if hf_config is not None:
    return hf_config.get("max_position_embeddings") or hf_config.get("n_positions")
  return None


def _is_abstract(params) -> bool:
  return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params))
