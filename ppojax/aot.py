"""Deviceless compile of the PPO step for a TPU topology (``ppojax.run.aot``)::

    python -m ppojax.aot --config configs/scale.py:qwen2_5_0_5b --topology v5e:2x4 \\
        [--config.section.field=value ...]

Prints the memory table and, last, one JSON line with every figure; ``python -m ppojax.aot``
runs this command too. An unknown topology, a missing libtpu or a bad config is one message and
exit code 2 (``ppojax.infra.cli``; ``PPOJAX_DEBUG=1`` or ``--debug``: the traceback).
"""

from __future__ import annotations

import os

# As ppojax.run.aot: JAX itself stays on the CPU; several processes may load libtpu at once.
# (run.aot's DEVICELESS_ENV, imported below before any back end starts, sets the rest.)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import json

from absl import flags
from ml_collections import config_flags

from ppojax.infra import cli
from ppojax.run import aot, build

PROG = "ppojax.aot"
_CONFIG = config_flags.DEFINE_config_file("config", None, "Training config file.")
_TOPOLOGY = flags.DEFINE_string("topology", "v5e:2x4",
                                "TPU topology, e.g. v5e:2x4, v4:2x2x2, v5p:2x2x1.")
_PREFIX = flags.DEFINE_integer(
    "prefix_len", None, "Tokens of the prompts' shared prefix (data.shared_prefix). Default: a "
    "training run's, where it can be known here (no prefix, the count task's BOS, or the chat "
    "template's header from a local tokenizer); a public model name has no tokenizer here.")
flags.mark_flag_as_required("config")
flags.adopt_module_key_flags(cli)


def main(argv):
  if len(argv) > 1:
    raise cli.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  if cli.COMPILE_CACHE.value is not None:
    raise cli.UsageError("--compile_cache has no effect here: ppojax.aot compiles for another "
                         "machine's TPUs and keeps nothing in a compilation cache; drop the flag")
  config = _CONFIG.value
  result = aot.compile_step(config, aot.topology_devices(_TOPOLOGY.value),
                            prefix_len=_PREFIX.value)
  r = aot.report(config, _TOPOLOGY.value, result)
  print(aot.format_report(r), flush=True)
  print(json.dumps(r), flush=True)


if __name__ == "__main__":
  # compiles for another machine's TPUs: nothing to keep in this machine's compilation cache
  cli.run(main, PROG, loaders=(build.build,), configs=(_CONFIG,), compile_cache=False)
