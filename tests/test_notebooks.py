"""The notebooks: committed without outputs, equal to what notebooks/make_notebooks.py writes,
and run top to bottom (with nbclient, in a kernel of this interpreter) in their small setting,
``PPOJAX_NOTEBOOK_SMALL=1``, with the working directory notebooks/."""

import importlib.util
import pathlib
import re
import sys

import nbformat
import pytest
from conftest import runtime_env
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[1] / "notebooks"
NAMES = ("quickstart.ipynb", "research_api.ipynb")


def _generator():
  spec = importlib.util.spec_from_file_location("make_notebooks", NOTEBOOKS / "make_notebooks.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize("name", NAMES)
def test_committed_without_outputs(name):
  nb = nbformat.read(NOTEBOOKS / name, as_version=4)
  nbformat.validate(nb)
  for i, cell in enumerate(nb.cells):
    if cell.cell_type == "code":
      assert cell.outputs == [], f"{name} cell {i} has outputs: strip them"
      assert cell.execution_count is None, f"{name} cell {i} has an execution count"


@pytest.mark.parametrize("name", NAMES)
def test_equal_to_generator(name):
  text = _generator().render(name)
  assert (NOTEBOOKS / name).read_text(encoding="utf-8") == text, (
      f"notebooks/{name} differs from notebooks/make_notebooks.py: edit the generator and run "
      "python notebooks/make_notebooks.py")


def execute(name: str, tmp_path: pathlib.Path, monkeypatch, timeout: int, runtime: bool = False):
  """Runs the notebook in a fresh kernel of this very interpreter (a kernelspec written for
  ``sys.executable``, whatever ``python`` is on the PATH); fails with the failing cell's error.
  ``runtime``: the kernel compiles its programs for running them (conftest's ``runtime_env``)."""
  from ipykernel.kernelspec import write_kernel_spec  # pylint: disable=import-outside-toplevel

  kernels = tmp_path / "kernels"
  write_kernel_spec(str(kernels / "python3"))
  monkeypatch.setenv("PPOJAX_NOTEBOOK_SMALL", "1")
  if runtime:
    monkeypatch.setenv("XLA_FLAGS", runtime_env()["XLA_FLAGS"])
  km = KernelManager(kernel_name="python3",
                     kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernels)]))
  assert km.kernel_spec.argv[0] == sys.executable
  nb = nbformat.read(NOTEBOOKS / name, as_version=4)
  client = NotebookClient(nb, km=km, timeout=timeout,
                          resources={"metadata": {"path": str(NOTEBOOKS)}})
  error = None
  try:
    client.execute()
  except (CellExecutionError, CellTimeoutError) as e:
    error = re.sub(r"\x1b\[[0-9;]*m", "", str(e))  # the cell and its traceback, uncoloured
  except DeadKernelError as e:  # e.g. killed for memory: the SmolLM2 PPO step takes ~10 GB
    error = f"{e} (out of memory?)"
  finally:  # nbclient leaves a kernel it did not start running: its gigabytes with it
    if km.has_kernel:
      km.shutdown_kernel(now=True)
  if error is not None:
    pytest.fail(f"notebooks/{name} failed:\n{error}", pytrace=False)
  return nb


def _outputs(nb, output_type=None):
  return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
          if output_type is None or o.output_type == output_type]


def _images(nb) -> int:
  return sum("image/png" in o.get("data", {}) for o in _outputs(nb))


def test_research_api_runs(tmp_path, monkeypatch):
  nb = execute("research_api.ipynb", tmp_path, monkeypatch, timeout=300)
  assert _images(nb) >= 3  # the clipped loss, GAE and the KL estimators


def test_quickstart_runs(smollm2_path, tmp_path, monkeypatch):
  del smollm2_path  # skips where the model cannot be fetched
  # SmolLM2's PPO iteration runs longer than it compiles: optimised code (conftest)
  nb = execute("quickstart.ipynb", tmp_path, monkeypatch, timeout=600, runtime=True)
  text = "".join(o.get("text", "") for o in _outputs(nb, "stream"))
  assert "setting: small (CI)" in text
  assert "iteration   1" in text
  assert _images(nb) >= 1  # reward, KL and entropy
