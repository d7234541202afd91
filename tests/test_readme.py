"""The README's research-code example runs as printed, and its commands stay in sync with CI."""

import pathlib
import re

ROOT = pathlib.Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()


def test_research_example_runs():
  code = re.search(r"## Using single functions.*?```python\n(.*?)```", README, re.S).group(1)
  namespace = {}
  exec(compile(code, "README.md", "exec"), namespace)  # pylint: disable=exec-used
  assert namespace["mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
  assert float(namespace["loss"]) != 0.0
  assert namespace["grad"].shape == (2, 5)


def test_ci_runs_the_readme_commands():
  ci = (ROOT / ".ci" / "run").read_text()
  for marker in ("ci:test-command", "ci:main-command"):
    assert f"<!-- {marker} -->" in README and marker in ci
  main = re.search(r"<!-- ci:main-command -->\n```bash\n(.*?)```", README, re.S).group(1)
  assert main.strip() == ("pip install -e . && python -m ppojax.train "
                          "--config configs/quickstart.py --workdir runs/quickstart")


def test_readme_stays_a_short_guide():
  assert len(README.splitlines()) <= 250


def test_models_and_sampling_examples_run(smollm2_path, tmp_path, monkeypatch):
  """The Models example, then the Sampling example continuing from it."""
  del smollm2_path  # fetched (or skipped) by the fixture
  monkeypatch.chdir(tmp_path)
  namespace = {}
  for section in ("Models", "Sampling"):
    code = re.search(rf"## {section}.*?```python\n(.*?)```", README, re.S).group(1)
    exec(compile(code, "README.md", "exec"), namespace)  # pylint: disable=exec-used
  assert namespace["logits"].shape[:2] == namespace["tokens"].shape
  assert (tmp_path / "exported" / "model.safetensors").exists()
  out = namespace["out"]
  assert out.tokens.shape == (1, 64) and 0 < int(out.lengths[0]) <= 64


def test_ppo_step_example_runs(monkeypatch):
  monkeypatch.chdir(ROOT)
  code = re.search(r"## The PPO step.*?```python\n(.*?)```", README, re.S).group(1)
  namespace = {}
  exec(compile(code, "README.md", "exec"), namespace)  # pylint: disable=exec-used
  assert int(namespace["state"].step) == 3 and "objective/kl" in namespace["metrics"]
