"""LoRA (Hu et al. 2021): a frozen base model plus trainable low-rank adapters.

Each adapted linear layer computes y = x·W + (α/r)·(x·A)·B with the base kernel W [in, out]
frozen, A [in, r] and B [r, out] trainable (``layers.Linear``, switched on by
``ModelConfig.lora_rank``/``lora_targets``). B starts at 0, so the adapted model starts exactly
as the base. The adapters are plain leaves named ``lora_a``/``lora_b`` beside their kernel in
the usual parameter tree, so one tree serves the model, and two pure functions move between
views of it:

* ``split(params) -> (base, adapters)`` and ``combine(base, adapters)``: the frozen part and the
  trained part (what gets gradients, optimizer state and checkpoints);
* ``merge(params, cfg) -> base-shaped params`` with W' = W + (α/r)·A·B: one model to sample
  from, evaluate or export, computing exactly what the adapted model computes.

The reference policy is the base itself: the base parameters applied by a module without
adapters (``base_config``), so no second copy of the weights exists.

LoRA dropout (``lora_dropout`` p, peft's): the adapters' input is dropped out in the policy
update's forward and backward passes only, y = x·W + (α/r)·(dropout_p(x)·A)·B
(``kernels.lora_dropout_matmul``). Sampling, the old and reference log-probs and evaluation
are deterministic: PPO's ratio divides by the log-probs of the policy that sampled, which had
no dropout (peft + trl likewise switch dropout on with ``model.train()`` for the update only).

``peft_state_dict``/``save_peft`` write the adapters in peft's layout
(``adapter_model.safetensors`` with ``base_model.model.<HF name>.lora_A.weight`` [r, in] and
``lora_B.weight`` [out, r], plus ``adapter_config.json``), which ``peft.PeftModel.from_pretrained``
loads onto the Hugging Face base model.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ppojax.models.config import ModelConfig
from ppojax.models.layers import lora_a_init

Params = Any
ADAPTER_LEAVES = ("lora_a", "lora_b")
# our Linear names ↔ peft's target_modules (every Llama-like family); GPT-2's fc/proj: none
TARGETS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj",
           "up": "up_proj", "down": "down_proj", "fc": None, "proj": None}
ALL_LINEAR = ("q", "k", "v", "o", "gate", "up", "down")


def targets(names) -> tuple[str, ...]:
  """Config spelling → our Linear names: "q" or peft's "q_proj" (and "all-linear")."""
  if isinstance(names, str):
    names = [n.strip() for n in names.split(",") if n.strip()]
  out = []
  for name in names:
    if name == "all-linear":
      out.extend(ALL_LINEAR)
      continue
    ours = name.removesuffix("_proj") if name.removesuffix("_proj") in TARGETS else name
    if ours not in TARGETS:
      raise ValueError(f"LoRA target {name!r} is not a linear layer of ppojax's transformer: "
                       f"choose from {', '.join(TARGETS)} (or peft's q_proj, ..., down_proj, "
                       "or all-linear)")
    out.append(ours)
  if not out:
    raise ValueError("LoRA needs at least one target layer (lora.targets), e.g. q,k,v,o")
  return tuple(dict.fromkeys(out))


def adapted_config(cfg: ModelConfig, rank: int, alpha: float, names, dropout: float = 0.0
                   ) -> ModelConfig:
  """``cfg`` with adapters of rank r and scale α/r on the ``names`` layers, and dropout p on
  their input in the passes that ask for it (``layers.Linear``)."""
  if rank < 1:
    raise ValueError(f"LoRA rank must be >= 1, got {rank}")
  return cfg.replace(lora_rank=int(rank), lora_alpha=float(alpha), lora_targets=targets(names),
                     lora_dropout=float(dropout))


def base_config(cfg: ModelConfig) -> ModelConfig:
  """``cfg`` without adapters: the module that applies the base parameters (the reference)."""
  return cfg.replace(lora_rank=0, lora_targets=(), lora_dropout=0.0)


def _is_adapter(path) -> bool:
  return getattr(path[-1], "key", None) in ADAPTER_LEAVES


def _filter(tree: dict, keep) -> dict:
  """The nested dict with the leaves ``keep(path)`` accepts; empty subtrees dropped."""
  def walk(node, path):
    if not isinstance(node, dict):
      return node if keep(path) else None
    out = {}
    for k, v in node.items():
      sub = walk(v, path + (jax.tree_util.DictKey(k),))
      if sub is not None and not (isinstance(sub, dict) and not sub):
        out[k] = sub
    return out
  return walk(tree, ())


def split(params: Params) -> tuple[Params, Params]:
  """(base, adapters): the same tree with only the non-LoRA leaves, and with only LoRA's."""
  return _filter(params, lambda p: not _is_adapter(p)), _filter(params, _is_adapter)


def combine(base: Params, adapters: Params) -> Params:
  """The inverse of ``split``: one tree with the base's and the adapters' leaves."""
  if not isinstance(adapters, dict):
    return adapters
  out = dict(base)
  for k, v in adapters.items():
    out[k] = combine(base.get(k, {}), v) if isinstance(v, dict) else v
  return out


def init_adapters(base: Params, cfg: ModelConfig, key: jax.Array) -> Params:
  """Adapters for the base params: A ~ U(±1/√in) [.., in, r], B = 0 [.., r, out] for every
  targeted Linear (stacked layers keep their leading layer axis). With B = 0 the adapted model
  computes exactly what the base does."""
  if cfg.transposed_kernels or cfg.fused_projections:
    raise ValueError("init_adapters takes parameters in the checkpoint layout ([in, out] "
                     "kernels, separate q/k/v and gate/up)")
  leaves = []

  def visit(path, leaf):
    names = [getattr(k, "key", None) for k in path]
    if names[-1] == "kernel" and len(names) >= 2 and names[-2] in cfg.lora_targets:
      leaves.append((path, leaf.shape))

  jax.tree_util.tree_map_with_path(visit, base)
  if not leaves:
    raise ValueError(f"no kernel of the model matches the LoRA targets {cfg.lora_targets}")
  adapters: dict = {}
  for i, (path, shape) in enumerate(leaves):
    *lead, d_in, d_out = shape
    node = adapters
    for k in path[:-1]:
      node = node.setdefault(k.key, {})
    node["lora_a"] = lora_a_init(jax.random.fold_in(key, i), (*lead, d_in, cfg.lora_rank))
    node["lora_b"] = jnp.zeros((*lead, cfg.lora_rank, d_out), jnp.float32)
  return adapters


def merge(params: Params, cfg: ModelConfig) -> Params:
  """Base-shaped params computing what the adapted model computes: every adapted kernel
  W' = W + (α/r)·A·B (in W's dtype; stacked layers alike), the adapters removed."""
  scale = cfg.lora_alpha / cfg.lora_rank if cfg.lora_rank else 0.0

  def walk(node):
    if not isinstance(node, dict):
      return node
    if "lora_a" in node:
      w = node["kernel"]
      delta = jnp.einsum("...ir,...ro->...io", node["lora_a"], node["lora_b"],
                         preferred_element_type=jnp.float32)
      if cfg.transposed_kernels:
        delta = jnp.swapaxes(delta, -1, -2)
      merged = {k: v for k, v in node.items() if k not in ADAPTER_LEAVES}
      merged["kernel"] = (w.astype(jnp.float32) + scale * delta).astype(w.dtype)
      return merged
    return {k: walk(v) for k, v in node.items()}

  return walk(params)


# fold_in(update key, DROPOUT_STREAM): dropout's keys, apart from the minibatch shuffles'
# (split(key, E) = fold_in(key, 0 … E − 1))
DROPOUT_STREAM = 0x64726F70  # "drop"


def dropout_keys(key: jax.Array, n: int) -> jax.Array:
  """n keys for LoRA dropout (one per optimizer step) from the update's key."""
  return jax.random.split(jax.random.fold_in(key, DROPOUT_STREAM), n)


def dropout_rngs(module, key: jax.Array | None, stream: int) -> dict | None:
  """``module.apply``'s rngs for LoRA dropout: {"dropout": a key of its own} (``stream``: 0
  the policy, 1 a LoRA critic) where there is a ``key`` and the module drops out; else None,
  and the module is deterministic."""
  if key is None or not module.cfg.lora_dropout:
    return None
  return {"dropout": jax.random.fold_in(key, stream)}


def count(adapters: Params) -> int:
  """Number of adapter parameters."""
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(adapters))


# ---------------------------------------------------------------------------------------------
# peft's layout
# ---------------------------------------------------------------------------------------------


def peft_state_dict(adapters: Params, cfg: ModelConfig) -> dict[str, np.ndarray]:
  """The adapters as peft names them on a transformers Llama-like model (Qwen, Gemma, OLMo,
  SmolLM and Mistral name their projections alike):
  ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` = Aᵀ [r, in] and
  ``...lora_B.weight`` = Bᵀ [out, r] (PyTorch's [out, in] layout)."""
  if cfg.is_gpt2:
    raise ValueError("peft export is implemented for the Llama-like families (every supported "
                     "family but GPT-2); for GPT-2 export the merged model instead (lora.merge)")
  model = adapters["model"]
  if "layers" not in model:  # unrolled layers: stack them as the stored layout does
    from ppojax.models.layout import stack_layers  # pylint: disable=import-outside-toplevel
    model = stack_layers({"model": model})["model"]
  sd = {}
  for group, sub in model["layers"].items():
    for name, leaves in sub.items():
      a, b = np.asarray(leaves["lora_a"], np.float32), np.asarray(leaves["lora_b"], np.float32)
      hf_group = "self_attn" if group == "attn" else "mlp"
      for i in range(cfg.num_layers):
        stem = f"base_model.model.model.layers.{i}.{hf_group}.{TARGETS[name]}"
        sd[stem + ".lora_A.weight"] = np.ascontiguousarray(a[i].T)
        sd[stem + ".lora_B.weight"] = np.ascontiguousarray(b[i].T)
  return sd


def peft_config(cfg: ModelConfig, base_model: str = "", dropout: float = 0.0) -> dict:
  """``adapter_config.json`` for ``peft.PeftModel.from_pretrained``."""
  return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.lora_rank,
          "lora_alpha": cfg.lora_alpha, "lora_dropout": dropout,
          "target_modules": sorted(TARGETS[t] for t in cfg.lora_targets), "bias": "none",
          "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
          "modules_to_save": None, "inference_mode": True, "init_lora_weights": True,
          "base_model_name_or_path": base_model}


def save_peft(directory: str | os.PathLike, adapters: Params, cfg: ModelConfig,
              base_model: str = "", dropout: float = 0.0) -> pathlib.Path:
  """Writes ``adapter_model.safetensors`` and ``adapter_config.json`` (peft's layout)."""
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel

  from ppojax.infra import files  # pylint: disable=import-outside-toplevel
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  sd = peft_state_dict(jax.device_get(adapters), cfg)
  with files.atomic_write(directory / "adapter_config.json") as f:
    f.write(json.dumps(peft_config(cfg, base_model, dropout), indent=2))
  tmp = directory / ".adapter_model.safetensors.tmp"
  save_file(sd, str(tmp), metadata={"format": "pt"})
  os.replace(tmp, directory / "adapter_model.safetensors")
  return directory
