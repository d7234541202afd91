"""Supervised fine-tuning: ``python -m ppojax.sft --config configs/sft_arith.py --workdir DIR``.

Override any config field with ``--config.section.field=value``; the resolved config is printed
once the checks that need no model pass. The fine-tuning itself is ``ppojax.supervised.sft``
(``python -m ppojax.sft`` runs this command too). A bad option, config, data record
or model path is one message and exit code 2 (``ppojax.infra.cli``; ``PPOJAX_DEBUG=1`` or
``--debug``: the traceback).
"""

from __future__ import annotations

import os

# transformers warns on import that PyTorch is missing; ppojax never needs it.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from absl import flags, logging
from ml_collections import config_flags

from ppojax.infra import cli, hostmem
from ppojax.supervised import checks as supervised_checks
from ppojax.supervised import common, sft

PROG = "ppojax.sft"
_CONFIG = config_flags.DEFINE_config_file(
    "config", None, cli.default_config("sft_arith.py", "Config file."))
_WORKDIR = flags.DEFINE_string("workdir", None,
                               "Run directory: checkpoints (resumed), metrics, policy/.")
flags.adopt_module_key_flags(cli)


def check(config) -> None:
  """The checks that need no model (``supervised_checks.validate_supervised``)."""
  supervised_checks.validate_supervised(config)


def main(argv):
  if len(argv) > 1:
    raise cli.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  logging.set_verbosity(logging.WARNING)
  config = _CONFIG.value
  check(config)
  print(config, flush=True)
  result = sft.run(config, _WORKDIR.value)
  if not result.finished:
    return
  b, a = result.before, result.after
  print(f"held-out response NLL: {b['eval/nll']:.3f} -> {a['eval/nll']:.3f}, token accuracy: "
        f"{b['eval/token_accuracy']:.3f} -> {a['eval/token_accuracy']:.3f}", flush=True)


if __name__ == "__main__":
  hostmem.reexec_with_huge_pages()
  cli.run(main, PROG, loaders=(check, common.build_model, sft.load_examples), configs=(_CONFIG,))
