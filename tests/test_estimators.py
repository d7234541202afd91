"""Critic-free advantage estimators (GRPO, Dr. GRPO, RLOO, REINFORCE++) and the ``ESTIMATORS``
registry: against the float64 loops of ``reference.py`` on random inputs (group sizes 1, 2, 3, 4,
8; tied scores; ragged masks with empty rows; NaN padding), and hypothesis properties:
degenerate groups give exactly 0 and never NaN, padding changes nothing, GRPO groups have mean 0
and unit std, RLOO groups sum to 0, a constant shift of a group changes nothing.
"""

from __future__ import annotations

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(__file__))
import reference as ref  # noqa: E402

from ppojax.core import advantages  # noqa: E402

SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
GROUP_SIZES = [1, 2, 3, 4, 8]
T = 6
GROUP_FNS = {"grpo": advantages.grpo, "dr_grpo": advantages.dr_grpo, "rloo": advantages.rloo}
REFS = {"grpo": ref.grpo, "dr_grpo": ref.dr_grpo, "rloo": ref.rloo}


def close(actual, expected, rtol=1e-5, atol=1e-5, err_msg=""):
  np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(expected, np.float64),
                             rtol=rtol, atol=atol, err_msg=err_msg)


def ragged_mask(rng, rows, t=T):
  """Prefix masks of random lengths; the first row empty, the second full (where there are)."""
  lengths = rng.integers(0, t + 1, rows)
  lengths[: min(rows, 2)] = [0, t][: min(rows, 2)]
  return np.arange(t)[None, :] < rng.permutation(lengths)[:, None]


def draw_scores(rng, rows, kind):
  if kind == "normal":
    return rng.normal(size=rows).astype(np.float32) * 2 + 1
  if kind == "binary":  # verifiable rewards: many all-0 / all-1 groups
    return rng.integers(0, 2, rows).astype(np.float32)
  return rng.choice(np.float32([-1.0, 0.1, 0.5]), rows)  # a few values: ties inside groups


@functools.partial(jax.jit, static_argnums=(2, 3))
def _group(scores, mask, name, n):
  return GROUP_FNS[name](scores, mask, n)[0]


# ----------------------------------------------------------------------------------------------
# Against the NumPy references.


@pytest.mark.parametrize("name", sorted(GROUP_FNS))
@pytest.mark.parametrize("n", GROUP_SIZES)
@pytest.mark.parametrize("kind", ["normal", "binary", "ties"])
def test_group_estimators_match_reference(name, n, kind):
  rng = np.random.default_rng([n, len(name), len(kind)])
  for groups in (1, 3):
    scores = draw_scores(rng, groups * n, kind)
    mask = ragged_mask(rng, groups * n)
    adv, returns = GROUP_FNS[name](jnp.asarray(scores), jnp.asarray(mask), n)
    assert returns is None
    assert adv.shape == mask.shape and adv.dtype == jnp.float32
    expected = REFS[name](scores, mask, n)
    close(adv, expected, err_msg=f"{groups} groups")
    assert np.all(np.asarray(adv)[~mask] == 0.0)
    # degenerate groups: exactly 0
    same = np.repeat((scores.reshape(groups, n) == scores.reshape(groups, n)[:, :1]).all(1), n)
    assert np.all(np.asarray(adv)[same] == 0.0)


def test_group_estimators_by_hand():
  scores = jnp.array([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
  mask = jnp.ones((8, 2), bool).at[1, 1].set(False)
  a = 0.5 / np.sqrt(1.0 / 3.0)  # centred ±0.5, unbiased std √(1/3)
  close(advantages.grpo(scores, mask, 4, eps=0.0)[0][:, 0], [a, -a, -a, a, 0, 0, 0, 0])
  close(advantages.dr_grpo(scores, mask, 4)[0][:, 0], [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])
  # RLOO: 1 − (0 + 0 + 1)/3 = 2/3 = 4/3 · 0.5
  close(advantages.rloo(scores, mask, 4)[0][:, 0], [2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0, 0])
  assert float(advantages.grpo(scores, mask, 4)[0][1, 1]) == 0.0  # off the mask


@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_reinforce_pp_and_returns_match_reference(gamma, rows):
  rng = np.random.default_rng([rows, int(gamma * 10)])
  mask = ragged_mask(rng, rows)
  rewards = np.where(mask, rng.normal(size=mask.shape), np.nan).astype(np.float32)  # NaN padding
  rewards64 = np.where(mask, rewards, 0.0)
  adv, ret = advantages.reinforce_pp(jnp.asarray(rewards), jnp.asarray(mask), gamma)
  adv_ref, ret_ref = ref.reinforce_pp(rewards64, mask, gamma)
  close(ret, ret_ref, atol=3e-5)
  close(advantages.discounted_returns(jnp.asarray(rewards), jnp.asarray(mask), gamma), ret_ref,
        atol=3e-5)
  close(adv, adv_ref, rtol=1e-4, atol=1e-4)
  assert np.all(np.asarray(adv)[~mask] == 0.0) and np.all(np.asarray(ret)[~mask] == 0.0)


def test_reinforce_pp_kl_shaped_rewards_by_hand():
  """Rows of 2 and 1 tokens: r = −β·KL_t + score on the last token, γ = 1."""
  rewards = jnp.array([[-0.1, 0.9], [2.0, 0.0]])
  mask = jnp.array([[True, True], [True, False]])
  adv, ret = advantages.reinforce_pp(rewards, mask)
  close(ret, [[0.8, 0.9], [2.0, 0.0]])
  g = np.array([0.8, 0.9, 2.0])
  white = (g - g.mean()) / np.sqrt(g.var(ddof=1) + 1e-8)
  close(adv, [[white[0], white[1]], [white[2], 0.0]], atol=1e-5)


def test_reinforce_pp_all_equal_returns_give_zero():
  rewards = jnp.full((3, 4), 0.1)
  mask = jnp.zeros((3, 4), bool).at[:, 0].set(True)  # one token each: G = 0.1 everywhere
  adv, ret = advantages.reinforce_pp(rewards, mask)
  assert np.all(np.asarray(adv) == 0.0)
  close(ret, np.where(np.asarray(mask), 0.1, 0.0))
  adv, _ = advantages.reinforce_pp(rewards, jnp.zeros((3, 4), bool))  # no tokens at all
  assert np.all(np.asarray(adv) == 0.0)


def test_group_size_errors():
  scores, mask = jnp.zeros(6), jnp.ones((6, 2), bool)
  with pytest.raises(ValueError, match="6 scores do not split into groups of 4"):
    advantages.grpo(scores, mask, 4)
  with pytest.raises(ValueError, match="group_size=0 must be a Python int >= 1"):
    advantages.rloo(scores, mask, 0)


# ----------------------------------------------------------------------------------------------
# The registry.


def _inputs(rng, groups, n, critic=True):
  mask = ragged_mask(rng, groups * n)
  return advantages.AdvantageInputs(
      scores=jnp.asarray(draw_scores(rng, groups * n, "normal")),
      rewards=jnp.asarray(rng.normal(size=mask.shape), jnp.float32),
      mask=jnp.asarray(mask),
      values=jnp.asarray(rng.normal(size=mask.shape), jnp.float32) if critic else None)


def test_registry_entries_equal_their_functions():
  rng = np.random.default_rng(7)
  x = _inputs(rng, 3, 4)
  p = advantages.AdvantageParams(gamma=0.9, lam=0.8, whiten=True, group_size=4, eps=1e-6)
  expected = {
      "gae": advantages.gae(x.rewards, x.values, x.mask, 0.9, 0.8, whiten=True),
      "grpo": advantages.grpo(x.scores, x.mask, 4),
      "dr_grpo": advantages.dr_grpo(x.scores, x.mask, 4),
      "rloo": advantages.rloo(x.scores, x.mask, 4),
      "reinforce_pp": advantages.reinforce_pp(x.rewards, x.mask, 0.9),
  }
  assert sorted(advantages.ESTIMATORS) == sorted(expected)
  for name, (adv, ret) in expected.items():
    est = advantages.estimator(name)
    got_adv, got_ret = jax.jit(est.fn, static_argnums=1)(x, p)
    close(got_adv, adv, rtol=1e-6, atol=1e-6, err_msg=name)  # jit vs eager: an ulp apart
    assert (got_ret is None) == (ret is None), name
    if ret is not None:
      close(got_ret, ret, rtol=1e-6, atol=1e-6, err_msg=name)
    assert est.needs_critic == (name == "gae")
    assert est.needs_groups == (name in ("grpo", "dr_grpo", "rloo"))


def test_registry_critic_free_entries_need_no_values_and_gae_says_so():
  rng = np.random.default_rng(8)
  x = _inputs(rng, 2, 2, critic=False)
  p = advantages.AdvantageParams(group_size=2)
  for name, est in advantages.ESTIMATORS.items():
    if not est.needs_critic:
      adv, _ = est.fn(x, p)
      assert adv.shape == x.mask.shape
  with pytest.raises(ValueError, match="GAE needs the critic's values"):
    advantages.estimator("gae").fn(x, p)
  with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'; choose one of"):
    advantages.estimator("ppo")


# ----------------------------------------------------------------------------------------------
# Properties (hypothesis).

GRID = st.integers(-40, 40).map(lambda k: k * 0.25)  # exact in float32, with frequent ties
REAL = st.floats(-100.0, 100.0, width=32, allow_subnormal=False)


@st.composite
def grouped(draw, values=REAL, sizes=(1, 2, 3, 4, 8)):
  """(scores [G·n] float32, mask [G·n, T], n), some groups forced degenerate."""
  n = draw(st.sampled_from(sizes))
  groups = draw(st.integers(1, 3))
  scores = []
  for _ in range(groups):
    if draw(st.booleans()):
      scores += [draw(values)] * n  # degenerate: all equal
    else:
      scores += draw(st.lists(values, min_size=n, max_size=n))
  lengths = draw(st.lists(st.integers(0, T), min_size=groups * n, max_size=groups * n))
  mask = np.arange(T)[None, :] < np.asarray(lengths)[:, None]
  return np.asarray(scores, np.float32), mask, n


def _seq(adv):
  """The per-sequence advantages [N] of a call with a one-token full mask."""
  return np.asarray(adv)[:, 0]


def _group_rows(scores, name, n):
  """Estimator ``name``'s sequence advantages as [N/n, n] groups (a one-token full mask)."""
  full = jnp.ones((scores.size, 1), bool)
  return _seq(_group(jnp.asarray(scores), full, name, n)).reshape(-1, n)


@SETTINGS
@given(case=grouped(), name=st.sampled_from(sorted(GROUP_FNS)))
def test_degenerate_groups_are_exactly_zero_never_nan(case, name):
  scores, mask, n = case
  adv = np.asarray(_group(jnp.asarray(scores), jnp.asarray(mask), name, n))
  assert np.all(np.isfinite(adv))
  groups = scores.reshape(-1, n)
  same = np.repeat((groups == groups[:, :1]).all(axis=1), n)
  assert np.all(adv[same] == 0.0)
  assert np.all(adv[~mask] == 0.0)
  if n == 1:
    assert np.all(adv == 0.0)


@SETTINGS
@given(case=grouped(), name=st.sampled_from(sorted(GROUP_FNS)))
def test_group_advantage_is_per_sequence_and_ignores_the_mask(case, name):
  """Each masked token of a row carries the same sequence advantage, whatever the row's length
  (the mask only broadcasts it): the full-mask result restricted to the mask."""
  scores, mask, n = case
  adv = np.asarray(_group(jnp.asarray(scores), jnp.asarray(mask), name, n))
  full = np.asarray(_group(jnp.asarray(scores), jnp.ones_like(jnp.asarray(mask)), name, n))
  np.testing.assert_array_equal(adv, np.where(mask, full, 0.0))
  assert np.all(full == full[:, :1])


@SETTINGS
@given(case=grouped(sizes=(2, 3, 4, 8)))
def test_grpo_groups_have_mean_zero_and_unit_std(case):
  scores, _, n = case
  adv = _group_rows(scores, "grpo", n)
  groups = scores.astype(np.float64).reshape(-1, n)
  for a, g in zip(adv, groups):
    std = g.std(ddof=1)
    assert abs(a.mean()) <= 1e-5 * max(1.0, np.abs(a).max())
    if std > 1e-3:  # (std + eps)/std from 1 by eps/std; float32 rounding of the centring
      np.testing.assert_allclose(a.std(ddof=1), std / (std + 1e-6), rtol=1e-3)


@SETTINGS
@given(case=grouped(sizes=(2, 3, 4, 8)))
def test_rloo_groups_sum_to_zero(case):
  scores, _, n = case
  adv = _group_rows(scores, "rloo", n)
  scale = np.abs(scores).max() + 1.0
  np.testing.assert_allclose(adv.sum(axis=1), 0.0, atol=1e-5 * n * scale)


@SETTINGS
@given(case=grouped(values=GRID, sizes=(1, 2, 4, 8)), shift=GRID.map(lambda x: x * 16),
       name=st.sampled_from(sorted(GROUP_FNS)))
def test_shift_invariance_exact(case, shift, name):
  """On a grid of quarter-integers with power-of-two groups every step is exact in float32, so a
  constant added to every score changes no bit of the advantages."""
  scores, mask, n = case
  a = _group(jnp.asarray(scores), jnp.asarray(mask), name, n)
  b = _group(jnp.asarray(scores + np.float32(shift)), jnp.asarray(mask), name, n)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@SETTINGS
@given(case=grouped(values=st.floats(-10.0, 10.0, width=32, allow_subnormal=False),
                   sizes=(2, 3, 5)),
       shift=st.floats(-50.0, 50.0, width=32, allow_subnormal=False),
       name=st.sampled_from(sorted(GROUP_FNS)))
def test_shift_invariance_per_group(case, shift, name):
  """Shifting one group by a constant changes nothing, also in the other groups (up to float32
  rounding of r + c; GRPO's division by std is checked where std is not tiny)."""
  scores, mask, n = case
  shifted = scores.copy()
  shifted[:n] += np.float32(shift)
  a = np.asarray(_group(jnp.asarray(scores), jnp.asarray(mask), name, n))
  b = np.asarray(_group(jnp.asarray(shifted), jnp.asarray(mask), name, n))
  np.testing.assert_array_equal(a[n:], b[n:])
  g = scores[:n].astype(np.float64)
  if (g == g[0]).all() or (shifted[:n] == shifted[0]).all():
    return  # degenerate before or after the shift: rounding may merge or split equal scores
  tol = 1e-5 * (abs(shift) + 10.0) * n
  if name == "grpo":
    std = g.std(ddof=1)
    if std < 0.1:
      return
    tol /= std
  np.testing.assert_allclose(a[:n], b[:n], atol=tol)


@jax.jit
def _reinforce_pp(rewards, mask, gamma):
  return advantages.reinforce_pp(rewards, mask, gamma)


@SETTINGS
@given(rows=st.integers(1, 4), data=st.data(), gamma=st.floats(0.5, 1.0))
def test_reinforce_pp_padding_invariance(rows, data, gamma):
  lengths = data.draw(st.lists(st.integers(0, T), min_size=rows, max_size=rows))
  mask = np.arange(T)[None, :] < np.asarray(lengths)[:, None]
  values = data.draw(st.lists(st.floats(-5.0, 5.0, width=32), min_size=rows * T,
                              max_size=rows * T))
  junk = data.draw(st.lists(st.sampled_from([np.nan, np.inf, -np.inf, 3e38, 0.0]),
                            min_size=rows * T, max_size=rows * T))
  x = np.asarray(values, np.float32).reshape(rows, T)
  clean = np.where(mask, x, 0.0).astype(np.float32)
  dirty = np.where(mask, x, np.asarray(junk, np.float32).reshape(rows, T)).astype(np.float32)
  out_clean = _reinforce_pp(clean, mask, np.float32(gamma))
  out_dirty = _reinforce_pp(dirty, mask, np.float32(gamma))
  for a, b in zip(out_clean, out_dirty):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.all(np.isfinite(np.asarray(b))) and np.all(np.asarray(b)[~mask] == 0.0)
  adv = np.asarray(out_clean[0])[mask].astype(np.float64)
  ret = np.asarray(out_clean[1])[mask].astype(np.float64)
  if ret.size > 1 and ret.var(ddof=1) > 1e-3:  # whitened over the batch: mean 0, std 1
    assert abs(adv.mean()) < 1e-4 and abs(adv.std(ddof=1) - 1.0) < 1e-3
