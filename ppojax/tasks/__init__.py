"""Tasks with verifiable rewards (count, arith, reasoning-gym) and where a run's prompts come
from (sources)."""


def __getattr__(name: str):
  """A name of the 0.1 module ppojax.tasks, which is a package since 0.2: where it went."""
  raise AttributeError(f"module 'ppojax.tasks' has no attribute {name!r}: the 0.1 module "
                       "ppojax.tasks is ppojax.tasks.count since ppojax 0.2 (docs/design.md)")
