"""benchmarks/accelerator.py: ``--small`` runs every section on the CPU in child processes and
reports every figure as a positive finite number or as null with a reason; the decode roofline
is checked against hand-computed memory- and compute-bound limits."""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys
import types

import pytest
from benchmark_script import load

from ppojax.infra.flops import model_flops

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "accelerator.py"
PPO = ("s_per_step", "rollout_s", "scoring_s", "update_s", "generation_s", "rollout_passes_s",
       "tokens_per_s", "tokens_per_s_per_device", "device_peak_gb", "first_iteration_s",
       "model_tflop_per_step")
DECODE = ("seconds", "tokens_per_s", "roofline_s", "roofline_fraction",
          "roofline_fraction_full_cache")
MFU = ("learn_tflops", "fraction_of_measured_peak", "fraction_of_datasheet_peak")
# --small: decode batches 4 and 8, PPO responses 6 and 10
EXPECTED = (
    ["calibration/bf16_matmul_tflops", "calibration/copy_gb_s",
     "calibration/datasheet_bf16_tflops", "grpo/1.5b/six_n_fraction_of_peak", "compile/total_s"]
    + [f"decode/{m}/b{b}/{k}" for m in ("0.5b", "1.5b") for b in (4, 8) for k in DECODE]
    + [f"ppo/r{r}/{k}" for r in (6, 10) for k in PPO] + [f"grpo/1.5b/{k}" for k in PPO]
    + [f"mfu/{m}/{k}" for m in ("0.5b", "1.5b") for k in MFU])
# null on a CPU, each with its reason: no datasheet peak, no device memory statistics; the
# rollout's passes beside generation may drown in the timing noise of toy shapes
MAY_BE_NULL_ON_CPU = ("datasheet", "device_peak_gb", "rollout_passes_s")
TOP_LEVEL = {"command", "date", "small", "wall_s", "budget_s", "environment", "settings",
             "figures", "null_reasons", "errors", "units"}


def _script():
  return load("accelerator")


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("accelerator") / "results.md"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, str(SCRIPT), "--small", "--out", str(out)], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=840, check=False)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(proc.stdout.strip().splitlines()[-1]), out, proc


def test_small_run_reports_every_figure(small_run):
  report, _, _ = small_run
  assert TOP_LEVEL <= set(report), TOP_LEVEL - set(report)
  assert report["small"] is True and report["errors"] == {}, report["errors"]
  assert report["environment"]["platform"] == "cpu" and report["environment"]["jax"]
  figures, reasons = report["figures"], report["null_reasons"]
  assert not [n for n in EXPECTED if n not in figures]
  for name, value in figures.items():
    if value is None:
      assert reasons.get(name), f"{name} is null without a reason"
      assert any(k in name for k in MAY_BE_NULL_ON_CPU), f"{name}: {reasons[name]}"
    else:
      assert isinstance(value, float) and math.isfinite(value) and value > 0, (name, value)
  assert figures["calibration/datasheet_bf16_tflops"] is None  # no datasheet for a CPU
  for unit in ("calibration", "ppo_short", "ppo_long", "grpo", "decode"):
    assert report["units"][unit]["done"] is True, unit
    assert figures.get(f"compile/{unit}/total_s", 0) > 0 or report["units"][unit]["cache_hits"]


def test_small_run_writes_both_files(small_run):
  report, out, proc = small_run
  text = out.read_text()
  assert text.startswith("# Accelerator suite") and "| calibration/bf16_matmul_tflops |" in text
  assert text in proc.stdout
  assert json.loads(out.with_suffix(".json").read_text()) == report
  assert "+" in proc.stderr and "unit decode: done" in proc.stderr  # timestamped progress


def test_plan_runs_calibration_with_any_section():
  script = _script()
  assert script.plan("") == list(script.UNITS)
  assert script.plan("decode") == ["calibration", "decode"]
  assert script.plan("mfu") == ["calibration", "ppo_long", "grpo"]
  with pytest.raises(SystemExit, match="choose from"):
    script.plan("decoding")


def test_roofline_limits():
  """With an unbounded FLOP rate the roofline is the bytes over the bandwidth (weights and the
  cache read up to each position, or all of it); with an unbounded bandwidth it is the prefill
  and decode FLOPs of ``flops.model_flops`` over the peak."""
  script = _script()
  d = dict(model_type="qwen2", vocab_size=32, hidden_size=16, intermediate_size=24,
           num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4)
  raw = dict(dims=d, batch=3, prompt_len=5, new_tokens=4, weight_bytes=1000, kv_itemsize=2)
  kv = 3 * 2 * 2 * 2 * 4 * 2  # B·L·2·H_kv·D·bytes per cached position
  gb_s = 1e-6  # 1000 bytes per second
  memory = (1000 + kv * 5 + sum(1000 + kv * (5 + k + 1) for k in range(3))) / 1000
  assert script.decode_roofline(raw, 1e30, gb_s) == pytest.approx(memory)
  full = (1000 + kv * 5 + 3 * (1000 + kv * 8)) / 1000
  assert script.decode_roofline(raw, 1e30, gb_s, full_cache=True) == pytest.approx(full)
  parts = model_flops(types.SimpleNamespace(**d), 3, 5, 4)
  flops = parts["generation (prefill)"] + parts["generation (decode)"]
  assert script.decode_roofline(raw, 1e-12, 1e30) == pytest.approx(flops)  # 1 FLOP/s
