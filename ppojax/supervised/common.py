"""What reward-model training (``ppojax.supervised.train_rm``) and supervised fine-tuning (``ppojax.supervised.sft``)
share, as plain functions:

    model   = build_model(config, head="value")     # tiny random init, or load_model(model.init)
    records = load_records(config.data.train, ...)  # JSONL / datasets dir / a generated task
    result  = fit(config, workdir, model, loss_fn, eval_fn, train, held_out)

A data set is a dict of host arrays with the rows first (``rows`` counts them). A loss is
``loss_fn(params, batch) → (loss, metrics)``; an evaluation is ``eval_fn(params, batch) →
{name: (numerator [B], denominator [B])}``, per-row statistics that ``evaluate`` sums over the
held-out set and divides once at the end, so every mean is exact whatever the batching: the last
partial batch is filled with copies of row 0 at weight 0, and every held-out row counts exactly
once. Training batches are ``encoding.batch_indices(n, batch_size, seed, step)``: a pure function of
the step, reshuffled every epoch, so a run resumed from a checkpoint of (params, optimizer
state) at step s continues exactly as the uninterrupted one (``fit``).
"""

from __future__ import annotations

import functools
import math
import pathlib
from collections.abc import Mapping
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from ppojax.core import optim as optim_lib
from ppojax.data import encoding
from ppojax.data import records as records_lib
from ppojax.infra import hostmem
from ppojax.infra.signals import StopSignals
from ppojax.models import LoadedModel
from ppojax.run import build as build_lib
from ppojax.run import checkpoint, reporting, resume
from ppojax.run import checks as checks_lib

Arrays = dict[str, np.ndarray]
LossFn = Callable[[Any, dict], tuple[jax.Array, dict]]
EvalFn = Callable[[Any, dict], dict[str, tuple[jax.Array, jax.Array]]]
# Checkpoint every SAVE_EVERY steps (and at the end), keep the newest KEEP: the defaults of
# ``save_every`` and ``keep`` for a config without them.
SAVE_EVERY, KEEP = 50, 2


class Result(NamedTuple):
  model: LoadedModel  # the trained model (host params)
  before: dict[str, float]  # held-out statistics before training ("eval/..."), and after:
  after: dict[str, float]
  history: list[dict]  # the logged metric rows (with a workdir: also those before a resume)
  finished: bool = True  # False: stopped early (stop_after, a signal), to resume


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
  model = build_lib.load_named(m.init, jax.random.key(config.seed), tiny=m.tiny,
                            tokenizer=m.tokenizer, head=head, dtype=m.dtype, remat=m.remat,
                            scan_layers=m.scan_layers)
  if model.tokenizer is None:
    raise ValueError(f"model.init={m.init!r} ships no tokenizer: set model.tokenizer")
  return model


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


def load_records(source: str, n: int, split: str, generate: Callable[[int, int, str], list],
                 required: tuple[str, ...], seed: int) -> list[dict]:
  """``generate(seed, n, split)`` for a generated task (``source="arith"``), else the records of
  a JSONL / JSON / parquet file or ``datasets`` directory (its ``split``), the first ``n`` if
  ``n`` > 0."""
  if not source:
    raise records_lib.DataError("no data: set data.train and data.eval (a JSONL file, a datasets "
                         "directory, or 'arith')")
  if source == "arith":
    return generate(seed, n, split)
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
  """Warmup + decay schedule over ``steps``, global-norm clipping and AdamW (``ppojax.learner.step``);
  the updates of a scalar head ("score") scaled by ``optim.head_lr_factor`` (default 1): a
  zero-initialised head at the backbone's small learning rate would take hundreds of steps to
  reach useful scores, and until then passes almost no gradient to the backbone."""
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
      shapes = jax.eval_shape(grads, params, jax.tree.map(lambda x: x[0], micro))
      zero = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
      total = jnp.maximum(units(batch), 1.0)

      def body(acc, mb):
        w = units(mb) / total
        return jax.tree.map(lambda a, x: a + w * x, acc, grads(params, mb)), None

      (g, metrics), _ = jax.lax.scan(body, zero, micro)
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


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------


def fit(config: ml_collections.ConfigDict, workdir: str | pathlib.Path | None, model: LoadedModel,
        loss_fn: LossFn, eval_fn: EvalFn, train: Arrays, held_out: Arrays,
        info: dict[str, float] | None = None, shown: tuple[str, ...] = ("train/loss",),
        units: Callable[[dict], jax.Array] = rows_units, stop_after: int | None = None
        ) -> Result:
  """Trains ``model.params`` for ``train.num_epochs`` epochs of ``train``; evaluates on
  ``held_out`` before, every ``train.eval_every`` steps (−1: every epoch), and after. Metric
  rows (``info`` — e.g. data statistics — and the first evaluation at step 0) go to
  ``workdir/metrics.jsonl``.
  ``units``: what the loss averages over, for exact gradient accumulation (``make_train_step``).

  With a ``workdir`` the run checkpoints and resumes as the PPO run does (``runner.run``):
  params and optimizer state every ``save_every`` steps and at the end, the newest ``keep``
  kept, in ``workdir/checkpoints``; a rerun resumes from the latest complete checkpoint that
  comes from the same config and training data (``ppojax.run.resume``: another run's is refused,
  a corrupt one falls back to the one before) and drops the metric rows written after it, so
  metrics.jsonl and the trained params equal an uninterrupted run's. The batch order is a pure
  function of the step. ``stop_after``, or a first SIGTERM / Ctrl-C, stops after that step with
  a checkpoint (``Result.finished`` is then False); a second signal aborts at once.
  """
  t = config.train
  n = rows(train)
  steps = num_steps(t.num_epochs, n, t.batch_size)
  if t.batch_size % t.grad_accum:
    raise ValueError(f"train.batch_size={t.batch_size} is not divisible by "
                     f"train.grad_accum={t.grad_accum}")
  if t.eval_every < -1:
    raise ValueError(f"train.eval_every={t.eval_every}: use N > 0 (every N steps), 0 (before and "
                     "after training only) or -1 (every epoch)")
  eval_every = t.eval_every if t.eval_every >= 0 else num_steps(1.0, n, t.batch_size)
  tx, schedule = optimizer(config.optim, steps)
  train_step = make_train_step(loss_fn, tx, t.grad_accum, units)

  def evaluation(params) -> dict[str, float]:
    stats = evaluate(eval_fn, params, held_out, t.eval_batch_size)
    hostmem.release()  # as the PPO run: the freed holes of a phase given back between phases
    return {f"eval/{k}": v for k, v in stats.items()}

  state = {"params": jax.tree.map(jnp.array, model.params)}  # own buffers: the step donates them
  state["opt_state"] = tx.init(state["params"])
  start, history, ckpt, writer = 0, [], None, None
  fingerprint = resume.supervised_fingerprint(config, train) if workdir else None
  if workdir:
    ckpt, state, start, history = _resume(config, pathlib.Path(workdir), state, fingerprint)
    wandb = config.get("wandb_project") or None
    writer = reporting.MetricWriter(str(workdir), wandb_project=wandb,
                                    wandb_config=config.to_dict() if wandb else None,
                                    resume_step=start if start else -1)  # -1: rows of no step

  def log(step: int, metrics: dict) -> None:
    history.append({"step": step, **metrics})
    if writer:
      writer.write(step, metrics)

  def save(step: int, force: bool) -> bool:
    return bool(ckpt) and ckpt.save(step, state, {"step": step, "fingerprint": fingerprint},
                                    force=force)

  progress, last, unsaved = None, start, False  # last: the latest completed step
  try:
    with StopSignals() as signals:
      if start == 0:
        before = evaluation(state["params"])
        log(0, {**(info or {}), **before})
      before = _eval_stats(next((r for r in history if r["step"] == 0), {}))
      print(_summary("before training", before), flush=True)
      progress = reporting.Progress(steps, start=start)
      for i in range(start, steps):
        if signals.received:  # arrived after the previous step's save
          if unsaved:
            save(last, force=True)
          break
        batch = take(train, encoding.batch_indices(n, t.batch_size, config.seed, i))
        state["params"], state["opt_state"], metrics = hostmem.compiled_call(
            train_step, state["params"], state["opt_state"], batch)
        last = it = i + 1
        evaluate_now = it == steps or (eval_every and it % eval_every == 0)
        if it % t.log_every == 0 or evaluate_now:
          metrics = {f"train/{k}": float(v) for k, v in jax.device_get(metrics).items()}
          metrics.update(lr=float(schedule(i)), epoch=it * t.batch_size / n)
          if evaluate_now:
            metrics.update(evaluation(state["params"]))
          log(it, metrics)
          progress.update(it, {k: metrics[k] for k in shown if k in metrics})
          if evaluate_now and it < steps:  # the last one is printed after training
            progress.write(_summary(f"at step {it} (epoch {metrics['epoch']:.2f})",
                                    _eval_stats(metrics)))
        stop = it == steps or it == stop_after or signals.received is not None
        unsaved = not save(it, force=stop)
        if not unsaved:
          hostmem.release()
        if stop:
          break
      if signals.received:
        progress.write(f"\nstopped by {signals.received} after step {last}"
                       + (f"; checkpoint {last} saved: run the same command again to resume"
                          if ckpt and last > start else ""))
  finally:
    if progress:
      progress.close()
    if ckpt:
      ckpt.close()
    if writer:
      writer.close()
  finished = last == steps
  after = _eval_stats(history[-1]) if finished else {}
  if finished:
    print(_summary("after training", after), flush=True)
  return Result(model._replace(params=jax.device_get(state["params"])), before, after, history,
                finished)


def _resume(config, workdir: pathlib.Path, state: dict, fingerprint: dict):
  """(checkpointer, state, step, metric rows up to that step) of ``workdir``: its latest
  complete checkpoint's if there is one whose fingerprint matches (else ``ResumeError``),
  or the initial ``state``, step 0 and no rows."""
  workdir.mkdir(parents=True, exist_ok=True)
  ckpt = checkpoint.Checkpointer(workdir / "checkpoints", config.get("save_every", SAVE_EVERY),
                                 config.get("keep", KEEP))
  if ckpt.latest_step() is None:
    return ckpt, state, 0, []
  try:  # refuses another run's checkpoint; skips (and sets aside) corrupt ones
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    state, meta = resume.restore(ckpt, abstract, fingerprint, config)
  except BaseException:
    ckpt.close()
    raise
  step = int(meta["step"])
  print(f"resumed from {workdir / 'checkpoints'} at step {step}", flush=True)
  path = workdir / reporting.METRICS_FILE
  rows_ = reporting.read_metrics(str(path)) if path.exists() else []
  return ckpt, state, step, [r for r in rows_ if r["step"] <= step]


def _eval_stats(row: dict) -> dict[str, float]:
  return {k: v for k, v in row.items() if k.startswith("eval/")}


def _summary(when: str, stats: dict[str, float]) -> str:
  shown = ", ".join(f"{k[5:]} {v:.4f}" for k, v in stats.items() if k != "eval/rows")
  return f"held-out ({int(stats.get('eval/rows', 0))} rows) {when}: {shown}"
