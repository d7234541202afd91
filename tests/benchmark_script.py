"""A script of benchmarks/ imported as a module by its file (the folder is no package), for the
tests that call its functions."""

from __future__ import annotations

import importlib.util
import pathlib

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str):
  """benchmarks/NAME.py, executed once per call as the module ``name``."""
  spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module
