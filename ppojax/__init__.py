"""ppojax: PPO for language models as pure, jit-compiled JAX functions.

Research code imports single pieces of the math (``ppojax.core``) from here::

    from ppojax import advantages, kl, logprobs, losses, ops, rewards

The package is layered (docs/design.md): infra, core, models, data, tasks, rollout, learner,
run, supervised, classic; the command lines are ``ppojax.train``, ``ppojax.sft``,
``ppojax.train_rm``, ``ppojax.preferences`` and ``ppojax.aot``.

Importing ppojax with ``JAX_PLATFORMS`` unset on a machine without a TPU sets it to the GPUs
here and the CPU (``ppojax.infra.compile.choose_platforms``), so that an installed libtpu does
not probe for a TPU and print its errors (docs/performance/compiling.md).
"""

import importlib.abc
import sys

from ppojax.infra import compile as _compile

_compile.choose_platforms()  # before JAX starts a back end

from ppojax.core import advantages, kl, logprobs, losses, ops, rewards

__version__ = "0.2.0"

__all__ = ["advantages", "kl", "logprobs", "losses", "ops", "rewards", "__version__"]

# Modules of the flat 0.1 layout and where their code lives now.
MOVED = {
    **{f"ppojax.{m}": f"ppojax.core.{m} (or: from ppojax import {m})"
       for m in ("ops", "kl", "rewards", "advantages", "losses")},
    "ppojax.algorithms": "ppojax.core.algorithms", "ppojax.optim": "ppojax.core.optim",
    "ppojax.files": "ppojax.infra.files", "ppojax.hostmem": "ppojax.infra.hostmem",
    "ppojax.sharding": "ppojax.infra.sharding", "ppojax.flops": "ppojax.infra.flops",
    "ppojax.signals": "ppojax.infra.signals", "ppojax.lora": "ppojax.models.lora",
    "ppojax.records": "ppojax.data.records", "ppojax.arith": "ppojax.tasks.arith",
    "ppojax.reasoning": "ppojax.tasks.reasoning", "ppojax.sources": "ppojax.tasks.sources",
    "ppojax.sampling": "ppojax.rollout.sampling", "ppojax.state": "ppojax.learner.state",
    "ppojax.update": "ppojax.learner.update", "ppojax.step": "ppojax.learner.step",
    "ppojax.experience": ("ppojax.learner.experience (advantages and rewards), "
                          "ppojax.rollout.rollout (the rollout), ppojax.models.passes (forward "
                          "passes) and ppojax.data.batch (Prompts)"),
    "ppojax.config": "ppojax.run.config", "ppojax.config_checks": "ppojax.run.checks",
    "ppojax.build": "ppojax.run.build", "ppojax.runner": "ppojax.run.runner",
    "ppojax.evaluation": "ppojax.run.evaluation", "ppojax.baselines": "ppojax.run.baselines",
    "ppojax.checkpoint": "ppojax.run.checkpoint", "ppojax.resume": "ppojax.run.resume",
    "ppojax.reporting": "ppojax.run.reporting",
}
# Also moved, but their old names are packages now, whose __getattr__ names the new home:
# ppojax.data (-> ppojax.data.encoding), ppojax.tasks (-> ppojax.tasks.count) and
# ppojax.supervised (-> ppojax.supervised.common).


class _MovedModules(importlib.abc.MetaPathFinder):
  """Importing a module of the 0.1 layout fails with its new path, not a bare 'No module'."""

  def find_spec(self, fullname, path=None, target=None):
    if fullname in MOVED:
      raise ModuleNotFoundError(
          f"{fullname} moved in ppojax 0.2 to {MOVED[fullname]}: import it from there "
          "(docs/design.md shows the layout)", name=fullname)
    return None


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
  sys.meta_path.insert(0, _MovedModules())
