"""The package's layout holds (docs/design.md): each layer imports only from the layers below it,
no module is over 350 lines and no function over 60, and the algorithm's name is read in one
place only (``core/algorithms.py``, which builds the record the step calls)."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).parents[1] / "ppojax"
# bottom to top; a module may import its own layer and every layer before it
LAYERS = ("infra", "core", "models", "data", "tasks", "rollout", "envs", "learner", "run",
          "supervised", "classic", "")  # "": the top-level command lines and the package's face
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 350, 60
LONG_ALLOWED = {("run/config.py", "defaults")}  # every option with its comment, by design


def _modules():
  return sorted(p for p in PACKAGE.rglob("*.py"))


def _layer(path: pathlib.Path) -> str:
  rel = path.relative_to(PACKAGE)
  return rel.parts[0] if len(rel.parts) > 1 else ""


def _imported_layers(path: pathlib.Path):
  for node in ast.walk(ast.parse(path.read_text())):
    names = []
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    elif isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    for name in names:
      parts = name.split(".")
      if parts[0] == "ppojax" and len(parts) > 1 and parts[1] in LAYERS:
        yield node.lineno, parts[1]
      elif parts[0] == "ppojax" and len(parts) > 1:  # ppojax.train etc.: the top level
        yield node.lineno, ""


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_a_layer_imports_only_from_below(path):
  mine = LAYERS.index(_layer(path))
  for line, layer in _imported_layers(path):
    assert LAYERS.index(layer) <= mine, (
        f"{path.relative_to(PACKAGE)}:{line} imports ppojax.{layer or '<top level>'}, a layer "
        f"above {_layer(path) or 'the top level'}")


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_modules_and_functions_are_short(path):
  rel = str(path.relative_to(PACKAGE))
  source = path.read_text()
  assert source.count("\n") <= MAX_MODULE_LINES, f"{rel}: {source.count(chr(10))} lines"
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      lines = node.end_lineno - node.lineno + 1
      assert lines <= MAX_FUNCTION_LINES or (rel, node.name) in LONG_ALLOWED, (
          f"{rel}: {node.name} is {lines} lines")


def test_the_algorithm_is_named_in_one_place():
  """No module but core/algorithms.py looks an algorithm or estimator up by name or compares
  one: the rest reads the ``Algorithm`` record."""
  lookups = re.compile(r"ALGORITHMS\[|(?<!KL_)ESTIMATORS\[|\.estimator\(|\.estimator\s*[=!]=|"
                       r"kl_in\s*[=!]=|\balgorithm\s*[=!]=\s*[\"']|\.algorithm\s*[=!]=")
  allowed = {"core/algorithms.py", "core/advantages.py"}  # the record's builder, the table
  found = [f"{p.relative_to(PACKAGE)}:{i}: {line.strip()}"
           for p in _modules() if str(p.relative_to(PACKAGE)) not in allowed
           for i, line in enumerate(p.read_text().splitlines(), 1) if lookups.search(line)]
  assert not found, found


@pytest.mark.parametrize("old,new", [("ppojax.arith", "ppojax.tasks.arith"),
                                     ("ppojax.config", "ppojax.run.config"),
                                     ("ppojax.losses", "ppojax.core.losses"),
                                     ("ppojax.experience", "ppojax.rollout.rollout")])
def test_a_module_of_the_flat_layout_names_its_new_home(old, new):
  import importlib  # pylint: disable=import-outside-toplevel
  with pytest.raises(ModuleNotFoundError, match=re.escape(new)):
    importlib.import_module(old)


def test_an_old_function_path_in_a_config_names_its_new_home():
  from ppojax import losses  # the research face keeps its 0.1 spelling
  from ppojax.run import build  # pylint: disable=import-outside-toplevel
  assert losses.__name__ == "ppojax.core.losses"
  assert build._import("ppojax.tasks.arith:reward").__module__ == "ppojax.tasks.arith"  # pylint: disable=protected-access
  with pytest.raises(ModuleNotFoundError, match=r"ppojax\.arith moved .* to ppojax\.tasks\.arith"):
    build._import("ppojax.arith:reward")  # pylint: disable=protected-access
  with pytest.raises(ValueError, match=r"ppojax\.tasks is ppojax\.tasks\.count since"):
    build._import("ppojax.tasks:count_reward")  # pylint: disable=protected-access


def test_config_options_keep_one_or_two_comment_lines():
  """Each option of the config's defaults carries at most two comment lines; narrative lives
  in docs/."""
  lines = (PACKAGE / "run" / "config.py").read_text().splitlines()
  runs, run = [], 0
  for number, line in enumerate(lines, 1):
    if line.strip().startswith("#"):
      run += 1
      continue
    if run > 2:
      runs.append(f"config.py:{number - run}: {run} comment lines")
    run = 0
  assert not runs, runs
