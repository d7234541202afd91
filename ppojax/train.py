"""Command line: ``python -m ppojax.train --config configs/toy.py [--workdir DIR]``.

Config overrides use ml_collections' syntax: ``--config.ppo.kl_coef=0.1``. Metrics are printed
every ``log_every`` iterations and, with ``--workdir``, appended to ``DIR/metrics.jsonl``.
"""

from __future__ import annotations

import json
import os
import time

from absl import app, flags, logging
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import optax

from ppojax import step as step_lib
from ppojax import toy

_CONFIG = config_flags.DEFINE_config_file("config", "configs/toy.py", "Training config file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for metrics.jsonl (optional).")

SHOWN = ("objective/scores", "objective/kl", "objective/rlhf_reward", "policy/approxkl_avg",
         "policy/clipfrac_avg", "loss/value_avg", "objective/response_length")


def optimizer(lr: float, max_grad_norm: float) -> optax.GradientTransformation:
  return optax.chain(optax.clip_by_global_norm(max_grad_norm), optax.adam(lr))


def validate(config) -> None:
  ppo = config.ppo
  if ppo.batch_size % ppo.num_minibatches:
    raise ValueError(
        f"ppo.batch_size={ppo.batch_size} is not divisible by "
        f"ppo.num_minibatches={ppo.num_minibatches}; change one of them")
  if not ppo.stop_ids:
    raise ValueError("ppo.stop_ids is empty: responses need at least one stop token id")


def run(config, workdir: str | None = None) -> list[dict]:
  """Trains for ``config.num_iterations`` and returns the logged metrics, one dict per log."""
  validate(config)
  task = config.task
  models = toy.make_models(
      list(task.target), config.ppo.stop_ids[0], task.vocab_size, task.response_length)
  key, k_init = jax.random.split(jax.random.key(config.seed))
  actor, critic = toy.init_params(k_init, task.vocab_size, task.response_length)
  actor_tx = optimizer(config.optim.actor_lr, config.optim.max_grad_norm)
  critic_tx = optimizer(config.optim.critic_lr, config.optim.max_grad_norm)
  ref_actor = jax.tree.map(jnp.copy, actor)  # frozen copy of the initial policy
  state = step_lib.init_state(key, actor, critic, actor_tx, critic_tx, config.ppo)
  train_step = step_lib.make_train_step(models, ref_actor, actor_tx, critic_tx, config.ppo)

  log_path = None
  if workdir:
    os.makedirs(workdir, exist_ok=True)
    log_path = os.path.join(workdir, "metrics.jsonl")
  history = []
  start = time.perf_counter()
  for it in range(1, config.num_iterations + 1):
    state, metrics = train_step(state)
    if it % config.log_every == 0 or it in (1, config.num_iterations):
      row = {"iteration": it, "episode": it * config.ppo.batch_size,
             **{k: float(v) for k, v in jax.device_get(metrics).items()},
             "time_s": time.perf_counter() - start}
      history.append(row)
      print(f"iter {it:5d}  " + "  ".join(f"{k.split('/')[-1]}={row[k]:.4f}" for k in SHOWN),
            flush=True)
      if log_path:
        with open(log_path, "a") as f:
          f.write(json.dumps(row) + "\n")
  first, last = history[0]["objective/scores"], history[-1]["objective/scores"]
  print(f"score: {first:.3f} -> {last:.3f} over {config.num_iterations} iterations "
        f"({time.perf_counter() - start:.1f}s including compilation)")
  return history


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)
  config = _CONFIG.value
  print(config)
  run(config, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
