"""The checks of a run's config, before any model loads or anything compiles: option names (the
nearest valid ones suggested) and types against ``config.defaults()``, choices, ranges, sizes that
must fit together (batch vs minibatches × micro-batches × data-parallel devices, the mesh vs the
devices, prompt + response vs the context), the algorithm's resolved choices, the packages an
option needs, the task's options, the chat template's variables (``data.chat_template_kwargs``).
``validate`` raises ``ConfigError`` with one clear message.
"""

from __future__ import annotations

import difflib
import importlib.util

import ml_collections
import numpy as np

from ppojax.core import advantages, algorithms, correction, kl, ops, options, selection, surrogates
from ppojax.models import config as model_config
from ppojax.models import packing
from ppojax.run import checks_data
from ppojax.run.checks_recipe import ConfigError, check_algorithm, check_recipe  # as before

# sections whose keys are the user's names
FREE_FORM = ("eval.metrics", "eval.baselines", "data.rg.options", "data.chat_template_kwargs")
CHOICES = {
    "algorithm": tuple(algorithms.ALGORITHMS),
    "rl.estimator": ("", *advantages.ESTIMATORS),
    "rl.kl_in": ("", *algorithms.KL_PLACEMENTS),
    "reward.kind": ("jax", "python", "text", "model", "env"),
    "model.critic_init": ("auto", "reward", "policy"),
    "data.task": ("count", "arith", "calc", "file", "reasoning_gym", "guess_number"),
    "data.truncate": ("left", "error"),
    "rl.aggregation": ("", *ops.AGGREGATIONS),
    "rl.old_logprobs": ("recompute", "sampler"),
    "rl.kl_estimator": ("", *kl.KL_ESTIMATORS),
    "rl.loss_mode": ("", *surrogates.SURROGATES),
    "rl.tis_level": correction.IS_LEVELS,
    "rl.reject": ("", *correction.REJECT_LEVELS),
    "model.dtype": ("float32", "bfloat16", "float16"),
    "model.remat_policy": ("nothing", "dots", "dots_no_batch"),
    "model.attention": model_config.ATTENTION_CHOICES,
    "model.decode_attention": model_config.DECODE_CHOICES,
    "model.frozen_dtype": ("", "float32", "bfloat16", "float16"),
    "sampling.dtype": ("", "float32", "bfloat16", "float16"),
    "sampling.decode_layers": ("auto", "scan", "unroll"),
    "lora.base_dtype": ("", "float32", "bfloat16", "float16"),
    "optim.state_dtype": ("float32", "bfloat16"),
    "optim.actor.decay": ("constant", "linear", "cosine"),
    "optim.critic.decay": ("constant", "linear", "cosine"),
}


# options that have another name now: refused with the new one
RENAMED = {"ppo": "rl", "num_samples": "sample_table_rows",  # rl: every algorithm's section
           "rl.pack_fraction": "rl.pack_fractions"}  # f is now (f,)




def check_names_and_types(config: ml_collections.ConfigDict,
                          reference: ml_collections.ConfigDict | None = None,
                          prefix: str = "") -> None:
  """Every option exists in ``defaults()`` (else the nearest names are suggested) and has the
  default's type (an int where a float is expected is fine; None defaults take anything)."""
  if reference is None:
    # here, not at the top: ppojax.run.config imports this module
    from ppojax.run.config import defaults  # pylint: disable=import-outside-toplevel
    reference = defaults()
  for key in config.keys():
    name = prefix + key
    if key not in reference and name in RENAMED:
      new = RENAMED[name]
      example = f"{new}.batch_size" if isinstance(reference.get(new), dict) else new
      raise ConfigError(f"config option {name} is now {new}: write --config.{example}=...")
    if key not in reference:
      near = difflib.get_close_matches(key, list(reference.keys()), n=3, cutoff=0.6)
      hint = f"; did you mean {' or '.join(prefix + n for n in near)}?" if near else (
          f"; the options of {prefix[:-1] or 'the config'} are: {', '.join(reference.keys())}")
      raise ConfigError(f"unknown config option {name}{hint}")
    value, default = config[key], reference[key]
    if isinstance(default, ml_collections.ConfigDict):
      if not isinstance(value, ml_collections.ConfigDict):
        raise ConfigError(f"config option {name} must be a section (ConfigDict), got "
                          f"{type(value).__name__}")
      if name not in FREE_FORM:
        check_names_and_types(value, default, name + ".")
    elif default is not None and value is not None and not _same_kind(value, default):
      raise ConfigError(f"config option {name}={value!r} has type {type(value).__name__}; "
                        f"expected {type(default).__name__} (like the default {default!r})")


def _same_kind(value, default) -> bool:
  if isinstance(default, bool) or isinstance(value, bool):
    return isinstance(value, bool) and isinstance(default, bool)
  if isinstance(default, float):
    return isinstance(value, (int, float))
  if isinstance(default, (list, tuple)):
    return isinstance(value, (list, tuple))
  return isinstance(value, type(default))


_MISSING = object()


def _option(config, name: str):
  """The value of the dotted option ``name`` (``_MISSING`` where a config leaves it out)."""
  node = config
  for part in name.split("."):
    if part not in node:
      return _MISSING
    node = node[part]
  return node


def check_choices(config: ml_collections.ConfigDict, choices=None) -> None:
  """Options with a fixed set of values (``CHOICES``) hold one of them."""
  for name, allowed in (CHOICES if choices is None else choices).items():
    if (value := _option(config, name)) is not _MISSING and value not in allowed:
      raise ConfigError(f"{name}={value!r} is not one of {', '.join(map(repr, allowed))}")


def check_sizes(config: ml_collections.ConfigDict, num_devices: int,
                context_length: int | None = None) -> None:
  """Sizes that must fit: minibatches and micro-batches in the batch, the batch over the
  data-parallel devices, the mesh over the devices, prompt + response in the model's context."""
  rl = config.rl
  for name in ("batch_size", "num_minibatches", "grad_accum", "num_epochs"):
    if rl[name] < 1:
      raise ConfigError(f"rl.{name}={rl[name]} must be >= 1")
  n = config.sampling.get("num_samples_per_prompt", 1)
  if n < 1:
    raise ConfigError(f"sampling.num_samples_per_prompt={n} must be >= 1")
  rows = rollout_rows(config)
  batch = (f"rl.batch_size={rl.batch_size}" if n == 1 else
           f"rl.batch_size × sampling.num_samples_per_prompt = {rl.batch_size} × {n} = {rows}")
  per_step = rl.num_minibatches * rl.grad_accum
  if rows % per_step:
    raise ConfigError(
        f"{batch} is not divisible by rl.num_minibatches × "
        f"rl.grad_accum = {rl.num_minibatches} × {rl.grad_accum}; change one of them")
  k = rl.get("forward_micro_batches", 0)
  if k < 0 or (k and rows % k):
    raise ConfigError(f"rl.forward_micro_batches={k} must be 0 (automatic) or a divisor of "
                      f"{batch}")
  if rl.get("tis_cap") is not None and rl.tis_cap <= 0:
    raise ConfigError(f"rl.tis_cap={rl.tis_cap} must be > 0 (about 2 is usual), or None")
  shape = list(config.mesh.shape)
  if len(shape) != 3 or shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
    raise ConfigError(f"mesh.shape={tuple(shape)}: give three sizes (data, fsdp, tensor), "
                      "positive or one -1 for the remaining devices")
  known = int(np.prod([s for s in shape if s != -1]))
  if (-1 in shape and num_devices % known) or (-1 not in shape and known != num_devices):
    raise ConfigError(f"mesh.shape={tuple(shape)} does not fit the {num_devices} devices "
                      f"present; e.g. --config.mesh.shape='(-1, 1, 1)'")
  if -1 in shape:
    shape[shape.index(-1)] = num_devices // known
  data_parallel = shape[0] * shape[1]
  if rows % (rl.num_minibatches * data_parallel):
    raise ConfigError(
        f"{batch} is not divisible by rl.num_minibatches × "
        f"data-parallel devices = {rl.num_minibatches} × {data_parallel} (mesh data × fsdp = "
        f"{shape[0]} × {shape[1]}): every minibatch must split evenly over the devices")
  sampled = selection.sampled_prompts(rl.batch_size, rl.get("oversample", 1.0)) * n
  if sampled % data_parallel:
    raise ConfigError(f"rl.oversample={rl.oversample}: the {sampled} responses sampled do not "
                      f"split over the {data_parallel} data-parallel devices")
  if k and rows % (k * data_parallel):
    raise ConfigError(
        f"rl.forward_micro_batches={k}: {rows // k} rows per part do not split over "
        f"the {data_parallel} data-parallel devices; choose a k with {rows} rows divisible by "
        f"k × {data_parallel}")
  if config.sampling.max_new_tokens < 1:
    raise ConfigError(f"sampling.max_new_tokens={config.sampling.max_new_tokens} must be >= 1")
  length = prompt_length(config) + config.sampling.max_new_tokens
  if context_length is not None and length > context_length:
    raise ConfigError(
        f"prompt + response = {prompt_length(config)} + {config.sampling.max_new_tokens} = "
        f"{length} tokens exceeds the model's context of {context_length}; lower "
        "data.max_prompt_len or sampling.max_new_tokens")


# (option, test, what it must be and what to do); None passes where the option allows it
OPTIONAL = ("clip_eps_low", "clip_eps_high", "dual_clip", "value_clip")  # None: off / clip_eps
RANGES = (
    # the loss options: their ranges and messages are the losses' (options.OPTION_RANGES)
    *((f"rl.{name}", (lambda v, ok=ok: v is None or ok(v)) if name in OPTIONAL else ok, why)
      for name, (ok, why) in options.OPTION_RANGES.items()
      if not name.startswith("clip_eps_low")),  # the loss mode's range: check_algorithm
    ("rl.gamma", lambda v: 0 <= v <= 1, "must be in [0, 1] (the discount; 1 is usual for LMs)"),
    ("rl.lam", lambda v: 0 <= v <= 1, "must be in [0, 1] (GAE's λ; 0.95 is usual)"),
    ("rl.score_clip", lambda v: v is None or v > 0,
     "must be > 0 (scores are clipped to [−c, c]), or None"),
    ("rl.missing_stop_penalty", lambda v: v >= 0,
     "must be >= 0: it is subtracted from the score of a response without a stop token (a "
     "negative one would reward running into the length limit)"),
    ("eval.every", lambda v: isinstance(v, int) and v >= 0,
     "must be an integer >= 0: evaluate on the held-out prompts after every N-th iteration "
     "(0: only before the first and after the last)"),
    ("lora.rank", lambda v: isinstance(v, int) and v >= 0,
     "must be an integer >= 0: the rank of the LoRA adapters (0: full fine-tuning; 8-64 is "
     "usual)"),
    ("lora.alpha", lambda v: v > 0, "must be > 0 (the adapters are scaled by alpha / rank)"),
    ("lora.dropout", lambda v: 0 <= v < 1,
     "must be in [0, 1): the probability of dropping each entry of the adapters' input in the "
     "update (0: none, peft's default; 0.05-0.1 is usual)"),
    ("optim.max_grad_norm", lambda v: v > 0, "must be > 0 (gradients are clipped to this "
     "global norm; 1.0 is usual)"),
    ("rl.overlong_buffer", lambda v: is_int(v, 0),
     "must be an integer >= 0: the tokens before sampling.max_new_tokens over which the score "
     "is penalised (DAPO's soft overlong punishment; 0: off)"),
    ("rl.overlong_factor", lambda v: v >= 0, "must be >= 0 (the penalty at the length limit)"),
    ("rl.oversample", lambda v: v >= 1, "must be >= 1: the prompts sampled per iteration, "
     "as a multiple of rl.batch_size (dynamic sampling learns from rl.batch_size of them)"),
    ("rl.pack_fractions", packing.valid_fractions, "must be ascending numbers in (0, 1], packed "
     "rows per padded row to try, fewest first: e.g. (0.5,) or (0.25, 0.5, 0.75); (): off"),
    ("rl.reject_low", lambda v: 0 < v <= 1,
     "must be in (0, 1]: tokens whose ratio π_old/π_sampler is below it leave the loss"),
    ("rl.reject_high", lambda v: v >= 1,
     "must be >= 1: tokens whose ratio π_old/π_sampler is above it leave the loss"),
    ("save_every", lambda v: is_int(v, 1), "must be an integer >= 1 (iterations per checkpoint)"),
    ("keep", lambda v: is_int(v, 1), "must be an integer >= 1 (checkpoints kept)"),
    ("sampling.stop_check_every", lambda v: is_int(v, 0),
     "must be an integer >= 0: decode steps between checks of the stop condition (0: 8 on a "
     "GPU, 1 elsewhere; the samples are the same whatever it is)"),
    ("data.prompt_bucket", lambda v: is_int(v, 0),
     "must be an integer >= 0: a batch's prompts are padded to the next multiple of it (tokens; "
     "0: always to data.max_prompt_len)"),
)


def check_ranges(config: ml_collections.ConfigDict, ranges=RANGES) -> None:
  """Numbers in their ranges (``RANGES``): the loss options, discounts, KL coefficients."""
  for name, ok, requirement in ranges:
    if (value := _option(config, name)) is _MISSING:
      continue
    try:
      good = ok(value)  # NaN fails every test too
    except TypeError:  # None where a number is needed
      good = False
    if not good:
      raise ConfigError(f"{name}={value!r} {requirement}")


def check_data_options(config: ml_collections.ConfigDict) -> None:
  """The data section's free-form options (``checks_data``: chat template variables, prompt
  format)."""
  for name, check in checks_data.OPTIONS.items():
    if (value := _option(config, name)) is not _MISSING:
      try:
        check(value)
      except ValueError as e:
        raise ConfigError(str(e)) from None


def check_kl_controller(config: ml_collections.ConfigDict) -> None:
  """``rl.target_kl`` and ``rl.kl_horizon`` > 0 with ``rl.adaptive_kl``."""
  rl = config.rl
  if rl.adaptive_kl:
    for name in ("target_kl", "kl_horizon"):
      if not rl[name] > 0:
        raise ConfigError(f"rl.{name}={rl[name]!r} must be > 0 with rl.adaptive_kl (the "
                          "controller's target KL per sequence and its horizon in samples)")


def check_packages(config: ml_collections.ConfigDict) -> None:
  """Options that need a package outside ppojax's core dependencies: the package is installed."""
  if config.get("wandb_project") and importlib.util.find_spec("wandb") is None:
    raise ConfigError(f"wandb_project={config.wandb_project!r} needs the wandb package, which is "
                      "not installed: pip install 'ppojax[wandb]' (or pip install wandb), or "
                      "leave wandb_project empty")
  if (config.get("data", {}).get("task") == "reasoning_gym"  # supervised configs have none
      and importlib.util.find_spec("reasoning_gym") is None):
    raise ConfigError('data.task="reasoning_gym" needs the reasoning-gym package, which is not '
                      'installed: pip install -e ".[reasoning]" (in the ppojax checkout)')


def check_tasks(config: ml_collections.ConfigDict) -> None:
  """The task's own options (``reasoning.check_config``: data.rg makes a dataset) and the
  baselines' (``baselines.check_config``), before any model loads."""
  from ppojax.run import baselines
  from ppojax.tasks import reasoning
  try:
    reasoning.check_config(config)
    baselines.check_config(config)
  except ValueError as e:
    raise ConfigError(str(e)) from None


def rollout_rows(config) -> int:
  """Responses per iteration: rl.batch_size prompts × sampling.num_samples_per_prompt."""
  return config.rl.batch_size * config.sampling.get("num_samples_per_prompt", 1)


def prompt_length(config) -> int:
  """The largest prompt width P a batch is padded to (a batch of short prompts pads to a smaller
  bucket, ``data.prompt_bucket``): what the sizes are checked and the AOT step compiled for."""
  return config.data.prompt_len if config.data.task == "count" else config.data.max_prompt_len


def validate(config: ml_collections.ConfigDict, num_devices: int,
             context_length: int | None = None) -> None:
  """All checks that need no model weights; raises ``ConfigError`` with one clear message."""
  check_data_options(config)  # first: its own message for a value that is no dict
  check_names_and_types(config)
  check_choices(config)
  check_ranges(config)
  check_kl_controller(config)
  check_algorithm(config)
  check_recipe(config)
  check_sizes(config, num_devices, context_length)
  check_packages(config)
  check_tasks(config)


def is_int(v, low: int) -> bool:
  """v is an int (not a bool) >= low."""
  return isinstance(v, int) and not isinstance(v, bool) and v >= low
