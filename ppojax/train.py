"""Command line: ``python -m ppojax.train --config configs/NAME.py [--workdir DIR]``.

Config files are ml_collections files with ``get_config()``; override any field with
``--config.section.field=value`` (e.g. ``--config.rl.kl_coef=0.1``). The config is checked
first (``build.validate``: everything that needs no model weights) and printed once it is valid;
a bad option, config, data record or model path is one message and exit code 2
(``ppojax.infra.cli``; ``PPOJAX_DEBUG=1`` or ``--debug``: the traceback). With ``--workdir``
the run resumes from the latest complete checkpoint there (a rerun with another seed, batch,
model or data is refused, naming the fields and the override
``--config.resume_allow_changes=...``: ppojax/run/resume.py) and writes config.json (the resolved
config), metrics.jsonl, TensorBoard events, samples.jsonl, the held-out eval.json and
eval_samples_*.jsonl, curves.png and the final policy/. A config with a ``classic`` section
(configs/cartpole.py) trains a classic-control agent instead (``ppojax.classic.runner``).
Compiled programs are kept in the persistent compilation cache (``--compile_cache=DIR|off``,
``ppojax.infra.cli``); each metric row and the run's last line say what compiling cost.
"""

from __future__ import annotations

import copy
import math
import os

# transformers warns on import that PyTorch is missing; ppojax never needs it.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from absl import flags, logging
from ml_collections import config_flags

from ppojax.infra import cli, hostmem
from ppojax.run import build, reporting, runner

PROG = "ppojax.train"
_CONFIG = config_flags.DEFINE_config_file(
    "config", None, cli.default_config("toy.py", "Training config file."))
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory: checkpoints, metrics, plots.")
flags.adopt_module_key_flags(cli)


def check(config) -> None:
  """Every check of ``config`` that needs no model weights, on a copy (the run gets the config
  as given). A distributed run's devices are known only after ``jax.distributed.initialize``
  (``runner.run``), so here its mesh is taken to fit; ``build`` checks it with the devices."""
  if "classic" in config:
    from ppojax.classic import runner as classic_runner  # pylint: disable=import-outside-toplevel
    classic_runner.hyper(config)
    return
  devices = None
  if config.get("distributed", False):
    devices = max(1, math.prod(s for s in config.mesh.shape if s > 0))
  build.validate(copy.deepcopy(config), devices)


def main(argv):
  if len(argv) > 1:
    raise cli.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  logging.set_verbosity(logging.WARNING)
  config = _CONFIG.value
  check(config)
  print(config, flush=True)
  if "classic" in config:  # classic control (configs/cartpole.py): ppojax.classic's own runner
    from ppojax.classic import runner as classic_runner  # pylint: disable=import-outside-toplevel
    classic_runner.main(config, _WORKDIR.value)
    return
  history, evals = runner.run(config, _WORKDIR.value)
  if history:
    print(reporting.score_line(history, config.num_iterations, config.log_every), flush=True)
  if "before" in evals:  # and "after" unless num_iterations = 0
    # eval.baselines: the policy the run started from, with each instruction
    shown = [p for p in evals if p.startswith("before_")]
    for name in evals["before"]:
      get = lambda phase, name=name: f"{evals[phase].get(name, float('nan')):.3f}"  # noqa: E731
      after = f" -> {get('after')}" if "after" in evals else ""
      also = "".join(f", {p.removeprefix('before_')} (starting policy) {get(p)}" for p in shown)
      print(f"held-out {name.removeprefix('eval/')}: {get('before')}{after}{also}", flush=True)


if __name__ == "__main__":
  hostmem.reexec_with_huge_pages()
  cli.run(main, PROG, loaders=(check, build.build), configs=(_CONFIG,))
