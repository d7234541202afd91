"""The how-to pages' code runs as printed: their config files load from a folder of the user's
own, outside the clone (docs/how-to/dataset.md, "A config file of your own"; multiturn.md,
"Offer your own tool": they find the shipped configs through the installed package), and
reward.md's JAX rule traces and scores as it says."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import jax
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _python_blocks(page: str, section: str) -> list[str]:
  """The ```python blocks of one section (## heading) of a docs page."""
  text = (ROOT / "docs" / page).read_text()
  body = re.search(rf"^## {re.escape(section)}\n(.*?)(?=^## |\Z)", text, re.M | re.S).group(1)
  return re.findall(r"```python\n(.*?)```", body, re.S)


def _load(folder: pathlib.Path, config: str) -> dict:
  """The config file's fields, loaded in a child process whose working directory is folder."""
  code = ("import json; from ppojax.run import build; "
          f"print(json.dumps(build.load_config({config!r}).to_dict(), default=str))")
  proc = subprocess.run([sys.executable, "-c", code], cwd=folder, capture_output=True,
                        text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_dataset_pages_config_file_loads_outside_the_clone(tmp_path):
  (block,) = _python_blocks("how-to/dataset.md", "A config file of your own")
  (tmp_path / "configs").mkdir()
  (tmp_path / "configs" / "my_task.py").write_text(block)
  c = _load(tmp_path, "configs/my_task.py")
  assert (c["data"]["task"], c["data"]["path"], c["reward"]["fn"]) == (
      "file", "prompts.jsonl", "my_rewards:reward")
  assert c["eval"]["metrics"] == {"score": "my_rewards:reward"}
  assert c["model"]["policy"] == "smollm2"  # the rest is the quickstart's


def test_the_tool_pages_config_file_loads_outside_the_clone(tmp_path):
  tool, config = _python_blocks("how-to/multiturn.md", "Offer your own tool")
  (tmp_path / "my_tools.py").write_text(tool)
  (tmp_path / "configs").mkdir()
  (tmp_path / "configs" / "my_tools_task.py").write_text(config)
  c = _load(tmp_path, "configs/my_tools_task.py")
  assert c["env"]["tools"] == "my_tools:multiply" and c["model"]["policy"] == "smollm2"
  assert "multiply(a: integer, b: integer): Multiply two whole numbers." in c["data"]["system"]


def test_the_reward_pages_jax_rule_traces_and_scores_as_its_docstring_says():
  (block,) = _python_blocks("how-to/reward.md", "A reward in JAX, inside the compiled step")
  namespace = {}
  exec(compile(block, "docs/how-to/reward.md", "exec"), namespace)  # pylint: disable=exec-used
  lengths = np.array([1, 3, 8])
  mask = (np.arange(8)[None] < lengths[:, None]).astype(np.int32)
  prompts = np.ones((3, 4), np.int32)
  scores = jax.jit(namespace["brevity"])(prompts, np.ones_like(prompts), mask * 5, mask)
  np.testing.assert_allclose(scores, [1.0, 1 - 2 / 7, 0.0], rtol=1e-6)
