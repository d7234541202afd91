"""Preference pairs from a policy's own mistakes (``ppojax.supervised.preferences``)::

    python -m ppojax.preferences --config configs/rlhf_arith.py --out prefs/train.jsonl \\
        --config.model.policy=runs/sft_arith/policy [--n 2048] [--samples 4] \\
        [--temperature 1.0] [--split train] [--synthetic 2048] [--seed 0]

``python -m ppojax.preferences`` runs this command too. A bad option, config or
model path is one message and exit code 2 (``ppojax.infra.cli``; ``PPOJAX_DEBUG=1`` or
``--debug``: the traceback).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from absl import flags
from ml_collections import config_flags

from ppojax.data import records
from ppojax.infra import cli
from ppojax.run import models as run_models
from ppojax.supervised import preferences
from ppojax.tasks import sources

PROG = "ppojax.preferences"
_CONFIG = config_flags.DEFINE_config_file(
    "config", None, cli.default_config("rlhf_arith.py", "PPO config: its model.policy samples."))
_OUT = flags.DEFINE_string("out", None, "JSONL file to write.", required=True)
_N = flags.DEFINE_integer("n", 2048, "Problems the policy answers.", lower_bound=1)
_SPLIT = flags.DEFINE_enum("split", "train", ["train", "test"], "Which problems.")
_SAMPLES = flags.DEFINE_integer("samples", 4, "Responses per problem.", lower_bound=1)
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Sampling temperature.")
_SYNTHETIC = flags.DEFINE_integer("synthetic", 0, "Template pairs (arith.preference_pairs) added.",
                                  lower_bound=0)
_SEED = flags.DEFINE_integer("seed", 0, "Problems and sampling.")
flags.adopt_module_key_flags(cli)


def main(argv):
  if len(argv) > 1:
    raise cli.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  pairs, stats = preferences.make_pairs(_CONFIG.value, _N.value, _SPLIT.value, _SAMPLES.value,
                                        _TEMPERATURE.value, _SYNTHETIC.value, _SEED.value)
  records.write_jsonl(pairs, _OUT.value)
  print(f"wrote {len(pairs)} pairs to {_OUT.value}: {stats}", flush=True)
  for p in [p for p in pairs if p["source"] == "policy"][:5]:
    print(f"  {p['prompt']!r}: chosen {p['chosen']!r} > rejected {p['rejected']!r}")


if __name__ == "__main__":
  cli.run(main, PROG, loaders=(run_models.load_policy, sources.prompt_encoder), configs=(_CONFIG,))
