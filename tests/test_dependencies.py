"""Every third-party module ppojax imports is a declared dependency of the package.

The test extra installs more than ppojax needs (torch, datasets' friends, jinja2 through torch),
so a missing runtime dependency would pass every other test; this one reads the imports off
the source. Packages that a library imports for us lazily (jinja2 for transformers' chat
templates) are caught by `.ci/run`'s run of the README's main command in a bare environment.
"""

from __future__ import annotations

import ast
import importlib.metadata
import pathlib
import re
import sys

import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Imported only behind an option, with an error naming the extra that installs it:
# module -> (the extra, the requirement in it that brings the module)
OPTIONAL = {"wandb": ("wandb", "wandb"), "torch": ("torch", "torch"), "libtpu": ("tpu", "jax"),
            "gymnax": ("classic", "gymnax"), "reasoning_gym": ("reasoning", "reasoning-gym")}


def _imported_modules() -> dict[str, list[str]]:
  """Top-level module -> where ppojax imports it (absolute imports, also inside functions)."""
  found: dict[str, list[str]] = {}
  for path in sorted((ROOT / "ppojax").rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        names = [node.module]
      else:
        continue
      for name in names:
        found.setdefault(name.split(".")[0], []).append(
            f"{path.relative_to(ROOT)}:{node.lineno}")
  return found


def _requirement_names(requirements: list[str]) -> set[str]:
  return {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower().replace("_", "-")
          for r in requirements}


def test_every_imported_package_is_declared():
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  core = _requirement_names(project["dependencies"])
  extras = {k: _requirement_names(v) for k, v in project["optional-dependencies"].items()}
  dists = importlib.metadata.packages_distributions()
  problems = []
  for module, where in _imported_modules().items():
    if module in sys.stdlib_module_names or module == "ppojax":
      continue
    names = {d.lower().replace("_", "-") for d in dists.get(module, [module])}
    if module in OPTIONAL:
      extra, requirement = OPTIONAL[module]
      if requirement not in extras.get(extra, set()):
        problems.append(f"{module} ({where[0]}): not in the extra {extra!r}")
    elif not names & core:
      problems.append(f"{module} ({', '.join(where[:3])}): distribution {sorted(names)} is not "
                      "in [project] dependencies")
  assert not problems, "undeclared runtime imports:\n" + "\n".join(problems)


def test_runtime_needs_of_our_dependencies_are_declared():
  """What transformers imports lazily on paths ppojax takes: jinja2 for apply_chat_template."""
  core = _requirement_names(tomllib.loads(
      (ROOT / "pyproject.toml").read_text())["project"]["dependencies"])
  assert "jinja2" in core


def test_nothing_at_run_time_needs_the_test_extra():
  """The test extra only adds test tools and torch (for parity tests); no ppojax module
  imports a test tool."""
  test_only = {"pytest", "hypothesis", "nbclient", "nbformat", "ipykernel", "xdist"}
  used = set(_imported_modules())
  assert not used & test_only, used & test_only


def test_the_installed_version_is_the_package_version():
  """pyproject's version is ``ppojax.__version__`` (``[tool.setuptools.dynamic]``), so the
  installed distribution and the imported package can never name two versions."""
  import ppojax  # pylint: disable=import-outside-toplevel

  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  assert "version" not in project and "version" in project["dynamic"]
  assert importlib.metadata.version("ppojax") == ppojax.__version__
