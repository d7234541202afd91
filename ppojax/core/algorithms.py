"""The algorithms of the one step, as data: which advantage estimator, where the KL penalty goes,
how token losses are aggregated and which per-token KL estimator is used.

    config.algorithm = "grpo"        # then, in runner.build: config = algorithms.resolve(config)

Each ``ppo.*`` field of ``Algorithm`` left at "" in the config takes the algorithm's value; a
value set in the config wins (``--config.algorithm=grpo --config.ppo.aggregation=token_mean``).
Nothing downstream asks which algorithm runs: the step reads the resolved fields, and a critic
exists only where the estimator needs one (``advantages.Estimator.needs_critic``).

| algorithm    | estimator    | KL goes into | aggregation             | KL estimator |
|--------------|--------------|--------------|-------------------------|--------------|
| ppo          | gae          | reward       | token_mean              | k1           |
| grpo         | grpo         | loss         | seq_mean_token_mean     | k3           |
| dr_grpo      | dr_grpo      | loss         | seq_mean_token_sum_norm | k3           |
| rloo         | rloo         | reward       | token_mean              | k1           |
| reinforce_pp | reinforce_pp | reward       | token_mean              | k2           |

KL in the reward: r_t = −β·KL_t (+ the score on the last token), and a sequence estimator reads
the sequence reward Σ_t r_t = s − β·Σ_t KL_t (trl's RLOO). KL in the loss: the rewards are the
scores alone and the loss adds β·agg(KL_t) (``losses.kl_loss``; GRPO). REINFORCE++'s k2
(½·(log π − log π_ref)², Hu 2025) is OpenRLHF's default for it.
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import ml_collections


class Algorithm(NamedTuple):
  """An algorithm's defaults for the ``ppo`` section's fields of the same names."""

  estimator: str  # advantages.ESTIMATORS
  kl_in: str  # "reward" or "loss"
  aggregation: str  # ops.AGGREGATIONS
  kl_estimator: str  # kl.KL_ESTIMATORS


ALGORITHMS: dict[str, Algorithm] = {
    "ppo": Algorithm("gae", "reward", "token_mean", "k1"),
    "grpo": Algorithm("grpo", "loss", "seq_mean_token_mean", "k3"),
    "dr_grpo": Algorithm("dr_grpo", "loss", "seq_mean_token_sum_norm", "k3"),
    "rloo": Algorithm("rloo", "reward", "token_mean", "k1"),
    "reinforce_pp": Algorithm("reinforce_pp", "reward", "token_mean", "k2"),
}
KL_PLACEMENTS = ("reward", "loss")


def algorithm(name: str) -> Algorithm:
  """The ``ALGORITHMS`` entry ``name``; a clear ``ValueError`` for any other."""
  try:
    return ALGORITHMS[name]
  except KeyError:
    raise ValueError(f"unknown algorithm {name!r}; choose one of {', '.join(ALGORITHMS)}"
                     ) from None


def resolve(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A copy of ``config`` whose ``ppo`` fields named in ``Algorithm`` that are "" hold
  ``config.algorithm``'s defaults (fields already set are kept). Idempotent."""
  config = copy.deepcopy(config)
  defaults = algorithm(config.get("algorithm", "ppo"))
  for field, value in defaults._asdict().items():
    if config.ppo.get(field, "") == "":
      config.ppo[field] = value
  return config


def unresolved(ppo: ml_collections.ConfigDict) -> list[str]:
  """The ``ppo`` fields still "" (``resolve`` not applied)."""
  return [f"ppo.{f}" for f in Algorithm._fields if ppo.get(f, "") == ""]
