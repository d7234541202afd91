"""Rollout correction and DAPO's overlong handling: truncated importance weights per token and per
sequence, rejection of tokens or responses whose sampler/learner ratio leaves [low, high]
(``ppojax.core.correction``), the soft overlong penalty (``rewards.overlong_penalty``) and the
overlong filter, each against NumPy written out here; in the experience, the loss's token mask
they make; through the step, micro-batches that add up to the whole batch under that mask."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_step import _assert_close, _iterate, _params, toy_config

from ppojax.core import algorithms, correction, rewards
from ppojax.learner import experience
from ppojax.rollout.rollout import Rollout
from ppojax.run import build as build_lib
from ppojax.run import checks


def _logps(seed=0, b=6, t=7):
  """Ragged masks (one empty row), learner log-probs and a sampler's that differ by up to ±0.9."""
  rng = np.random.default_rng(seed)
  mask = np.arange(t)[None] < rng.integers(1, t + 1, (b, 1))
  mask[2] = False
  old = -rng.uniform(0.1, 3.0, (b, t))
  sampler = old + rng.uniform(-0.9, 0.9, (b, t))
  return old, sampler, mask


def _np_ratios(old, sampler, mask, level):
  """ρ per token, Π_t ρ_t or its |y|-th root per row, broadcast over the row's tokens."""
  delta = np.where(mask, old - sampler, 0.0)
  if level == "token":
    return np.exp(delta)
  total = delta.sum(axis=1, keepdims=True)
  if level == "geometric":
    total = total / np.maximum(mask.sum(axis=1, keepdims=True), 1)
  return np.broadcast_to(np.exp(total), delta.shape)


@pytest.mark.parametrize("level", correction.IS_LEVELS)
def test_truncated_is_weights_match_numpy(level):
  old, sampler, mask = _logps()
  cap = 1.5
  w, m = correction.is_weight(jnp.asarray(old), jnp.asarray(sampler), jnp.asarray(mask), cap,
                              level)
  ratio = _np_ratios(old, sampler, mask, level)
  np.testing.assert_allclose(np.asarray(w), np.where(mask, np.minimum(ratio, cap), 0.0),
                             rtol=1e-5)
  assert float(m["is_truncated"]) == pytest.approx((ratio[mask] > cap).mean())
  assert 0 < float(m["is_truncated"]) < 1  # both branches
  same, _ = correction.is_weight(jnp.asarray(old), jnp.asarray(old), jnp.asarray(mask), cap,
                                 level)
  np.testing.assert_array_equal(np.asarray(same), mask.astype(np.float32))  # engines agree: 1
  grad = jax.grad(lambda o: jnp.sum(correction.is_weight(o, jnp.asarray(sampler),
                                                         jnp.asarray(mask), cap, level)[0]))
  assert not np.any(np.asarray(grad(jnp.asarray(old))))  # a constant weight


@pytest.mark.parametrize("level", correction.REJECT_LEVELS)
def test_rejection_keeps_what_lies_within_the_bounds(level):
  old, sampler, mask = _logps(1)
  low, high = (0.9, 1.1) if level == "geometric" else (0.7, 1.4)  # a root stays nearer 1
  keep, m = correction.rejection_mask(jnp.asarray(old), jnp.asarray(sampler), jnp.asarray(mask),
                                      low, high, level)
  ratio = _np_ratios(old, sampler, mask, level)
  inside = (ratio >= low) & (ratio <= high)
  np.testing.assert_array_equal(np.asarray(keep), mask & inside)
  rejected = mask & ~inside
  assert float(m["rejected_tokens"]) == pytest.approx(rejected[mask].mean())
  rows = mask.any(axis=1)
  assert float(m["rejected_sequences"]) == pytest.approx(rejected.any(axis=1)[rows].mean())
  assert 0 < rejected[mask].mean() < 1
  if level != "token":  # a response is kept or rejected whole
    assert all(len(set(keep_row[m_row])) <= 1 for keep_row, m_row in zip(np.asarray(keep), mask))


def test_unknown_levels_are_refused_by_name():
  args = (jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.ones((1, 2), bool))
  with pytest.raises(ValueError, match="rl.tis_level='seq'"):
    correction.is_weight(*args, 2.0, "seq")
  with pytest.raises(ValueError, match="rl.reject='tokens'"):
    correction.rejection_mask(*args, 0.5, 2.0, "tokens")


def test_the_overlong_penalty_ramps_over_the_buffer():
  """L_max = 20, L_buf = 8: 0 up to 12 tokens, then −(L − 12)/8, −1 at the limit (× factor)."""
  lengths = np.array([0, 5, 12, 13, 16, 20])
  want = np.array([0.0, 0.0, 0.0, -1 / 8, -4 / 8, -1.0]) * 0.5
  got = rewards.overlong_penalty(jnp.asarray(lengths), 20, 8, factor=0.5)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)
  with pytest.raises(ValueError, match=r"overlong buffer=21 must be in \[1, max_new_tokens=20\]"):
    rewards.overlong_penalty(jnp.asarray(lengths), 20, 21)


def _rollout(mask, has_stop, old, sampler):
  b, t = mask.shape
  z = jnp.zeros((b, t), jnp.float32)
  return Rollout(prompts=jnp.zeros((b, 3), jnp.int32), prompt_mask=jnp.ones((b, 3), bool),
                 responses=jnp.zeros((b, t), jnp.int32), mask=jnp.asarray(mask),
                 has_stop=jnp.asarray(has_stop), old_logp=jnp.asarray(old, jnp.float32),
                 ref_logp=z, old_values=None, sampler_logp=jnp.asarray(sampler, jnp.float32))


def test_the_experience_shapes_scores_and_masks_the_loss_tokens():
  """GRPO over 2 groups of 3 with the penalty, the overlong filter and token rejection on: the
  scores the estimator reads carry the penalty; the loss mask is the response mask of the
  responses that stopped, less the rejected tokens; the metrics say how much went."""
  old, sampler, mask = _logps(2)
  mask[2] = True  # no empty row here
  has_stop = np.array([True, False, True, True, False, True])
  config = toy_config(**{"algorithm": "grpo", "rl.batch_size": 2,
                         "sampling.num_samples_per_prompt": 3, "rl.overlong_buffer": 4,
                         "rl.overlong_factor": 0.5, "rl.overlong_filter": True,
                         "rl.reject": "token", "rl.reject_low": 0.7, "rl.reject_high": 1.4})
  cfg = algorithms.resolve(config).rl
  scores = np.array([1.0, 0.0, 1.0, 0.0, 1.0, 1.0], np.float32)
  exp, metrics = experience.make_experience(_rollout(mask, has_stop, old, sampler),
                                            jnp.asarray(scores), 0.0,
                                            algorithms.from_config(config), cfg, 3)
  lengths = mask.sum(axis=1)
  penalty = -0.5 * np.clip(lengths - (7 - 4), 0, None) / 4
  shaped = (scores + penalty).reshape(2, 3)
  adv = ((shaped - shaped.mean(1, keepdims=True)) / (shaped.std(1, ddof=1, keepdims=True)
                                                      + 1e-6)).ravel()
  np.testing.assert_allclose(np.asarray(exp.advantages), np.where(mask, adv[:, None], 0.0),
                             rtol=1e-4, atol=1e-5)
  ratio = np.exp(old - sampler)
  want = mask & has_stop[:, None] & (ratio >= 0.7) & (ratio <= 1.4)
  np.testing.assert_array_equal(np.asarray(experience.loss_tokens(exp)), want)
  assert float(metrics["objective/overlong_penalty"]) == pytest.approx(penalty.mean())
  assert float(metrics["objective/scores_raw"]) == pytest.approx(scores.mean())
  assert float(metrics["objective/scores"]) == pytest.approx((scores + penalty).mean())
  assert float(metrics["rollout/overlong_filtered"]) == pytest.approx(2 / 6)
  off = experience.make_experience(_rollout(mask, has_stop, old, sampler), jnp.asarray(scores),
                                   0.0, algorithms.from_config(config),
                                   algorithms.resolve(toy_config(**{
                                       "algorithm": "grpo", "rl.batch_size": 2,
                                       "sampling.num_samples_per_prompt": 3})).rl, 3)[0]
  assert off.loss_mask is None  # no filter: the response mask


def test_the_options_are_checked():
  for over, match in (({"rl.reject": "tokens"}, "rl.reject"),
                      ({"rl.reject_high": 0.9}, "rl.reject_high=0.9 must be >= 1"),
                      ({"rl.overlong_buffer": 99}, "rl.overlong_buffer=99 is longer than"),
                      ({"rl.tis_level": "seq"}, "rl.tis_level")):
    with pytest.raises(checks.ConfigError, match=match):
      checks.validate(toy_config(**over), num_devices=1)


def test_micro_batches_add_up_to_the_batch_under_the_loss_mask():
  """A bfloat16 sampler (ratios off 1 by ~1e-4) with token rejection at [0.9999, 1.0001], the
  overlong filter and sequence-level TIS: 2 micro-batches give the iteration of 1 (each
  micro-batch's share counts its loss tokens, not its response tokens)."""
  over = {"sampling.dtype": "bfloat16", "rl.reject": "token", "rl.reject_low": 0.9999,
          "rl.reject_high": 1.0001, "rl.overlong_filter": True, "rl.tis_cap": 2.0,
          "rl.tis_level": "sequence", "rl.reuse_update_forward": False}
  one, rows, _ = _iterate(build_lib.build(toy_config(**over)), 1)
  two, rows2, _ = _iterate(build_lib.build(toy_config(**over, **{"rl.grad_accum": 2})), 1)
  assert 0 < rows[0]["rollout/rejected_tokens"] < 1
  assert "rollout/overlong_filtered" in rows[0] and "policy/is_weight_avg" in rows[0]
  _assert_close(_params(one), _params(two), rtol=2e-4, atol=2e-6)
  for name in ("loss/policy_avg", "loss/value_avg", "rollout/rejected_tokens"):
    assert rows2[0][name] == pytest.approx(rows[0][name], rel=1e-4, abs=1e-7)


def test_the_sequence_weight_spans_the_whole_response_under_token_rejection():
  """rl.tis_level="sequence" with rl.reject="token" (verl's rollout_corr_helper): each response's
  weight is min(π_old(y)/π_sampler(y), C) over all its tokens, also those token rejection took
  out of the loss; the loss is the token mean, over the kept tokens, of weight × PPO's clipped
  term. Written out as a loop here; the product over the kept tokens alone gives another loss."""
  from ppojax.learner.loss import clipped_loss
  old, sampler, mask = _logps(5, b=4, t=6)
  mask[2] = True
  rng = np.random.default_rng(1)
  logp = old + rng.uniform(-0.4, 0.4, old.shape)
  adv = np.repeat(rng.normal(size=(4, 1)), 6, axis=1) * mask
  config = toy_config(**{"algorithm": "grpo", "rl.batch_size": 2,
                         "sampling.num_samples_per_prompt": 2, "rl.reject": "token",
                         "rl.reject_low": 0.8, "rl.reject_high": 1.25, "rl.tis_cap": 2.0,
                         "rl.tis_level": "sequence", "rl.clip_eps": 0.2,
                         "rl.aggregation": "token_mean"})
  cfg, algorithm = algorithms.resolve(config).rl, algorithms.from_config(config)
  r = _rollout(mask, np.ones(4, bool), old, sampler)
  keep = np.asarray(experience.filters(r, cfg)[0])
  assert 0 < (mask & ~keep).sum() and (mask.sum(1) > keep.sum(1)).any()  # rejection bites

  def numpy_loss(weight_mask):
    total, count = 0.0, 0
    for i in range(4):
      w = min(np.exp(sum(old[i, t] - sampler[i, t] for t in range(6) if weight_mask[i, t])), 2.0)
      for t in range(6):
        if keep[i, t]:
          rho = np.exp(logp[i, t] - old[i, t])
          total += w * max(-adv[i, t] * rho, -adv[i, t] * np.clip(rho, 0.8, 1.2))
          count += 1
    return total / count

  exp = experience.Experience(r, jnp.asarray(adv, jnp.float32), None, None, jnp.asarray(keep))
  z = jnp.zeros(old.shape, jnp.float32)
  loss, _ = clipped_loss(jnp.asarray(logp, jnp.float32), z, None, exp, algorithm, cfg)
  assert float(loss) == pytest.approx(numpy_loss(mask), rel=1e-5, abs=1e-6)
  assert abs(numpy_loss(mask) - numpy_loss(keep)) > 1e-3  # the other convention differs
