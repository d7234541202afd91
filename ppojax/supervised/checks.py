"""The checks of an SFT or reward-model config (``ppojax.run.config.supervised_defaults``) that
need no model: the same names-and-types, choices and ranges checks as a run's
(``ppojax.run.checks``), over the supervised stages' own options."""

from __future__ import annotations

import ml_collections

from ppojax.core import ops
from ppojax.run import checks
from ppojax.run.config import supervised_defaults

SUPERVISED_CHOICES = {
    "model.dtype": checks.CHOICES["model.dtype"], "data.truncate": checks.CHOICES["data.truncate"],
    "train.aggregation": ops.AGGREGATIONS, "optim.decay": ("constant", "linear", "cosine")}
SUPERVISED_RANGES = (
    ("train.batch_size", lambda v: checks.is_int(v, 1), "must be an integer >= 1"),
    ("train.grad_accum", lambda v: checks.is_int(v, 1), "must be an integer >= 1"),
    ("train.eval_batch_size", lambda v: checks.is_int(v, 1), "must be an integer >= 1"),
    ("train.num_epochs", lambda v: v > 0, "must be > 0 (passes over the training rows)"),
    ("train.log_every", lambda v: checks.is_int(v, 1), "must be an integer >= 1"),
    ("train.eval_every", lambda v: checks.is_int(v, -1),
     "must be an integer >= -1 (N: every N steps; 0: before and after only; -1: each epoch)"),
    ("data.max_prompt_len", lambda v: checks.is_int(v, 1), "must be an integer >= 1 (tokens)"),
    ("data.max_response_len", lambda v: checks.is_int(v, 1), "must be an integer >= 1 (tokens)"),
    ("data.train_size", lambda v: checks.is_int(v, 0), "must be an integer >= 0 (0: all rows)"),
    ("data.eval_size", lambda v: checks.is_int(v, 0), "must be an integer >= 0"),
    ("optim.lr", lambda v: v > 0, "must be > 0"),
    ("optim.warmup_steps", lambda v: checks.is_int(v, 0), "must be an integer >= 0"),
    ("optim.end_factor", lambda v: 0 <= v <= 1, "must be in [0, 1] (final lr = end_factor·lr)"),
    ("optim.weight_decay", lambda v: v >= 0, "must be >= 0"),
    ("optim.head_lr_factor", lambda v: v > 0, "must be > 0 (the score head's lr = factor × lr)"),
    ("optim.max_grad_norm", lambda v: v > 0, "must be > 0 (the global norm gradients are "
     "clipped to; 1.0 is usual)"),
    ("keep", lambda v: checks.is_int(v, 1), "must be an integer >= 1 (checkpoints kept)"),
)


def validate_supervised(config: ml_collections.ConfigDict) -> None:
  """The checks of an SFT or reward-model config (``config.supervised_defaults()``) that need
  no model: the chat template's variables, names and types, choices, ranges, the micro-batches
  in the batch, packages."""
  checks.check_data_options(config)
  checks.check_names_and_types(config, supervised_defaults())
  checks.check_choices(config, SUPERVISED_CHOICES)
  checks.check_ranges(config, SUPERVISED_RANGES)
  train = config.train
  if train.batch_size % train.grad_accum:
    raise checks.ConfigError(f"train.batch_size={train.batch_size} is not a multiple of "
                      f"train.grad_accum={train.grad_accum}: each micro-batch holds "
                      "batch_size / grad_accum examples")
  checks.check_packages(config)
