"""The compiled PPO step on a tiny transformer: the fused step equals its three phases, a Python
reward equals the same rule in jnp, gradient accumulation is exact, padding is inert, the critic
can come from a reward model, and one step on an 8-device mesh equals the single-device step."""

import pathlib
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppojax.data import batch as batch_lib
from ppojax.infra import sharding
from ppojax.learner import experience
from ppojax.models import ValueModel, positions_from_mask, stack_layers, unstack_layers
from ppojax.models import passes as passes_lib
from ppojax.rollout import rollout as rollout_lib
from ppojax.run import build as build_lib
from ppojax.run import models as run_models
from ppojax.run import runner
from ppojax.tasks import count

_CONFIGS = pathlib.Path(__file__).parents[1] / "configs"


def toy_config(**changes):
  """configs/toy.py at batch 16, with "section.field" overrides."""
  overrides = {"rl__batch_size": 16, **{k.replace(".", "__"): v for k, v in changes.items()}}
  return build_lib.load_config(_CONFIGS / "toy.py", **overrides)


def _run_steps(config, n=2, phases=False):
  return _iterate(build_lib.build(config), n, phases)[:2]


def _iterate(run, n, phases=False):
  """n iterations from run.state: (state, metric rows without timings, rollouts); the prompts
  placed on the run's mesh as the training loop places them (a shared prefix replicated)."""
  state, rows, rollouts = jax.tree.map(jnp.copy, run.state), [], []  # the state is donated
  for it in range(n):
    prompts = sharding.place_prompts(run.source.batch(it).prompts, run.mesh)
    state, metrics, r, _ = runner.iteration(run, state, prompts, phase_timing=phases)
    rows.append({k: v for k, v in metrics.items() if not k.startswith("time/")})
    rollouts.append(jax.device_get(r))
  return jax.device_get(state), rows, rollouts


def _assert_close(a, b, rtol=1e-5, atol=1e-6):
  jax.tree.map(lambda x, y: np.testing.assert_allclose(
      np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=rtol, atol=atol),
      a, b)


def _params(state):
  return state.actor, state.critic


@pytest.fixture(scope="module")
def toy_run():
  """configs/toy.py at batch 16, built once for the tests that read it or iterate from its
  state (``_iterate`` copies the state it starts from: the step donates its input)."""
  return build_lib.build(toy_config())


@pytest.fixture(scope="module")
def fused_run(toy_run):
  return _iterate(toy_run, 2)[:2]


def test_fused_step_equals_its_three_phases(fused_run, toy_run):
  state, rows = fused_run
  state_p, rows_p = _iterate(toy_run, 2, phases=True)[:2]
  _assert_close(_params(state), _params(state_p))
  for a, b in zip(rows, rows_p):
    assert a.keys() == b.keys()
    _assert_close(a, b)


def test_unrolled_layers_train_like_scanned_ones():
  """model.scan_layers=False (one subtree per layer: the faster bf16 training layout on CPU)
  computes the same iterations as the default nn.scan from the same starting state."""
  scanned, unrolled = (build_lib.build(toy_config(**{"model.scan_layers": scan}))
                       for scan in (True, False))
  per_layer = lambda tree: jax.tree.map(  # noqa: E731  every params-shaped subtree, unstacked
      lambda x: unstack_layers(x) if isinstance(x, dict) and "model" in x else x, tree,
      is_leaf=lambda x: isinstance(x, dict) and "model" in x)
  unrolled = unrolled._replace(frozen=per_layer(scanned.frozen))
  state, state_u = scanned.state, per_layer(jax.tree.map(jnp.copy, scanned.state))  # donated
  assert "layers_0" in state_u.actor["model"] and "layers_0" in state_u.actor_opt[1][0].mu["model"]
  for it in range(2):
    prompts = scanned.source.batch(it).prompts
    state, metrics, _, _ = runner.iteration(scanned, state, prompts)
    state_u, metrics_u, _, _ = runner.iteration(unrolled, state_u, prompts)
    _assert_close({k: v for k, v in metrics.items() if not k.startswith("time/")},
                  {k: v for k, v in metrics_u.items() if not k.startswith("time/")},
                  rtol=1e-4, atol=1e-5)
  _assert_close(_params(state), tuple(stack_layers(p) for p in _params(state_u)),
                rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("ppo", [{}, {"rl.num_minibatches": 2, "rl.grad_accum": 2}])
def test_shared_prefix_trains_like_whole_rows(ppo):
  """Prompts.prefix (the tokens every row begins with, run once per batch) gives the iterations
  of the same prompts run whole: generation, scoring passes and update, in the single-pass
  step and in one with minibatches and micro-batches (the prefix stays whole in every slice)."""
  run = build_lib.build(toy_config(**{"rl.num_epochs": 1, **ppo}))
  states = [jax.tree.map(jnp.copy, run.state) for _ in range(2)]  # the state is donated
  for it in range(2):
    prompts = run.source.batch(it).prompts
    tokens, mask = np.array(prompts.tokens), np.asarray(prompts.mask)
    starts = np.argmax(mask, axis=1)
    tokens[np.arange(len(tokens)), starts + 1] = count.DIGIT0 + 4  # rows share [BOS, 4]
    whole = batch_lib.Prompts(tokens, mask)
    shared = batch_lib.with_prefix(whole, [count.BOS, count.DIGIT0 + 4])
    assert shared.prefix is not None and (mask.sum(1) > 2).all()
    rows = []
    for i, prompts in enumerate((whole, shared)):
      states[i], metrics, r, _ = runner.iteration(run, states[i], prompts)
      rows.append({k: v for k, v in metrics.items() if not k.startswith("time/")})
    _assert_close(rows[0], rows[1], rtol=1e-4, atol=1e-5)
  _assert_close(_params(states[0]), _params(states[1]), rtol=1e-4, atol=1e-5)


def test_with_prefix_falls_back_to_whole_rows():
  """with_prefix keeps a prefix only where every row begins with it and has a token more."""
  tokens = np.array([[0, 5, 6, 7], [5, 6, 7, 8]])
  mask = tokens > 0
  prompts = batch_lib.Prompts(tokens, mask)
  np.testing.assert_array_equal(batch_lib.with_prefix(prompts, [5, 6]).prefix, [5, 6])
  assert batch_lib.with_prefix(prompts, [5, 6, 7]).prefix is None  # row 0: nothing after it
  assert batch_lib.with_prefix(prompts, [5, 7]).prefix is None  # not every row's beginning
  assert batch_lib.with_prefix(prompts, []).prefix is None
  rest, rest_mask, positions = passes_lib.without_prefix(jnp.asarray(tokens), jnp.asarray(mask), 2)
  np.testing.assert_array_equal(rest_mask, [[False, True], [True, True]])
  np.testing.assert_array_equal(np.asarray(positions)[np.asarray(rest_mask)], [2, 2, 3])
  np.testing.assert_array_equal(np.asarray(rest)[np.asarray(rest_mask)], [7, 7, 8])


def test_sampler_old_logprobs_equal_a_recompute():
  """rl.old_logprobs="sampler" takes log π_old from generate() instead of a forward pass: the
  same responses, old log-probs equal to the recomputed ones up to float rounding (0 off the
  mask), and iterations that match the default's; at T = 0.7 (the quickstart's), where sampler
  and forward pass must both scale the logits by 1/T (T = 1 is its special case)."""
  t = {"sampling.temperature": 0.7}
  rec, smp = (build_lib.build(toy_config(**t, **{"rl.old_logprobs": old}))
              for old in ("recompute", "sampler"))
  prompts = rec.source.batch(0).prompts
  r_rec, r_smp = (jax.device_get(r.step.rollout(r.state, r.frozen, prompts)) for r in (rec, smp))
  np.testing.assert_array_equal(r_rec.responses, r_smp.responses)
  assert r_rec.mask.any() and not r_rec.mask.all()  # some padding to check
  np.testing.assert_allclose(r_smp.old_logp, r_rec.old_logp, rtol=0, atol=2e-5)
  assert not np.any(r_smp.old_logp[~r_smp.mask])
  for name in ("ref_logp", "old_values"):
    np.testing.assert_array_equal(getattr(r_smp, name), getattr(r_rec, name))
  baseline = _iterate(rec, 2)[:2]
  state, rows = _iterate(smp, 2)[:2]
  _assert_close(_params(state), _params(baseline[0]), rtol=1e-4, atol=1e-5)
  for a, b in zip(rows, baseline[1]):
    assert a.keys() == b.keys()
    _assert_close(a, b, rtol=1e-3, atol=1e-4)


# each value of each axis once: sampler log-probs at T = 1 are the T = 0.7 case's special case
@pytest.mark.parametrize("old_logprobs,temperature", [("recompute", 1.0), ("sampler", 0.7)])
def test_single_pass_update_equals_a_rollout_forward(old_logprobs, temperature):
  """With 1 epoch × 1 minibatch × 1 micro-batch the update takes the old values (and recomputed
  old log-probs) from its own forward pass (rl.reuse_update_forward): the rollout skips those
  passes, and the fused step and its three phases give the iterations of the two-pass step
  (reuse_update_forward=False), the fused step's rollout filled in as before (the three phases
  in one of the two cases). No warmup, so that every iteration moves the params and the
  critic's values are far from 0 by the third. At T = 0.7 the sampler's log-probs, the
  rollout's and the update's all use logits / T."""
  one = {"rl.num_epochs": 1, "rl.num_minibatches": 1, "rl.old_logprobs": old_logprobs,
         "optim.actor.warmup_steps": 0, "optim.critic.warmup_steps": 0,
         "sampling.temperature": temperature}
  single, double = (build_lib.build(toy_config(**one, **{"rl.reuse_update_forward": reuse}))
                    for reuse in (True, False))
  r = single.step.rollout(single.state, single.frozen, single.source.batch(0).prompts)
  assert r.old_values is None and (r.old_logp is None) == (old_logprobs == "recompute")
  state_d, rows_d, rollouts_d = _iterate(double, 3)
  last = rollouts_d[-1]
  assert np.abs(last.old_values[last.mask]).mean() > 1e-2  # the critic has learnt something
  assert last.mask.any() and not last.mask.all()  # padding to check
  fused_rollouts = None
  # the three phases in one case: at T = 0.7, the sampler's log-probs carried across them
  for phases in (False, True) if old_logprobs == "sampler" else (False,):
    state, rows, rollouts = _iterate(single, 3, phases)
    fused_rollouts = fused_rollouts or rollouts
    # Adam divides each gradient element by its own running scale, so an element whose
    # gradient is near 0 moves by up to lr = 1e-2 on float rounding alone; after 3 steps a
    # few of 8192 (2 at T = 0.7) differ by ~1e-4. The metrics below are held to 1e-4 / 1e-6.
    _assert_close(_params(state), _params(state_d), rtol=1e-4, atol=2e-4)
    for a, b in zip(rows, rows_d):
      assert a.keys() == b.keys()
      _assert_close(a, b, rtol=1e-4, atol=1e-6)
  for r, r_d in zip(fused_rollouts, rollouts_d):
    np.testing.assert_array_equal(r.responses, r_d.responses)
    for name in ("old_logp", "old_values", "ref_logp"):
      np.testing.assert_allclose(getattr(r, name), getattr(r_d, name), rtol=0, atol=2e-5,
                                 err_msg=name)
      assert not np.any(getattr(r, name)[~r.mask])


def test_python_reward_equals_the_jax_rule(fused_run):
  state, rows = fused_run
  config = toy_config(**{"reward.kind": "python", "reward.fn": "ppojax.tasks.count:count_reward_numpy"})
  run = build_lib.build(config)
  assert run.step.fused is None  # two compiled halves, one host round trip
  state_py, rows_py = _iterate(run, 2)[:2]
  _assert_close(_params(state), _params(state_py))
  _assert_close(rows, rows_py)


def test_metrics_have_trl_names_and_sane_values(fused_run):
  _, rows = fused_run
  for name in ("objective/kl", "objective/entropy_masked", "objective/non_score_reward",
               "objective/rlhf_reward", "objective/scores", "policy/approxkl_masked_avg",
               "policy/clipfrac_avg", "loss/policy_avg", "loss/value_avg", "val/clipfrac_avg",
               "val/ratio_masked_avg", "val/ratio_token_var_avg", "val/num_stopped", "lr"):
    assert name in rows[0], name
  # trl's names whose meaning differs here (docs/from-trl.md) are not used.
  for trl_only in ("objective/entropy", "policy/approxkl_avg", "policy/entropy_avg", "val/ratio",
                   "val/ratio_var", "val/num_eos_tokens"):
    assert trl_only not in rows[0], trl_only
  first = rows[0]
  assert first["objective/kl"] == pytest.approx(0.0, abs=1e-5)  # policy == reference at first
  assert first["val/ratio_masked_avg"] == pytest.approx(1.0, abs=0.05)
  assert 0 < first["objective/entropy_masked"]
  assert 0 <= first["val/num_stopped"] <= 16


@pytest.mark.parametrize("aggregation",
                         ["token_mean", "seq_mean", "seq_mean_token_sum_norm"])
def test_gradient_accumulation_is_exact(aggregation, toy_run):
  """The sum of K weighted micro-batch gradients is the minibatch gradient (ragged masks), for
  each aggregation (the algorithm record's, where the loss and the micro-batch weights read
  it: the toy run's with that one field replaced)."""
  from ppojax.learner import update as update_lib  # pylint: disable=import-outside-toplevel

  r = toy_run
  algorithm = r.algorithm._replace(aggregation=aggregation)
  rollout = r.step.rollout(r.state, r.frozen, r.source.batch(0).prompts)
  assert len(set(np.asarray(rollout.mask).sum(1).tolist())) > 1  # ragged lengths
  ppo = r.config.rl  # resolved: the algorithm's estimator, KL placement, ...
  exp, _ = experience.make_experience(rollout, r.step.score(r.frozen, rollout), 0.05, algorithm,
                                       ppo)
  params = (r.state.actor, r.state.critic)
  order = jnp.asarray(np.random.default_rng(0).permutation(16))
  grads = lambda k: update_lib._minibatch_grads(  # noqa: E731  pylint: disable=protected-access
      params, r.models, exp, order.reshape(k, 16 // k), algorithm, ppo, 1.0)
  (g1, m1), (g4, m4) = grads(1), grads(4)
  _assert_close(g1, g4, rtol=1e-4, atol=1e-7)
  _assert_close(m1["loss/policy"], m4["loss/policy"], rtol=1e-5, atol=1e-7)
  _assert_close(m1["loss/value"], m4["loss/value"], rtol=1e-5, atol=1e-7)


def test_bad_batch_split_is_refused():
  with pytest.raises(ValueError, match="not divisible"):
    build_lib.build(toy_config(**{"rl.num_minibatches": 3}))


def test_padding_after_the_stop_token_is_inert(toy_run):
  """Tokens after a response's stop token change no log-prob, value or score on the mask."""
  r = toy_run
  prompts = r.source.batch(0).prompts
  responses = np.array([[5, 6, 0, 0, 0, 0], [7, 8, 9, 10, 0, 0]], np.int32)
  mask = np.array([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0]], bool)
  garbage = np.where(mask, responses, 13)
  args = lambda resp: (prompts.tokens[:2], prompts.mask[:2], resp, mask)  # noqa: E731
  for fn, params, module in (
      (passes_lib.response_logits, r.state.actor, r.models.policy),
      (passes_lib.response_values, r.state.critic, r.models.critic),
      (passes_lib.model_scores, r.state.critic, r.models.critic)):
    clean, dirty = (np.asarray(fn(module, params, *args(x))) for x in (responses, garbage))
    if clean.ndim > 1:
      clean, dirty = clean[mask], dirty[mask]
    np.testing.assert_allclose(clean, dirty, rtol=1e-6, atol=1e-6)


def test_values_and_scores_read_the_right_positions(toy_run):
  """V(s_t) is the critic's output before response token t; the score is read at the last
  response token — checked against a forward pass over the concatenated sequence."""
  r = toy_run
  prompts = r.source.batch(0).prompts
  p, rows = prompts.tokens[:3], slice(0, 3)
  responses = np.array([[5, 6, 0, 0], [7, 8, 9, 0], [4, 4, 4, 4]], np.int32)
  mask = np.array([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]], bool)
  tokens = np.concatenate([p, responses], 1)
  full_mask = np.concatenate([prompts.mask[rows], mask], 1)
  out, _ = r.models.critic.apply({"params": r.state.critic}, jnp.asarray(tokens),
                                 positions_from_mask(jnp.asarray(full_mask)),
                                 jnp.asarray(full_mask))
  out = np.asarray(out)
  values = np.asarray(passes_lib.response_values(
      r.models.critic, r.state.critic, p, prompts.mask[rows], responses, mask))
  plen = p.shape[1]
  np.testing.assert_allclose(values[mask], out[:, plen - 1:-1][mask], rtol=1e-6)
  scores = np.asarray(passes_lib.model_scores(
      r.models.critic, r.state.critic, p, prompts.mask[rows], responses, mask))
  last = plen + mask.sum(1) - 1
  np.testing.assert_allclose(scores, out[np.arange(3), last], rtol=1e-6)


def test_reward_model_and_critic_initialised_from_it(tmp_path):
  """reward.kind = "model": scores come from a ValueModel checkpoint, the critic starts as a
  copy of it (critic_init auto → reward), and the step runs."""
  from ppojax.models import LoadedModel, save_model  # pylint: disable=import-outside-toplevel

  config = toy_config()
  cfg = run_models.tiny_model_config(config.model.tiny)
  tokens = jnp.zeros((1, 2), jnp.int32)
  params = ValueModel(cfg).init(jax.random.key(7), tokens, positions_from_mask(tokens >= 0),
                                tokens >= 0)["params"]
  save_model(tmp_path / "rm", LoadedModel(cfg, jax.device_get(params), None, "value"))
  config = toy_config(**{"reward.kind": "model", "model.reward": str(tmp_path / "rm")})
  r = build_lib.build(config)
  _assert_close(r.state.critic, r.frozen.reward)
  state, metrics, rollout, scores = runner.iteration(r, r.state, r.source.batch(0).prompts)
  args = (rollout.prompts, rollout.prompt_mask, rollout.responses, rollout.mask)
  assert rollout.prefix is not None  # every count prompt begins with BOS
  want = passes_lib.model_scores(r.models.reward, r.frozen.reward, *args, rollout.prefix)
  # two compiled programs: each its own rounding
  np.testing.assert_allclose(np.asarray(scores), np.asarray(want), rtol=1e-5, atol=1e-6)
  whole = passes_lib.model_scores(r.models.reward, r.frozen.reward, *args)  # prefix per row
  np.testing.assert_allclose(np.asarray(scores), np.asarray(whole), rtol=1e-5, atol=1e-6)
  assert np.isfinite(metrics["loss/value_avg"]) and int(state.step) == 1
  with pytest.raises(ValueError, match="critic_init='reward'"):
    build_lib.build(toy_config(**{"model.critic_init": "reward"}))


def test_count_rule_in_jnp_and_numpy_agree():
  prompts = count.count_prompts(0, 0, 64, 6)
  rng = np.random.default_rng(0)
  want = count._expected_digits(prompts.tokens, np)  # pylint: disable=protected-access
  responses = np.where(rng.random((64, 3)) < 0.5, want, rng.integers(0, 12, (64, 3)))
  responses = np.concatenate([responses, rng.integers(0, 2, (64, 3))], 1).astype(np.int32)
  mask = np.ones_like(responses, bool)
  jax_scores = np.asarray(count.count_reward(prompts.tokens, prompts.mask, responses, mask))
  np_scores = count.count_reward_numpy(rollout_lib.Rollout(
      prompts.tokens, prompts.mask, responses, mask, None, None, None, None))
  np.testing.assert_array_equal(jax_scores, np_scores)
  perfect = np.concatenate([want, np.zeros((64, 3), np.int32)], 1)
  assert np.all(count.count_reward(prompts.tokens, prompts.mask, perfect, mask) == 1.25)


def test_sharded_step_equals_single_device(run_on_8_cpu_devices, toy_run, tmp_path):
  """One PPO iteration on a (data 2, fsdp 2, tensor 2) mesh of 8 simulated CPU devices equals
  the same iteration on one device (this process)."""
  one_state, one_rows = _iterate(toy_run, 1)[:2]
  leaves = jax.tree.leaves(_params(one_state))
  np.savez(tmp_path / "one.npz", *leaves)
  (tmp_path / "rows.json").write_text(__import__("json").dumps(one_rows))
  script = textwrap.dedent(f"""
      import json, sys
      sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r})
      import jax, numpy as np
      from test_step import toy_config, _run_steps, _assert_close, _params
      from ppojax.run import build as build_lib, runner
      assert jax.device_count() == 8
      config = toy_config(**{{"mesh.shape": (2, 2, 2)}})
      specs = {{str(s.spec) for s in jax.tree.leaves(build_lib.build(config).state_shardings)}}
      assert any("tensor" in s for s in specs) and any("fsdp" in s for s in specs), specs
      state, rows = _run_steps(config, n=1)
      one = np.load({str(tmp_path / "one.npz")!r})
      want = [one[f"arr_{{i}}"] for i in range(len(one.files))]
      # Adam's first step is about lr·g/|g| per weight (lr = 1e-2 here): where g is near 0, the
      # sharded sums' rounding moves that weight by up to a few 1e-5
      _assert_close(want, jax.tree.leaves(_params(state)), rtol=1e-4, atol=1e-4)
      _assert_close(json.loads(open({str(tmp_path / "rows.json")!r}).read()), rows,
                    rtol=1e-4, atol=1e-5)
      print("OK")
  """)
  run_on_8_cpu_devices(script)
