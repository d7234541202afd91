"""The options that make large models fit (docs/scale.md), each against the plain path:

  forward_micro_batches  the rollout's forward passes in parts: the same rollout and iterations
  frozen_dtype           reference and reward model stored in bfloat16: with bfloat16 compute the
                         same log-probs and scores
  optim.state_dtype      Adam's moments in bfloat16: the float32 optimizer's steps to ~1e-2
  sampling.dtype         a bfloat16 sampler for a float32 learner: the mismatch is reported, and
                         truncated importance sampling (rl.tis_cap) reweights the policy terms
                         (NumPy reference; weights ≡ 1 where the engines agree)
  remat_policy           tests/test_models.py (the same gradient under every policy)
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_step import _assert_close, _iterate, _params, toy_config

from ppojax.core import correction, losses
from ppojax.core import optim as optim_lib
from ppojax.learner import step as step_lib
from ppojax.models import passes as passes_lib
from ppojax.run import build as build_lib
from ppojax.run import models as run_models


def _masked(shape=(4, 7), seed=0):
  rng = np.random.default_rng(seed)
  mask = np.arange(shape[1])[None] < rng.integers(1, shape[1] + 1, (shape[0], 1))
  return rng, mask


# ---------------------------------------------------------------------------------------------
# Truncated importance sampling: the math
# ---------------------------------------------------------------------------------------------


def test_truncated_is_weight_matches_numpy():
  rng, mask = _masked()
  old = rng.normal(-2.0, 1.0, mask.shape)
  sampler = old + rng.normal(0.0, 0.8, mask.shape)
  sampler[~mask] = np.nan  # padding is inert
  cap = 1.5
  w, m = correction.is_weight(jnp.asarray(old), jnp.asarray(sampler), jnp.asarray(mask), cap)
  ratio = np.exp(old - np.where(mask, sampler, 0.0))
  want = np.where(mask, np.minimum(ratio, cap), 0.0)
  np.testing.assert_allclose(np.asarray(w), want, rtol=1e-5, atol=0)
  np.testing.assert_allclose(float(m["is_weight"]), want[mask].mean(), rtol=1e-5)
  np.testing.assert_allclose(float(m["is_truncated"]), (ratio[mask] > cap).mean(), rtol=1e-6)
  np.testing.assert_allclose(float(m["mismatch"]),
                             np.abs(old - sampler)[mask].mean(), rtol=1e-5)
  assert 0 < float(m["is_truncated"]) < 1  # both branches exercised
  same, m_same = correction.is_weight(jnp.asarray(old), jnp.asarray(old), jnp.asarray(mask),
                                     cap)
  np.testing.assert_array_equal(np.asarray(same), mask.astype(np.float32))  # agreement: w ≡ 1
  assert float(m_same["mismatch"]) == 0.0


def test_is_weight_multiplies_each_tokens_policy_term():
  """L(w) = agg(w_t·ℓ_t): w ≡ 1 is the unweighted loss; a weight scales its token's term and its
  gradient, and never receives a gradient itself."""
  rng, mask = _masked(seed=1)
  logp, old, adv = (jnp.asarray(rng.normal(-1.0, 0.3, mask.shape)) for _ in range(3))
  mask = jnp.asarray(mask)
  w = jnp.asarray(rng.uniform(0.2, 2.0, mask.shape))

  def loss(lp, weight):
    return losses.policy_loss(lp, old, adv, mask, is_weight=weight)[0]

  plain = losses.policy_loss(logp, old, adv, mask)[0]
  np.testing.assert_allclose(loss(logp, jnp.ones_like(logp)), plain, rtol=1e-6)
  per_token = jax.grad(lambda lp: losses.policy_loss(lp, old, adv, mask)[0])(logp)
  weighted = jax.grad(loss)(logp, w)
  np.testing.assert_allclose(np.asarray(weighted), np.asarray(per_token * w), rtol=1e-5,
                             atol=1e-8)
  assert not np.any(np.asarray(jax.grad(loss, argnums=1)(logp, w)))


# ---------------------------------------------------------------------------------------------
# Building blocks: micro-batched passes, bfloat16 optimizer state
# ---------------------------------------------------------------------------------------------


def test_map_rows_equals_one_call():
  x = jnp.arange(24.0).reshape(12, 2)
  y = jnp.arange(12)
  fn = lambda a, b, s: {"sum": a.sum(1) * s + b, "none": None, "rows": a * 2}  # noqa: E731
  whole = fn(x, y, 3.0)
  for k in (1, 2, 3, 4, 6, 12):
    parts = passes_lib.map_rows(fn, (x, y), k, 3.0)
    jax.tree.map(np.testing.assert_array_equal, parts, whole)
  with pytest.raises(ValueError, match="do not split"):
    passes_lib.map_rows(fn, (x, y), 5, 3.0)


def test_bfloat16_optimizer_state_follows_float32_adam():
  params = {"w": jnp.linspace(-1.0, 1.0, 64).reshape(8, 8), "b": jnp.zeros(8)}
  rng = np.random.default_rng(0)
  grads = [jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
           for _ in range(5)]
  runs = {}
  for dtype in ("float32", "bfloat16"):
    tx = optim_lib.make_optimizer(optax.constant_schedule(1e-2), 1.0, state_dtype=dtype)
    state, p = tx.init(params), params
    for g in grads:
      updates, state = jax.jit(tx.update)(g, state, p)
      p = optax.apply_updates(p, updates)
    runs[dtype] = (p, state)
  floats = [x for x in jax.tree.leaves(runs["bfloat16"][1]) if jnp.issubdtype(x.dtype, jnp.floating)]
  assert floats and all(x.dtype == jnp.bfloat16 for x in floats)
  assert step_lib._opt_count(runs["bfloat16"][1]) == 5  # pylint: disable=protected-access
  moved = jax.tree.map(lambda a, b: a - b, runs["float32"][0], params)
  moved_bf16 = jax.tree.map(lambda a, b: a - b, runs["bfloat16"][0], params)
  _assert_close(moved_bf16, moved, rtol=2e-2, atol=1e-4)
  assert optax.tree.norm(moved) > 1e-2


# ---------------------------------------------------------------------------------------------
# The step with each option
# ---------------------------------------------------------------------------------------------


def _rollout(config, it=0):
  run = build_lib.build(config)
  r = run.step.rollout(run.state, run.frozen, run.source.batch(it).prompts)
  return run, jax.device_get(r)


def test_forward_micro_batches_give_the_same_rollout_and_iterations():
  """toy: 2 minibatches → the rollout's passes run in 2 parts by default; 1 and 4 parts give the
  same log-probs and values, and the same iterations."""
  assert step_lib.forward_micro_batches(toy_config().rl) == 2
  assert step_lib.forward_micro_batches(toy_config(**{"rl.num_minibatches": 1,
                                                      "rl.num_epochs": 1}).rl) == 1
  base = None
  for k in (1, 4):
    config = toy_config(**{"rl.forward_micro_batches": k})
    run, r = _rollout(config)
    state, rows, _ = _iterate(run, 2)
    if base is None:
      base = (r, state, rows)
      continue
    np.testing.assert_array_equal(r.responses, base[0].responses)
    for name in ("old_logp", "ref_logp", "old_values", "sampler_logp"):
      np.testing.assert_allclose(getattr(r, name), getattr(base[0], name), rtol=0, atol=1e-6)
    _assert_close(_params(state), _params(base[1]), rtol=1e-5, atol=1e-6)
    _assert_close(rows, base[2], rtol=1e-4, atol=1e-6)
  with pytest.raises(ValueError, match="forward_micro_batches=3"):
    build_lib.build(toy_config(**{"rl.forward_micro_batches": 3}))


def test_bfloat16_frozen_models_score_like_float32_ones(tmp_path):
  """With bfloat16 compute, storing the reference and the reward model in bfloat16 changes no
  log-prob (every weight is rounded to bfloat16 at use anyway) and the reward model's score only
  by its float32 head's rounding; the trained models stay float32."""
  from ppojax.models import LoadedModel, ValueModel, save_model  # pylint: disable=C0415
  from ppojax.models.cache import positions_from_mask  # pylint: disable=C0415

  cfg = run_models.tiny_model_config(toy_config().model.tiny)
  tokens = jnp.zeros((1, 2), jnp.int32)
  params = ValueModel(cfg).init(jax.random.key(7), tokens, positions_from_mask(tokens >= 0),
                                tokens >= 0)["params"]
  params = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(1), x.shape),
                        params)  # a non-zero score head
  save_model(tmp_path / "rm", LoadedModel(cfg, jax.device_get(params), None, "value"))
  common = {"reward.kind": "model", "model.reward": str(tmp_path / "rm"),
            "model.dtype": "bfloat16"}
  out = {}
  for dtype in ("", "bfloat16"):
    run, r = _rollout(toy_config(**common, **{"model.frozen_dtype": dtype}))
    out[dtype] = (run, r, jax.device_get(run.step.score(run.frozen, r)))
  run16, r16, s16 = out["bfloat16"]
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(run16.frozen))
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(_params(run16.state)))
  r32, s32 = out[""][1:]
  np.testing.assert_array_equal(r16.responses, r32.responses)
  np.testing.assert_allclose(r16.ref_logp, r32.ref_logp, rtol=0, atol=1e-6)
  scale = np.abs(s32).max()
  assert scale > 0.5 and 0 < np.abs(s16 - s32).max() < 5e-3 * scale  # bfloat16 head: ~2^-8


def test_sampler_mismatch_is_reported_and_tis_reweights():
  """A bfloat16 sampler for the float32 learner: the rollout keeps the sampler's log-probs, the
  metric rollout/logp_mismatch is their mean gap to the learner's, and with rl.tis_cap the
  policy terms carry min(π_old/π_sampler, cap) (where the engines agree w ≡ 1:
  test_truncated_is_weight_matches_numpy)."""
  over = {"sampling.dtype": "bfloat16"}
  plain_run, r = _rollout(toy_config(**over))
  gap = np.abs(r.old_logp - r.sampler_logp)[r.mask].mean()
  assert not np.any(r.sampler_logp[~r.mask])
  assert plain_run.models.sampler.cfg.dtype == "bfloat16"
  assert plain_run.models.policy.cfg.dtype == "float32"
  assert gap > 1e-4  # bfloat16 decode vs float32 forward (float32 rounding: ~1e-7)
  _, rows, _ = _iterate(plain_run, 1)
  assert rows[0]["rollout/logp_mismatch"] == pytest.approx(gap, rel=1e-4, abs=1e-7)
  assert "policy/is_weight_avg" not in rows[0]
  _, rows_t, _ = _iterate(build_lib.build(toy_config(**over, **{"rl.tis_cap": 2.0})), 1)
  assert 0.8 < rows_t[0]["policy/is_weight_avg"] < 1.2
  assert rows_t[0]["loss/policy_avg"] != pytest.approx(rows[0]["loss/policy_avg"], rel=1e-6)
  assert build_lib.build(toy_config()).models.sampler is None  # model.dtype: no second module
  with pytest.raises(ValueError, match="tis_cap"):
    build_lib.build(toy_config(**{"rl.tis_cap": -1.0}))
