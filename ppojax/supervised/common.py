"""What reward-model training (``ppojax.supervised.train_rm``) and supervised fine-tuning
(``ppojax.supervised.sft``) share, as plain functions; their loop is ``loop.fit``
(ppojax/supervised/loop.py):

    model   = build_model(config, head="value")     # tiny random init, or load_model(model.init)
    records = load_records(config.data.train, ...)  # JSONL / datasets dir / a generated task
    result  = loop.fit(config, workdir, model, loss_fn, eval_fn, train, held_out)

A data set is a dict of host arrays with the rows first (``rows`` counts them). A loss is
``loss_fn(params, batch) → (loss, metrics)``; an evaluation is ``eval_fn(params, batch) →
{name: (numerator [B], denominator [B])}``, per-row statistics that ``evaluate`` sums over the
held-out set and divides once at the end, so every mean is exact whatever the batching: the last
partial batch is filled with copies of row 0 at weight 0, and every held-out row counts exactly
once. Training batches are ``encoding.batch_indices(n, batch_size, seed, step)``: a pure function
of the step, reshuffled every epoch, so a run resumed from a checkpoint of (params, optimizer
state) at step s continues exactly as the uninterrupted one.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from ppojax.core import optim as optim_lib
from ppojax.core.optim import accumulate
from ppojax.data import encoding
from ppojax.data import records as records_lib
from ppojax.models import LoadedModel
from ppojax.run import checks as checks_lib
from ppojax.run import models as run_models

Arrays = dict[str, np.ndarray]
LossFn = Callable[[Any, dict], tuple[jax.Array, dict]]
EvalFn = Callable[[Any, dict], dict[str, tuple[jax.Array, jax.Array]]]


# ---------------------------------------------------------------------------------------------
# Model and tokenizer
# ---------------------------------------------------------------------------------------------


def build_model(config: ml_collections.ConfigDict, head: str = "lm") -> LoadedModel:
  """The model to train: ``model.init`` = "tiny" (random init from ``model.tiny``, the vocabulary
  sized to the tokenizer of ``model.tokenizer``) or anything ``load_model`` accepts ("smollm2",
  a GGUF file, a Hugging Face directory); ``head="value"`` adds a scalar head, zero when the
  checkpoint has none and for "tiny" (an untrained reward model scores every pair a tie).
  ``model.tokenizer``, when set, replaces the checkpoint's tokenizer."""
  checks_lib.check_packages(config)
  m = config.model
  if m.init == "tiny" and not m.tokenizer:
    raise ValueError("model.init='tiny' needs model.tokenizer (a Hugging Face directory, GGUF "
                     "file or 'smollm2') to size its vocabulary and encode the data")
  model = run_models.load_named(m.init, jax.random.key(config.seed), tiny=m.tiny,
                                tokenizer=m.tokenizer, head=head, dtype=m.dtype, remat=m.remat,
                                scan_layers=m.scan_layers, option="model.init")
  if model.tokenizer is None:
    raise ValueError(f"model.init={m.init!r} ships no tokenizer: set model.tokenizer")
  return model


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


def load_records(source: str, n: int, split: str,
                 generate: Mapping[str, Callable[[int, int, str], list]],
                 required: tuple[str, ...], seed: int) -> list[dict]:
  """``generate[source](seed, n, split)`` for a generated task (``source`` "arith", ...), else
  the records of a JSONL / JSON / parquet file or ``datasets`` directory (its ``split``), the
  first ``n`` if ``n`` > 0."""
  if not source:
    raise records_lib.DataError(f"no data: set data.train and data.eval (a JSONL file, a "
                                f"datasets directory, or one of {', '.join(generate)})")
  if source in generate:
    return generate[source](seed, n, split)
  records = records_lib.read_records(source, required=required, split=split)
  return records[:n] if n else records


def fit_length(encoded: list[encoding.Encoded], left: bool) -> list[encoding.Encoded]:
  """Drops the columns that are padding in every row of every set — the leading ones of
  left-padded prompts (``left``), the trailing ones of right-padded responses — so the compiled
  length is the longest sequence in the data, at most the configured maximum."""
  length = max(1, max(int(e.mask.sum(1).max(initial=0)) for e in encoded))
  cols = (lambda a: a[:, a.shape[1] - length:]) if left else (lambda a: a[:, :length])  # noqa
  return [encoding.Encoded(cols(e.tokens), cols(e.mask), e.truncated) for e in encoded]


def rows(arrays: Arrays) -> int:
  return len(next(iter(arrays.values())))


def take(arrays: Arrays, idx: np.ndarray) -> Arrays:
  return {k: v[idx] for k, v in arrays.items()}


# ---------------------------------------------------------------------------------------------
# Optimizer, train step, evaluation
# ---------------------------------------------------------------------------------------------


def num_steps(num_epochs: float, n: int, batch_size: int) -> int:
  """⌈num_epochs · n / batch_size⌉ optimizer steps (at least 1)."""
  return max(1, math.ceil(num_epochs * n / batch_size))


def optimizer(optim: ml_collections.ConfigDict, steps: int
              ) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """Warmup + decay schedule over ``steps``, global-norm clipping and AdamW
  (``ppojax.learner.step``); the updates of a scalar head ("score") scaled by
  ``optim.head_lr_factor`` (default 1): a zero-initialised head at the backbone's small learning
  rate would take hundreds of steps to reach useful scores, and until then passes almost no
  gradient to the backbone."""
  schedule = optim_lib.lr_schedule(optim.lr, steps, optim.warmup_steps, optim.decay,
                                  optim.end_factor)
  tx = optim_lib.make_optimizer(schedule, optim.max_grad_norm, optim.weight_decay)
  factor = optim.get("head_lr_factor", 1.0)
  if factor != 1.0:
    tx = optax.chain(tx, optax.masked(optax.scale(factor), _is_head))
  return tx, schedule


def _is_head(params):
  if isinstance(params, Mapping):
    return {k: k == "score" for k in params}
  return jax.tree.map(lambda _: False, params)


def rows_units(batch: dict) -> jax.Array:
  """The units of a loss that is a mean over rows of equal weight (Bradley–Terry): the rows."""
  return jnp.float32(next(iter(batch.values())).shape[0])


def make_train_step(loss_fn: LossFn, tx: optax.GradientTransformation, grad_accum: int = 1,
                    units: Callable[[dict], jax.Array] = rows_units):
  """``(params, opt_state, batch) → (params, opt_state, metrics)``, compiled, inputs donated;
  the metrics are the loss function's plus ``loss`` and ``grad_norm`` (before clipping).

  With ``grad_accum`` = K the batch is split into K equal micro-batches (a ``lax.scan``: one
  micro-batch's activations in memory at a time) whose gradients and metrics are summed with
  the weights

      w_k = units(micro-batch k) / units(batch),    Σ_k w_k·∇L_k = ∇L(batch)

  where ``units(batch)`` counts what the loss averages over (``rows_units``: rows; an SFT token
  mean: its tokens, ``ops.aggregation_count``). The sum is then exactly the whole batch's
  gradient, however unevenly the units fall into the micro-batches (as the PPO update's
  ``_micro_weight``). A batch without units gives zero weights (and a zero gradient).
  """

  def grads(params, batch):  # (gradient, metrics with the loss)
    (loss, metrics), g = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
    return g, dict(metrics, loss=loss)

  def train_step(params, opt_state, batch):
    if grad_accum == 1:
      g, metrics = grads(params, batch)
    else:
      micro = jax.tree.map(lambda x: x.reshape(grad_accum, -1, *x.shape[1:]), batch)
      total = jnp.maximum(units(batch), 1.0)

      def weighted(mb):  # (w·g, w·metrics)
        w = units(mb) / total
        g, metrics = grads(params, mb)
        return jax.tree.map(lambda x: w * x, g), jax.tree.map(lambda x: w * x, metrics)

      zeros = jax.tree.map(jnp.zeros_like, params)
      g, metrics = accumulate(weighted, zeros, micro)
      metrics = jax.tree.map(lambda m: jnp.sum(m, axis=0), metrics)
    updates, opt_state = tx.update(g, opt_state, params)
    metrics = dict(metrics, grad_norm=optax.tree.norm(g))
    return optax.apply_updates(params, updates), opt_state, metrics

  return jax.jit(train_step, donate_argnums=(0, 1))


def eval_batches(n: int, batch_size: int):
  """(row indices [batch_size], weights [batch_size]) covering rows 0 … n−1 exactly once; the
  last batch is filled with row 0 at weight 0 (a fixed shape: one compilation)."""
  for start in range(0, n, batch_size):
    idx = np.arange(start, start + batch_size)
    yield np.where(idx < n, idx, 0), (idx < n).astype(np.float32)


def evaluate(eval_fn: EvalFn, params, arrays: Arrays, batch_size: int) -> dict[str, float]:
  """mean_name = Σ_rows w·numerator / Σ_rows w·denominator over the held-out ``arrays``, plus
  ``rows``, the number of rows counted (weights w: 1 for real rows, 0 for filler)."""
  totals, count = {}, 0.0
  for idx, weight in eval_batches(rows(arrays), batch_size):
    sums = jax.device_get(_weighted_sums(eval_fn, params, take(arrays, idx), weight))
    totals = sums if not totals else jax.tree.map(np.add, totals, sums)
    count += float(weight.sum())
  out = {name: float(num / max(den, 1e-12)) for name, (num, den) in totals.items()}
  return {**out, "rows": count}


@functools.partial(jax.jit, static_argnums=0)
def _weighted_sums(eval_fn, params, batch, weight):
  stats = eval_fn(params, batch)
  return {k: (jnp.sum(weight * num), jnp.sum(weight * den)) for k, (num, den) in stats.items()}
