"""Supervised fine-tuning for the arithmetic task: SmolLM2-135M-Instruct learns concise correct
answers ("The answer is 68.", "23 + 45 = 68", ...) from ``ppojax.tasks.arith.sft_examples``, by the
negative log-likelihood of the response tokens. On a 2-core CPU: under 3 minutes (16 steps of
7 s), held-out response NLL 1.33 -> 0.44 per token, token accuracy 0.64 -> 0.84.

    python -m ppojax.sft --config configs/sft_arith.py --workdir runs/sft
    python -m ppojax.sft --config configs/sft_arith.py --workdir runs/sft \
        --config.data.train=train.jsonl --config.data.eval=eval.jsonl

The result, runs/sft/policy, starts reward-model training (``--config.model.init=...``) and
PPO (``--config.model.policy=...``).
"""

import ml_collections

from ppojax.run.config import supervised_defaults


def get_config() -> ml_collections.ConfigDict:
  c = supervised_defaults()
  c.train.aggregation = "token_mean"  # "token_mean" or "seq_mean" over response tokens
  return c
