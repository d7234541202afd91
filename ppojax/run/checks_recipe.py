"""The checks of an algorithm's resolved choices and recipe options (``checks.validate`` runs
them with the others): groups to compare where an estimator or dynamic sampling needs them,
LoRA's targets, the overlong buffer within the length limit, dual-clip with PPO's term only.
"""

from __future__ import annotations

import ml_collections

from ppojax.core import algorithms, options


class ConfigError(ValueError):
  """A config that cannot run; the message names the option and what to do."""


def check_algorithm(config: ml_collections.ConfigDict) -> None:
  """The algorithm's resolved choices fit together: a group estimator has groups to compare;
  LoRA's targets are layers of the model."""
  if config.lora.critic and not (config.lora.rank and config.model.critic_init == "policy"):
    raise ConfigError(
        "lora.critic=True puts the critic's adapters on the policy's frozen base: it needs "
        f"lora.rank > 0 (got {config.lora.rank}) and model.critic_init='policy' (got "
        f"{config.model.critic_init!r}); a critic initialised from a reward model has another "
        "base")
  if config.lora.dropout and not config.lora.rank:
    raise ConfigError(
        f"lora.dropout={config.lora.dropout} drops out the LoRA adapters' input, but "
        "lora.rank=0 (full fine-tuning) has no adapters: set lora.rank > 0 or lora.dropout=0")
  if config.lora.rank:
    from ppojax.models import lora  # pylint: disable=import-outside-toplevel
    try:
      lora.targets(config.lora.targets)
    except ValueError as e:
      raise ConfigError(f"lora.targets={config.lora.targets!r}: {e}") from None
  rl = algorithms.resolve(config).rl
  if rl.get("clip_eps_low") is not None:  # (0, 1), or any > 0 for CISPO (no floor)
    try:
      options.check_option("rl.clip_eps_low", rl.clip_eps_low,
                           options.clip_floor_option(rl.loss_mode))
    except ValueError as e:
      raise ConfigError(str(e)) from None
  n = config.sampling.get("num_samples_per_prompt", 1)
  if algorithms.from_config(config).needs_groups and n < 2:
    raise ConfigError(
        f"rl.estimator={rl.estimator!r} (algorithm {config.algorithm!r}) compares the samples "
        f"of a prompt, but sampling.num_samples_per_prompt={n}: every advantage would be 0. "
        "Set --config.sampling.num_samples_per_prompt=4 (or more), or another estimator")


def check_recipe(config: ml_collections.ConfigDict) -> None:
  """The recipe options fit together: dynamic sampling has groups to compare, the overlong
  buffer lies within the length limit, dual-clip caps PPO's token-ratio term only."""
  rl, n = algorithms.resolve(config).rl, config.sampling.get("num_samples_per_prompt", 1)
  if rl.get("dynamic_sampling", False) and n < 2:
    raise ConfigError(
        "rl.dynamic_sampling keeps the groups whose scores differ, but "
        f"sampling.num_samples_per_prompt={n}: set it to 4 (or more)")
  if rl.get("oversample", 1.0) != 1.0 and not rl.get("dynamic_sampling", False):
    raise ConfigError(f"rl.oversample={rl.oversample} samples more prompts than "
                      "rl.batch_size for dynamic sampling to choose from: set "
                      "--config.rl.dynamic_sampling=True, or rl.oversample=1.0")
  if rl.get("overlong_buffer", 0) > config.sampling.max_new_tokens:
    raise ConfigError(f"rl.overlong_buffer={rl.overlong_buffer} is longer than "
                      f"sampling.max_new_tokens={config.sampling.max_new_tokens}: the penalty "
                      "ramps over the last overlong_buffer tokens before that limit")
  if rl.loss_mode != "clip" and rl.get("dual_clip") is not None:
    raise ConfigError(
        f"rl.dual_clip={rl.dual_clip} caps PPO's token-ratio term, but rl.loss_mode="
        f"{rl.loss_mode!r} (algorithm {config.algorithm!r}) has another policy term: set "
        "--config.rl.dual_clip=None, or rl.loss_mode='clip'")
