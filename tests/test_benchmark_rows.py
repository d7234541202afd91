"""The peer benchmarks' pure helpers (benchmarks/): which ppojax rows a run times
(``ppo_step.plan_rows``), the ratio keys of each pair (``ppo_step.comparisons``), the response
length check every side runs (``peer_env.check_lengths``), the FLOPs of LoRA with a full
critic (``ppo_step.iteration_flops``) and the trace summary's op kinds (``step_trace``)."""

from __future__ import annotations

import pathlib
import sys
import types

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "peers"))
# pylint: disable=wrong-import-position
import peer_env  # noqa: E402
import ppo_step  # noqa: E402
import step_trace  # noqa: E402

DEFAULT = {"shared_prefix": True, "reuse_update_forward": True, "old_logprobs": "recompute"}
TRL = {"shared_prefix": False, "reuse_update_forward": False, "old_logprobs": "sampler"}
TUNIX = {"shared_prefix": False, "reuse_update_forward": False, "old_logprobs": "recompute"}


def flags(row):
  return {k: row[k] for k in ("shared_prefix", "reuse_update_forward", "old_logprobs")}


def test_check_lengths_passes_exact_lengths():
  """Every response of the requested length: no error."""
  peer_env.check_lengths([4, 4, 4], 4, "side")


def test_check_lengths_names_expected_and_found():
  """A shorter response raises, naming who, the expected length and each length found with
  its count; an empty list raises too."""
  with pytest.raises(RuntimeError) as err:
    peer_env.check_lengths([32, 31, 32, 30], 32, "trl's responses")
  message = str(err.value)
  assert message.startswith("trl's responses: 2 of 4 responses are not 32 tokens long")
  assert "found 30 tokens × 1, 31 tokens × 1, 32 tokens × 2" in message
  with pytest.raises(RuntimeError, match="no responses"):
    peer_env.check_lengths([], 32, "side")


def test_plan_rows_equal_work_row_per_peer_passes():
  """With trl and tunix and the defaults, three rows: the default (compared with both), trl's
  passes (every row whole, rollout forwards, log π_old from the sampler) and tunix's (the
  same with a policy forward for log π_old)."""
  rows = ppo_step.plan_rows([None], DEFAULT, ["trl", "tunix"], equal_work=True)
  assert [(r["work"], flags(r), r["vs"], r["equal_work_for"]) for r in rows] == [
      ("default", DEFAULT, ["trl", "tunix"], []),
      ("equal_work", TRL, ["trl"], ["trl"]),
      ("equal_work", TUNIX, ["tunix"], ["tunix"]),
  ]


def test_plan_rows_without_equal_work_or_peers():
  """--no-equal-work, or no peer: the default row only."""
  assert len(ppo_step.plan_rows([None], DEFAULT, ["trl"], equal_work=False)) == 1
  assert len(ppo_step.plan_rows([None], DEFAULT, [], equal_work=True)) == 1


def test_plan_rows_default_that_is_equal_work_is_not_run_twice():
  """Default flags that already are tunix's passes: one row, marked as tunix's equal work."""
  rows = ppo_step.plan_rows([None], TUNIX, ["tunix"], equal_work=True)
  assert len(rows) == 1 and rows[0]["equal_work_for"] == ["tunix"]


def test_plan_rows_shared_equal_row_and_critics():
  """Two peers with the same passes share one equal-work row; each critic gets its rows."""
  same = {"trl": {"shared_prefix": False}, "tunix": {"shared_prefix": False}}
  rows = ppo_step.plan_rows(["lora", "full"], DEFAULT, ["trl", "tunix"], True, same,
                            ("shared_prefix",))
  assert [(r["critic"], r["work"], r["shared_prefix"], r["vs"]) for r in rows] == [
      ("lora", "default", True, ["trl", "tunix"]),
      ("lora", "equal_work", False, ["trl", "tunix"]),
      ("full", "default", True, ["trl", "tunix"]),
      ("full", "equal_work", False, ["trl", "tunix"]),
  ]


def test_comparisons_keys_per_pair():
  """Each row against its critic's peer figure: ratio = peer s / row s, memory = row peak /
  peer peak, keyed by critic and work."""
  rows = ppo_step.plan_rows(["lora", "full"], DEFAULT, ["trl"], equal_work=True)
  measured = {("lora", "default"): (10.0, 3000.0), ("lora", "equal_work"): (12.5, 3500.0),
              ("full", "default"): (11.0, 5000.0), ("full", "equal_work"): (16.0, 5500.0)}
  for row in rows:
    row["seconds_per_iteration"], row["peak_rss_mb"] = measured[row["critic"], row["work"]]
  peers = {"trl": {"lora": {"seconds_per_iteration": 25.0, "peak_rss_mb": 6000.0},
                   "full": {"seconds_per_iteration": 32.0, "peak_rss_mb": 10000.0}}}
  assert ppo_step.comparisons(rows, peers) == {
      "ratio_vs_trl_lora_critic_default": 2.5, "memory_vs_trl_lora_critic_default": 0.5,
      "ratio_vs_trl_lora_critic_equal_work": 2.0,
      "memory_vs_trl_lora_critic_equal_work": 3500 / 6000,
      "ratio_vs_trl_full_critic_default": 32 / 11, "memory_vs_trl_full_critic_default": 0.5,
      "ratio_vs_trl_full_critic_equal_work": 2.0, "memory_vs_trl_full_critic_equal_work": 0.55,
  }


def test_comparisons_default_row_doing_the_peers_work():
  """A default row that runs the peer's passes also gives the equal_work keys; a peer without
  a peak gives None for memory."""
  rows = ppo_step.plan_rows([None], TUNIX, ["tunix"], equal_work=True)
  rows[0].update(seconds_per_iteration=4.0, peak_rss_mb=100.0)
  out = ppo_step.comparisons(rows, {"tunix": {None: {"seconds_per_iteration": 10.0}}})
  assert out == {"ratio_vs_tunix_default": 2.5, "memory_vs_tunix_default": None,
                 "ratio_vs_tunix_equal_work": 2.5, "memory_vs_tunix_equal_work": None}


def test_iteration_flops_full_critic_keeps_weight_gradients():
  """LoRA policy with a full critic: the policy's update is 2× its forward (activation
  gradients only), the critic's 3× (weight gradients too), every other part unchanged."""
  cfg = types.SimpleNamespace(model_type="llama", vocab_size=64, hidden_size=16,
                              intermediate_size=32, num_layers=2, num_heads=2,
                              num_kv_heads=1, head_dim=8)
  kw = {"old_logp_fwd": False, "critic_fwd": False}
  lora = ppo_step.iteration_flops(cfg, 2, 5, 3, lora=True, lora_critic=True, **kw)
  mixed = ppo_step.iteration_flops(cfg, 2, 5, 3, lora=True, lora_critic=False, **kw)
  value_fwd = mixed["reward model (fwd)"]  # the same model shape as the critic's forward
  assert lora["critic fwd+bwd"] == 2 * value_fwd and mixed["critic fwd+bwd"] == 3 * value_fwd
  assert {k: v for k, v in mixed.items() if k != "critic fwd+bwd"} == {
      k: v for k, v in lora.items() if k != "critic fwd+bwd"}


def test_the_trace_summary_sorts_a_compiled_programs_ops_by_kind():
  """``step_trace.hlo_ops`` on a real compiled program: its dot (or the fusion holding it) is a
  matmul, the while loop a container (None: its body's ops count instead), its slice a slice;
  ``summarize`` adds up a trace's events by those kinds and skips names it does not know."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  def f(a, b):
    c = jax.lax.fori_loop(0, 3, lambda i, x: jnp.tanh(x @ b), a)
    return jax.lax.dynamic_slice(c, (1, 0), (2, 4)) * 2.0

  x = jnp.ones((4, 4))
  kinds = step_trace.hlo_ops(jax.jit(f).lower(x, x).compile().as_text())
  names = {kind: [n for n, k in kinds.items() if k == kind] for kind in set(kinds.values())}
  assert names.get("matmul") and names.get(None), kinds  # the dot and the while loop
  assert any(n.startswith("dynamic_slice") for n in names["dynamic-slice / slice"]), kinds
  assert any(n.startswith("tanh") for n in names["elementwise / reduce"]), kinds
  while_op = next(n for n in names[None] if n.startswith("while"))
  matmul = names["matmul"][0]
  events = [{"name": matmul, "dur": 2e6}, {"name": matmul, "dur": 1e6},
            {"name": while_op, "dur": 9e6}, {"name": "not-an-op", "dur": 5e6}]
  per_kind, top = step_trace.summarize(events, kinds)
  assert per_kind == {"matmul": 3.0} and top == [(matmul, 3.0)]
  assert step_trace.category("fusion", {"parameter", "transpose", "bitcast"}) == "copy / transpose"
  assert step_trace.category("fusion", {"parameter", "dynamic-update-slice"}) == (
      "dynamic-update-slice")
