"""The classic-control run behind ``python -m ppojax.train --config configs/cartpole.py``.

A config with a ``classic`` section (``configs/cartpole.py``) comes here instead of the
language-model runner. It trains ``num_seeds`` agents at once (``jax.vmap``) and reports as
the language-model runs do: a progress line every ``log_every`` iterations (``progress.Progress``),
and with ``--workdir`` config.json, metrics.jsonl and TensorBoard events
(``reporting.MetricWriter``; each row the mean over seeds, plus the worst seed's return) and
curves.png (``reporting.plot_curves``). The iterations run ``log_every`` at a time in one
compiled ``lax.scan`` of ``ppo.make_iteration``, the very function ``ppo.make_train`` scans over
the whole run, so the agents are those of ``make_train`` with the same seeds.
"""

from __future__ import annotations

import json
import pathlib
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from ppojax.classic import ppo
from ppojax.infra import files
from ppojax.run import reporting
from ppojax.run.progress import Progress

CURVES = ("episode/return", "episode/return_min", "policy/entropy_masked", "loss/value")
SHOWN = ("episode/return", "episode/return_min", "policy/entropy_masked")


def hyper(config: ml_collections.ConfigDict) -> ppo.Hyper:
  """``config.classic`` as checked ``ppo.Hyper``; a ``ValueError`` names an unknown field."""
  fields = dict(config.classic)
  unknown = set(fields) - set(ppo.Hyper._fields)
  if unknown:
    raise ValueError(f"config.classic has unknown fields {sorted(unknown)}; the fields are "
                     f"{list(ppo.Hyper._fields)}")
  return ppo.Hyper(**fields).check()


def seed_keys(seed: int, num_seeds: int) -> jax.Array:
  """One key per agent: ``random.split(key(seed), num_seeds)`` (the benchmark's and tests')."""
  if num_seeds < 1:
    raise ValueError(f"num_seeds={num_seeds} must be >= 1")
  return jax.random.split(jax.random.key(seed), num_seeds)


def _chunk_fn(iteration, length: int):
  """``length`` iterations of every agent in one compiled scan: state → (state, metrics
  [seeds, length])."""
  return jax.jit(jax.vmap(ppo.iterations(iteration, length)), donate_argnums=0)


def _row(metrics: dict[str, np.ndarray], i: int) -> dict[str, float]:
  """Iteration i of a chunk's metrics [seeds, length]: means over seeds; the worst seed's
  return as ``episode/return_min``."""
  row = {k: float(np.mean(v[:, i])) for k, v in metrics.items()}
  row["episode/return_min"] = float(np.min(metrics["episode/return"][:, i]))
  return row


def run(config: ml_collections.ConfigDict, workdir: str | None = None) -> list[dict]:
  """Trains ``config.num_seeds`` agents for ``classic.total_timesteps`` steps each; returns the
  metric rows (one per iteration, ``step`` = iteration)."""
  hp = hyper(config)
  num_seeds, log_every = int(config.num_seeds), max(1, int(config.log_every))
  n = hp.num_updates
  iteration = ppo.make_iteration(hp)
  state = jax.jit(jax.vmap(lambda k: ppo.init(hp, k)))(seed_keys(int(config.seed), num_seeds))
  writer = None
  if workdir:
    path = pathlib.Path(workdir)
    path.mkdir(parents=True, exist_ok=True)
    with files.atomic_write(str(path / "config.json"), "w") as f:
      json.dump(config.to_dict(), f, indent=2)
    # resume_step=0: a rerun in the same workdir starts its metrics afresh (no checkpoints here)
    writer = reporting.MetricWriter(str(path), wandb_project=config.get("wandb_project") or None,
                                    resume_step=0)
  chunks = {}
  history, done, start = [], 0, time.perf_counter()
  progress = Progress(n)
  try:
    while done < n:
      length = min(log_every, n - done)
      if length not in chunks:
        chunks[length] = _chunk_fn(iteration, length)
      state, metrics = chunks[length](state)
      metrics = jax.tree.map(np.asarray, metrics)
      for i in range(length):
        it = done + i + 1
        row = _row(metrics, i)
        row.update({"env_steps": it * hp.batch_size,
                    "sps": it * hp.batch_size * num_seeds / (time.perf_counter() - start)})
        history.append({"step": it, **row})
        if writer is not None:
          writer.write(it, row)
      done += length
      progress.update(done, {k: history[-1][k] for k in SHOWN})
  finally:
    progress.close()
    if writer is not None:
      writer.close()
  if workdir:
    out = str(pathlib.Path(workdir) / "curves.png")
    plotted = reporting.plot_curves(str(pathlib.Path(workdir) / reporting.METRICS_FILE), out,
                                    keys=CURVES)
    print(f"wrote {out} ({', '.join(plotted)})", flush=True)
  return history


def main(config: ml_collections.ConfigDict, workdir: str | None = None) -> list[dict]:
  """The CLI's classic branch: ``run``, then one summary line."""
  start = time.perf_counter()
  history = run(config, workdir)
  returns = np.array([r["episode/return"] for r in history])
  first = int(ppo.first_reaching(jnp.asarray(returns), float(config.target_return)))
  print(f"{config.classic.env}: mean return over {config.num_seeds} seed(s) "
        f"{returns[0]:.1f} -> {returns[-1]:.1f} after {history[-1]['env_steps']} steps per seed "
        f"in {time.perf_counter() - start:.1f} s; first >= {config.target_return:g} at iteration "
        f"{first if first >= 0 else 'never'}", flush=True)
  return history
