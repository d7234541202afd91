"""Records on disk, prompts encoded through chat templates and padded, the batch of prompts the
step receives."""


def __getattr__(name: str):
  """A name of the 0.1 module ppojax.data, which is a package since 0.2: where it went."""
  raise AttributeError(f"module 'ppojax.data' has no attribute {name!r}: the 0.1 module "
                       "ppojax.data is ppojax.data.encoding (records: ppojax.data.records) "
                       "since ppojax 0.2 (docs/design.md)")
