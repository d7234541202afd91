"""The README's research-code example runs as printed, and its commands stay in sync with CI."""

import pathlib
import re
import subprocess

import numpy as np
import pytest
import real_model  # tests/real_model.py
import reference as ref  # tests/reference.py

ROOT = pathlib.Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()


def test_research_example_matches_the_numpy_reference():
  """Every number the example computes equals tests/reference.py's (float64 loops) on its
  inputs: the mask, the shaped rewards, GAE's whitened advantages and returns, the clipped loss,
  its clip fraction and its gradient."""
  code = re.search(r"## Using single functions.*?```python\n(.*?)```", README, re.S).group(1)
  ns = {}
  exec(compile(code, "README.md", "exec"), ns)  # pylint: disable=exec-used
  got = {k: np.asarray(ns[k], np.float64) for k in ("mask", "token_rewards", "adv", "returns",
                                                     "loss", "grad", "logp", "ref_logp",
                                                     "new_logp", "values", "scores", "tokens")}
  mask = ref.response_mask(got["tokens"], [2])
  assert mask.astype(int).tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
  np.testing.assert_array_equal(got["mask"], mask)
  rewards, _ = ref.shape_rewards(got["scores"], got["logp"], got["ref_logp"], mask, beta=0.05,
                                 kl_estimator="k3")
  adv, returns = ref.gae(rewards, got["values"], mask, gamma=1.0, lam=0.95, whiten=True)
  loss, metrics, grad = ref.policy_loss(got["new_logp"], got["logp"], adv, mask, clip_eps=0.2)
  for name, want in (("token_rewards", rewards), ("adv", adv), ("returns", returns),
                     ("loss", loss), ("grad", grad)):
    np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-6, err_msg=name)
  assert float(ns["metrics"]["clipfrac"]) == pytest.approx(metrics["clipfrac"], abs=1e-7)
  assert 0 < metrics["clipfrac"] < 1 and abs(loss) > 1e-3  # the example is not a trivial case


def _ci_readme_block(marker: str, cwd: pathlib.Path) -> str:
  """What .ci/run's own ``readme_block`` function (its awk program, read from .ci/run) extracts
  after ``marker`` from the README.md in ``cwd``."""
  ci = (ROOT / ".ci" / "run").read_text()
  function = re.search(r"^readme_block\(\) \{.*?^\}$", ci, re.S | re.M)
  assert function, ".ci/run defines no readme_block function"
  result = subprocess.run(["bash", "-euo", "pipefail", "-c",
                           f'{function.group(0)}\nreadme_block "$1"', "bash", marker],
                          cwd=cwd, capture_output=True, text=True, check=True, timeout=60)
  return result.stdout


def test_ci_runs_the_readme_commands():
  """.ci/run's extraction gives exactly the commands in the README's blocks after the markers;
  the main one is the quickstart, and the tests run with the real model required."""
  blocks = {}
  for marker in ("ci:main-command", "ci:test-command"):
    want = re.search(rf"<!-- {marker} -->\n```bash\n(.*?)```", README, re.S).group(1)
    blocks[marker] = _ci_readme_block(f"<!-- {marker} -->", ROOT)
    assert blocks[marker] == want and want.strip()
  assert blocks["ci:main-command"].strip() == (
      "pip install -e . && python -m ppojax.train --config configs/quickstart.py "
      "--workdir runs/quickstart")
  assert blocks["ci:test-command"].strip().startswith('pip install -e ".[test]" && ')
  ci = (ROOT / ".ci" / "run").read_text()
  assert f'{real_model.REQUIRE}=1 bash -euo pipefail -c "$tests"' in ci


def test_ci_extraction_takes_the_first_block_after_its_marker(tmp_path):
  """Prose between marker and block is skipped; the block ends at its closing fence; a marker
  that is missing gives nothing (which .ci/run refuses)."""
  (tmp_path / "README.md").write_text(
      "```bash\nbefore\n```\n<!-- ci:x -->\nsome prose\n\n```bash\nfirst line\n  second\n```"
      "\n```bash\nnext block\n```\n")
  assert _ci_readme_block("<!-- ci:x -->", tmp_path) == "first line\n  second\n"
  assert _ci_readme_block("<!-- ci:missing -->", tmp_path) == ""


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
