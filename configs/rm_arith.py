"""Reward model for the arithmetic task: SmolLM2-135M-Instruct plus a scalar head learns to
prefer correct answers over plausible wrong ones (same wording, only the number differs), from
pairs made by ``ppojax.tasks.arith.preference_pairs``. On a 2-core CPU: about 4 minutes (16 steps of
13 s), held-out pairwise accuracy 0.50 -> 0.62 (loss 0.693 -> 0.616) on template pairs.
Trained from the SFT policy on its own mistakes (``ppojax.supervised.preferences``; ``benchmarks/rlhf.py``
runs SFT, the pairs and this stage): 0.848 on 946 held-out pairs after 2 epochs of 7,430 pairs
(465 steps, 29 s on an H200; docs/learning.md). Held-out accuracy is reported every epoch.

    python -m ppojax.train_rm --config configs/rm_arith.py --workdir runs/rm
    python -m ppojax.train_rm --config configs/rm_arith.py --workdir runs/rm \
        --config.model.init=runs/sft/policy --config.data.train=prefs.jsonl --config.data.eval=...

PPO then uses it with ``--config.reward.kind=model --config.model.reward=runs/rm/reward_model``.
"""

import ml_collections

from ppojax.run.config import supervised_defaults


def get_config() -> ml_collections.ConfigDict:
  c = supervised_defaults()
  c.optim.lr = 1e-4
  c.optim.head_lr_factor = 30.0  # the score head's lr = factor * lr (it starts at zero)
  c.train.eval_every = -1  # held-out pairwise accuracy after every epoch
  return c
