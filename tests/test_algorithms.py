"""The critic-free algorithms in the one step: group sampling, no critic, no reference without a
KL penalty, the algorithm's defaults, and every algorithm through the run loop (checkpoint,
resume, export). Their math against the float64 reference: tests/test_iteration_reference.py.
"""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppojax.core import advantages, algorithms, kl
from ppojax.learner import step as step_lib
from ppojax.learner import loss as loss_lib
from ppojax.models import CausalLM, init_params
from ppojax.models import passes as passes_lib
from ppojax.rollout import rollout as rollout_lib
from ppojax.rollout.sampling import SamplingConfig, generate
from ppojax.run import build as build_lib
from ppojax.run import checks as checks_lib
from ppojax.run import models as run_models
from ppojax.run import runner

_TOY = pathlib.Path(__file__).parents[1] / "configs" / "toy.py"


def toy(algorithm: str = "ppo", **changes):
  """configs/toy.py with ``algorithm``: 4 prompts × 4 samples, 2 × 2 minibatches."""
  overrides = {"algorithm": algorithm, "rl__batch_size": 4,
               "sampling__num_samples_per_prompt": 4, "num_iterations": 2, "sample_every": 0,
               **changes}
  return build_lib.load_config(_TOY, **overrides)


def test_group_sampling_decodes_each_prompt_n_times_from_one_prefill():
  """n samples per prompt are the rows i·n … i·n + n − 1, exactly what sampling each prompt
  repeated n times gives (same key): the prefill ran once per prompt, its cache repeated."""
  cfg = run_models.tiny_model_config(toy().model.tiny)
  module = CausalLM(cfg)
  params = init_params(module, jax.random.key(0))
  tokens = jnp.array([[1, 2, 3, 4], [0, 5, 6, 7], [0, 0, 8, 9]])
  mask = tokens > 0
  base = SamplingConfig(max_new_tokens=6, stop_ids=(15,), pad_id=15, temperature=1.0)
  grouped = generate(module, params, tokens, mask, jax.random.key(1),
                     SamplingConfig(**{**base.__dict__, "num_samples_per_prompt": 3}))
  repeated = generate(module, params, jnp.repeat(tokens, 3, 0), jnp.repeat(mask, 3, 0),
                      jax.random.key(1), base)
  np.testing.assert_array_equal(grouped.tokens, repeated.tokens)
  np.testing.assert_allclose(grouped.logprobs, repeated.logprobs, atol=1e-6)
  assert grouped.tokens.shape == (9, 6)
  assert len({tuple(row) for row in np.asarray(grouped.tokens)[:3]}) > 1  # samples differ
  # the prefill runs over the 3 prompts, not the 9 rows: fewer FLOPs in the compiled program
  # (with 1 new token: the prefill, plus a decode body of 9 rows counted once)
  def flops(tok, m, n):
    one = SamplingConfig(**{**base.__dict__, "max_new_tokens": 1, "num_samples_per_prompt": n})
    compiled = jax.jit(generate, static_argnames=("module", "config")).lower(
        module, params, tok, m, jax.random.key(1), one).compile()
    return compiled.cost_analysis()["flops"]
  assert flops(tokens, mask, 3) < 0.6 * flops(jnp.repeat(tokens, 3, 0), jnp.repeat(mask, 3, 0), 1)


def test_algorithm_defaults_fill_only_what_is_unset():
  grpo = algorithms.resolve(toy("grpo"))
  assert (grpo.rl.estimator, grpo.rl.kl_in, grpo.rl.aggregation, grpo.rl.kl_estimator) == (
      "grpo", "loss", "seq_mean_token_mean", "k3")
  mine = algorithms.resolve(toy("grpo", rl__aggregation="token_mean", rl__kl_in="reward"))
  assert (mine.rl.aggregation, mine.rl.kl_in, mine.rl.estimator) == (
      "token_mean", "reward", "grpo")
  assert algorithms.resolve(grpo).to_dict() == grpo.to_dict()  # idempotent
  assert toy("grpo").rl.estimator == ""  # the input is not changed
  with pytest.raises(ValueError, match="unknown algorithm 'gpro'"):
    algorithms.defaults("gpro")


def test_the_algorithm_is_a_record_of_functions_built_once():
  """``from_config``: the estimator and KL functions themselves and the flags the step reads;
  a field set in the config overrides the algorithm's; a bad choice names itself."""
  grpo = algorithms.from_config(toy("grpo"))
  assert grpo.estimate is advantages.ESTIMATORS["grpo"].fn and grpo.kl is kl.kl_k3
  assert grpo.kl_in_loss and grpo.needs_groups and not grpo.needs_critic
  assert grpo.aggregation == "seq_mean_token_mean"
  ppo = algorithms.from_config(toy("ppo"))
  assert ppo.estimate is advantages.ESTIMATORS["gae"].fn and ppo.kl is kl.kl_k1
  assert ppo.needs_critic and not ppo.kl_in_loss and not ppo.needs_groups
  mine = algorithms.from_config(toy("grpo", rl__kl_in="reward", rl__kl_estimator="k2"))
  assert not mine.kl_in_loss and mine.kl is kl.kl_k2
  with pytest.raises(ValueError, match="unknown KL estimator 'k9'"):
    algorithms.make("gae", "reward", "token_mean", "k9")
  with pytest.raises(ValueError, match="kl_in='both'"):
    algorithms.make("gae", "both", "token_mean", "k1")


def test_config_errors_name_the_fix():
  with pytest.raises(checks_lib.ConfigError, match="num_samples_per_prompt=1"):
    build_lib.validate(toy("grpo", sampling__num_samples_per_prompt=1))
  with pytest.raises(checks_lib.ConfigError, match="algorithm='gpro' is not one of"):
    build_lib.validate(toy("gpro"))
  with pytest.raises(checks_lib.ConfigError, match="4 × 3 = 12 is not divisible"):
    build_lib.validate(toy("grpo", sampling__num_samples_per_prompt=3, rl__num_minibatches=8))
  build_lib.validate(toy("reinforce_pp", sampling__num_samples_per_prompt=1))  # no groups needed
  with pytest.raises(ValueError, match="estimator needs a critic"):
    run = build_lib.build(toy("ppo"))
    step_lib.make_step(dataclasses.replace(run.models, critic=None), run.algorithm, None, None,
                       None, run.sampling, run.config.rl)


def _forbid(monkeypatch, module, name):
  def called(*args, **kwargs):
    raise AssertionError(f"{name} ran")
  monkeypatch.setattr(module, name, called)


@pytest.mark.parametrize("algorithm", ["grpo", "reinforce_pp"])
@pytest.mark.parametrize("split", ["single_pass", "two_pass"])
def test_critic_free_step_holds_and_runs_no_critic(monkeypatch, algorithm, split):
  """No critic parameters or optimizer state, no value forward pass (the value functions are
  booby-trapped while the step traces), still one compiled function; trl's GRPO metric
  names."""
  for module in (rollout_lib, loss_lib):
    _forbid(monkeypatch, module, "response_values")
  changes = {} if split == "two_pass" else {"rl__num_epochs": 1, "rl__num_minibatches": 1}
  run = build_lib.build(toy(algorithm, **changes))
  assert run.models.critic is None
  assert run.state.critic is None and run.state.critic_opt is None
  assert run.step.fused is not None  # a JAX reward: one compiled function
  state, metrics, _, _ = runner.iteration(run, run.state, run.source.batch(0).prompts)
  assert state.critic is None and int(state.step) == 1
  for name in ("reward", "reward_std", "frac_reward_zero_std", "kl", "completion_length",
               "clip_ratio", "policy/grad_norm_avg", "loss/policy_avg"):
    assert name in metrics and np.isfinite(metrics[name]), name
  assert not any(k.startswith(("val/values", "loss/value", "val/grad_norm")) for k in metrics)
  assert metrics["reward"] == pytest.approx(metrics["objective/scores"])
  ppo_bytes = _param_bytes(build_lib.build(toy("ppo", **changes)).state)
  assert _param_bytes(state) < 0.55 * ppo_bytes  # actor + its Adam only: about half


def _param_bytes(state) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state) if hasattr(x, "size"))


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_no_reference_is_held_or_run_without_a_kl_penalty(monkeypatch, algorithm):
  run = build_lib.build(toy(algorithm, rl__kl_coef=0.0))
  assert run.frozen.reference is None
  calls = []
  real = passes_lib.response_logprobs
  monkeypatch.setattr(rollout_lib, "response_logprobs",
                      lambda module, params, *a, **k: calls.append(params) or real(
                          module, params, *a, **k))
  _, metrics, r, _ = runner.iteration(run, run.state, run.source.batch(0).prompts,
                                      phase_timing=True)
  assert r.ref_logp is None and metrics["objective/kl"] == 0.0 and metrics["kl"] == 0.0
  assert all(p is not None for p in calls)  # the reference (None) never scored anything
  with_ref = build_lib.build(toy(algorithm, rl__kl_coef=0.0, rl__adaptive_kl=True))
  assert with_ref.frozen.reference is not None  # an adaptive β may grow from 0


def _final(workdir):
  from ppojax.run import checkpoint  # pylint: disable=import-outside-toplevel
  ckpt = checkpoint.Checkpointer(workdir / "checkpoints", 1, 2)
  try:
    return ckpt.latest_step(), json_lines(workdir / "metrics.jsonl")
  finally:
    ckpt.close()


def json_lines(path):
  import json  # pylint: disable=import-outside-toplevel
  return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("algorithm", ["grpo", "reinforce_pp"])
def test_critic_free_runs_checkpoint_resume_and_export(tmp_path, algorithm):
  """Two iterations, interrupted after the first and resumed, equal two uninterrupted ones
  (metrics and the exported policy): a critic-free state (None critic and optimizer state)
  through orbax; GRPO with a Python (host) reward, REINFORCE++ with a JAX one. (PPO:
  tests/test_resume.py.)"""
  changes = {"reward__kind": "python", "reward__fn": "ppojax.tasks.count:count_reward_numpy"} if (
      algorithm == "grpo") else {}
  config = toy(algorithm, save_every=1, **changes)
  whole, split = tmp_path / "whole", tmp_path / "split"
  runner.run(config, str(whole))
  runner.run(config, str(split), stop_after=1)
  assert _final(split)[0] == 1
  runner.run(config, str(split))
  (step_a, rows_a), (step_b, rows_b) = _final(whole), _final(split)
  assert step_a == step_b == 2
  volatile = ("time/", "eps", "memory/", "compile/")
  drop = lambda rows: [{k: v for k, v in r.items() if not k.startswith(volatile)}  # noqa
                       for r in rows]
  assert drop(rows_a) == drop(rows_b)
  files = sorted(p.name for p in (whole / "policy").iterdir())
  assert "config.json" in files and any(f.endswith(".safetensors") for f in files)
  from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel
  for f in (n for n in files if n.endswith(".safetensors")):
    a, b = load_file(whole / "policy" / f), load_file(split / "policy" / f)
    for k in a:
      np.testing.assert_array_equal(a[k], b[k], err_msg=k)
