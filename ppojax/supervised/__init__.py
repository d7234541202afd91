"""The supervised stages: SFT, reward-model training and preference pairs, on what they
share (common)."""


def __getattr__(name: str):
  """A name of the 0.1 module ppojax.supervised, which is a package since 0.2: where it went."""
  raise AttributeError(f"module 'ppojax.supervised' has no attribute {name!r}: the 0.1 module "
                       "ppojax.supervised is ppojax.supervised.common "
                       "since ppojax 0.2 (docs/design.md)")
