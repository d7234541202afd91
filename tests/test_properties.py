"""Property-based tests (hypothesis) for ppojax's array code: ops, kl, rewards, advantages, losses.

Shapes are drawn from a small fixed set so that each jitted helper below compiles only a handful of
times; hyper-parameters are passed as traced arrays wherever the API allows it, for the same
reason. Masks are prefix masks from per-row lengths in [0, T] (length-0 rows are drawn often).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ppojax.core import advantages, correction, kl, logprobs, losses, ops, rewards

SETTINGS = settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

SHAPES = [(1, 1), (1, 8), (2, 3), (4, 1), (4, 8)]  # (B, T): B in {1, 2, 4}, T in {1, 3, 8}
FEW_SHAPES = [(1, 1), (2, 3), (4, 8)]  # for the helpers that are slow to compile
AGGS = ("token_mean", "seq_mean")
F32 = np.float32



def fl(lo, hi):
  """float32 in [lo, hi], without subnormals (XLA on CPU flushes those to 0)."""
  return st.floats(float(F32(lo)), float(F32(hi)), width=32, allow_subnormal=False)


FINITE = fl(-10.0, 10.0)
# Whatever a padded position may hold: NaN, ±Inf, huge, tiny, or any float32 at all.
JUNK = st.one_of(
    st.sampled_from([np.nan, np.inf, -np.inf, 3.0e38, -3.0e38, 1e-30, 0.0]),
    st.floats(width=32),
)


# ------------------------------------------------------------------------------------------------
# Strategies and helpers
# ------------------------------------------------------------------------------------------------


def prefix_mask(lengths, T):
  return np.arange(T)[None, :] < np.asarray(lengths, dtype=np.int64)[:, None]


@st.composite
def shape_and_mask(draw, shapes=None):
  shapes = SHAPES if shapes is None else shapes
  B, T = draw(st.sampled_from(shapes))
  length = st.one_of(st.just(0), st.just(T), st.integers(0, T))
  lengths = draw(st.lists(length, min_size=B, max_size=B))
  return B, T, prefix_mask(lengths, T)


def f32_array(draw, shape, elements=FINITE):
  return draw(hnp.arrays(F32, shape, elements=elements))


@st.composite
def padded_batch(draw, names, elements=FINITE, shapes=None):
  """A mask and, per name, two [B, T] float32 arrays equal on the mask.

  ``clean`` has finite (random) padding, ``junk`` has NaN/±Inf/huge/anything padding.
  """
  B, T, mask = draw(shape_and_mask(shapes))
  clean, junk = {}, {}
  for n in names:
    x = f32_array(draw, (B, T), elements)
    clean[n] = np.where(mask, x, f32_array(draw, (B, T))).astype(F32)
    junk[n] = np.where(mask, x, f32_array(draw, (B, T), JUNK)).astype(F32)
  return mask, clean, junk


def mask_as(mask, kind):
  return mask.astype(np.bool_ if kind == "bool" else np.float32)


def assert_trees_equal(a, b):
  """Bitwise-equal pytrees (NaN == NaN), same structure."""
  la, ta = jax.tree.flatten(a)
  lb, tb = jax.tree.flatten(b)
  assert ta == tb
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def assert_tree_finite(a):
  for x in jax.tree.leaves(a):
    assert np.all(np.isfinite(np.asarray(x))), x


# ------------------------------------------------------------------------------------------------
# 1. Padding invariance: values at masked positions (even NaN/±Inf) change no output or gradient.
# ------------------------------------------------------------------------------------------------


@jax.jit
def _masked_stats_all(x, mask):
  out = {
      "sum": ops.masked_sum(x, mask),
      "sum_rows": ops.masked_sum(x, mask, axis=1),
      "mean": ops.masked_mean(x, mask),
      "mean_rows": ops.masked_mean(x, mask, axis=1),
      "var_unbiased": ops.masked_var(x, mask, unbiased=True),
      "var_biased": ops.masked_var(x, mask, unbiased=False),
      "whiten": ops.masked_whiten(x, mask),
      "whiten_noshift": ops.masked_whiten(x, mask, shift_mean=False),
  }
  for agg in ops.AGGREGATIONS:
    out[agg] = ops.aggregate(x, mask, agg, max_len=8.0)
  return out


@SETTINGS
@given(batch=padded_batch(["x"]), mask_kind=st.sampled_from(["bool", "float"]))
def test_masked_stats_padding_invariance(batch, mask_kind):
  mask, clean, junk = batch
  m = mask_as(mask, mask_kind)
  out_clean = _masked_stats_all(clean["x"], m)
  out_junk = _masked_stats_all(junk["x"], m)
  assert_tree_finite(out_junk)
  assert_trees_equal(out_clean, out_junk)
  # Masked-out positions of the whitened arrays are 0.
  for k in ("whiten", "whiten_noshift"):
    assert np.all(np.asarray(out_junk[k])[~mask] == 0.0)


_STAT_GRADS = {
    "masked_sum": lambda x, m: ops.masked_sum(x, m),
    "masked_mean": lambda x, m: ops.masked_mean(x, m),
    "aggregate_token_mean": lambda x, m: ops.aggregate(x, m, "token_mean"),
    "aggregate_seq_mean": lambda x, m: ops.aggregate(x, m, "seq_mean"),
    "aggregate_seq_mean_token_sum_norm":
        lambda x, m: ops.aggregate(x, m, "seq_mean_token_sum_norm", max_len=8.0),
    "kl_loss_k3": lambda x, m: losses.kl_loss(x, 0.5 * x, m, coef=0.1)[0],
    "kl_loss_k3_seq_mean": lambda x, m: losses.kl_loss(x, 0.5 * x, m, coef=0.1,
                                                       aggregation="seq_mean")[0],
    "masked_var": lambda x, m: ops.masked_var(x, m),
    "masked_whiten": lambda x, m: jnp.sum(jnp.sin(ops.masked_whiten(x, m))),
}


@jax.jit
def _stat_grads_all(x, mask):
  return {name: jax.grad(f)(x, mask) for name, f in _STAT_GRADS.items()}


@pytest.mark.parametrize("name", sorted(_STAT_GRADS))
@settings(SETTINGS, max_examples=25)
@given(batch=padded_batch(["x"]))
def test_masked_stats_gradient_padding_invariance(name, batch):
  """ops' convention: masked-out values are "never read arithmetically ... even NaN/Inf padding is
  inert". The gradient must then be the same whatever the padding holds, and 0 at padding.

  BUG (masked_var, masked_whiten): both compute ``jnp.square(x - mean)`` on the *raw* x before the
  masked mean, so a NaN/Inf at a padded position gives ∂/∂x = 2·(x − μ)·0 = NaN there, which flows
  back through μ into every position: the whole gradient is NaN.
  """
  mask, clean, junk = batch
  g_clean = _stat_grads_all(clean["x"], mask)[name]
  g_junk = _stat_grads_all(junk["x"], mask)[name]
  assert np.all(np.asarray(g_clean)[~mask] == 0.0)
  assert_tree_finite(g_junk)
  assert_trees_equal(g_clean, g_junk)


def test_masked_var_and_whiten_gradient_with_nan_padding_minimal():
  """Minimal reproducer of the bug above (fails): the gradients should be those of the finite
  padding, [[-1, 1, 0]] for the variance of [1, 2], but are all NaN."""
  m = jnp.array([[True, True, False]])
  for pad in (0.0, jnp.nan, jnp.inf):
    x = jnp.array([[1.0, 2.0, pad]])
    np.testing.assert_allclose(jax.grad(lambda x: ops.masked_var(x, m))(x), [[-1.0, 1.0, 0.0]])
    g = jax.grad(lambda x: ops.masked_whiten(x, m)[0, 1])(x)
    assert np.all(np.isfinite(g)) and g[0, 2] == 0.0, (pad, g)


# (estimator, whiten, has_stop + missing_stop_penalty): every estimator and option at least once.
_SHAPE_VARIANTS = [("k1", False, True), ("k2", True, False), ("k3", True, True),
                   ("k3", False, False), ("abs", False, True), ("clamp", True, False)]


@jax.jit
def _shape_rewards_all(scores, logp, ref_logp, mask, beta, has_stop, clip, penalty):
  out = {}
  for est, whiten, stop in _SHAPE_VARIANTS:
    kw = dict(kl_estimator=est, whiten=whiten, score_clip=clip)
    if stop:
      kw.update(has_stop=has_stop, missing_stop_penalty=penalty)
    out[f"{est}/{whiten}/{stop}"] = rewards.shape_rewards(scores, logp, ref_logp, mask, beta, **kw)
  return out


@SETTINGS
@given(
    batch=padded_batch(["logp", "ref_logp"], elements=fl(-20.0, 0.0), shapes=FEW_SHAPES),
    data=st.data(),
    mask_kind=st.sampled_from(["bool", "float"]),
)
def test_shape_rewards_padding_invariance(batch, data, mask_kind):
  mask, clean, junk = batch
  B = mask.shape[0]
  scores = f32_array(data.draw, (B,))
  has_stop = data.draw(hnp.arrays(np.bool_, (B,)))
  beta = F32(data.draw(st.floats(0.0, 1.0)))
  clip = F32(data.draw(st.floats(0.5, 20.0)))
  penalty = F32(data.draw(st.floats(0.0, 5.0)))
  m = mask_as(mask, mask_kind)
  args = (scores, m, beta, has_stop, clip, penalty)
  call = lambda d: _shape_rewards_all(args[0], d["logp"], d["ref_logp"], *args[1:])
  out_clean, out_junk = call(clean), call(junk)
  assert_tree_finite(out_junk)
  assert_trees_equal(out_clean, out_junk)
  for r, _ in out_junk.values():
    assert np.all(np.asarray(r)[~mask] == 0.0)


@jax.jit
def _gae_all(r, v, mask, gamma, lam, last_values):
  out = {}
  for whiten in (False, True):
    out[f"plain/{whiten}"] = advantages.gae(r, v, mask, gamma, lam, whiten=whiten)
    out[f"boot/{whiten}"] = advantages.gae(
        r, v, mask, gamma, lam, whiten=whiten, last_values=last_values)
  return out


@SETTINGS
@given(
    batch=padded_batch(["r", "v"]),
    data=st.data(),
    mask_kind=st.sampled_from(["bool", "float"]),
)
def test_gae_padding_invariance(batch, data, mask_kind):
  mask, clean, junk = batch
  B = mask.shape[0]
  gamma = F32(data.draw(st.floats(0.5, 1.0)))
  lam = F32(data.draw(st.floats(0.0, 1.0)))
  last_values = f32_array(data.draw, (B,))
  # The bootstrap value of an empty row is never read either.
  junk_last = np.where(mask.any(1), last_values, f32_array(data.draw, (B,), JUNK)).astype(F32)
  m = mask_as(mask, mask_kind)
  out_clean = _gae_all(clean["r"], clean["v"], m, gamma, lam, last_values)
  out_junk = _gae_all(junk["r"], junk["v"], m, gamma, lam, junk_last)
  assert_tree_finite(out_junk)
  assert_trees_equal(out_clean, out_junk)
  for adv, ret in out_junk.values():
    assert np.all(np.asarray(adv)[~mask] == 0.0)
    assert np.all(np.asarray(ret)[~mask] == 0.0)


@jax.jit
def _policy_all(logp, old, adv, mask, eps_lo, eps_hi, c):
  out = {}
  for agg in AGGS:
    for dual in (None, c):
      f = lambda lp: losses.policy_loss(
          lp, old, adv, mask, clip_eps_low=eps_lo, clip_eps_high=eps_hi, dual_clip=dual,
          aggregation=agg)
      out[f"{agg}/{dual is None}"] = jax.value_and_grad(f, has_aux=True)(logp)
  return out


@jax.jit
def _value_all(values, old_values, returns, mask, clip):
  out = {}
  for agg in AGGS:
    for c in (None, clip):
      f = lambda v: losses.value_loss(v, old_values, returns, mask, clip_range=c, aggregation=agg)
      out[f"{agg}/{c is None}"] = jax.value_and_grad(f, has_aux=True)(values)
  return out


@jax.jit
def _entropy_all(entropy, mask):
  return {agg: jax.value_and_grad(lambda e: losses.entropy_bonus(e, mask, agg))(entropy)
          for agg in AGGS}


@jax.jit
def _ppo_all(logp, old_logp, adv, values, old_values, returns, mask, entropy, ent_coef):
  out = {}
  for agg in AGGS:
    f = lambda lp, v, e: losses.ppo_loss(
        lp, old_logp, adv, v, old_values, returns, mask, e, ent_coef=ent_coef, aggregation=agg)
    out[agg] = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(logp, values, entropy)
  return out


LOSS_INPUTS = ["logp", "old_logp", "adv", "values", "old_values", "returns", "entropy"]


@SETTINGS
@given(
    batch=padded_batch(LOSS_INPUTS, elements=fl(-3.0, 3.0), shapes=FEW_SHAPES),
    eps_lo=st.floats(0.05, 0.5),
    eps_hi=st.floats(0.05, 0.5),
    dual=st.floats(1.5, 5.0),
    vclip=st.floats(0.05, 1.0),
    ent_coef=st.floats(0.0, 0.1),
)
def test_losses_and_gradients_padding_invariance(batch, eps_lo, eps_hi, dual, vclip, ent_coef):
  mask, clean, junk = batch
  m = mask.astype(np.float32)  # a {0, 1} float mask here; bool masks in the other tests
  eps_lo, eps_hi, dual, vclip, ent_coef = map(F32, (eps_lo, eps_hi, dual, vclip, ent_coef))

  def all_losses(d):
    return {
        "policy": _policy_all(d["logp"], d["old_logp"], d["adv"], m, eps_lo, eps_hi, dual),
        "value": _value_all(d["values"], d["old_values"], d["returns"], m, vclip),
        "entropy": _entropy_all(d["entropy"], m),
        "ppo": _ppo_all(*(d[k] for k in LOSS_INPUTS[:6]), m, d["entropy"], ent_coef),
    }

  out_clean, out_junk = all_losses(clean), all_losses(junk)
  assert_tree_finite(out_junk)
  assert_trees_equal(out_clean, out_junk)
  # The gradients at padded positions are exactly 0.
  grads = [g for _, g in out_junk["policy"].values()] + [g for _, g in out_junk["value"].values()]
  grads += [g for _, g in out_junk["entropy"].values()]
  grads += [g for _, gs in out_junk["ppo"].values() for g in gs]
  for g in grads:
    assert np.all(np.asarray(g)[~mask] == 0.0)


# ------------------------------------------------------------------------------------------------
# 2. GAE with γ = λ = 1 and a single terminal reward
# ------------------------------------------------------------------------------------------------


@jax.jit
def _gae_terminal(r, v, mask, last_values, scores, logp):
  return (advantages.gae(r, v, mask, 1.0, 1.0),
          advantages.gae(r, v, mask, 1.0, 1.0, last_values=last_values),
          rewards.shape_rewards(scores, logp, logp, mask, 0.0)[0])


@SETTINGS
@given(batch=padded_batch(["v", "logp", "pad"], shapes=FEW_SHAPES), data=st.data())
def test_gae_terminal_reward_telescopes(batch, data):
  mask, _, junk = batch
  B, T = mask.shape
  R = f32_array(data.draw, (B,))
  last_values = f32_array(data.draw, (B,))
  lengths = mask.sum(1)
  # Reward R on the last response token, 0 elsewhere on the mask, junk on the padding.
  r = np.where(mask, F32(0.0), junk["pad"]).astype(F32)
  for b, n in enumerate(lengths):
    if n:
      r[b, n - 1] = R[b]
  v = junk["v"]
  (adv, ret), (adv_b, ret_b), shaped = _gae_terminal(r, v, mask, last_values, R, junk["logp"])
  exp_adv = np.where(mask, R[:, None].astype(np.float64) - v, 0.0)
  np.testing.assert_allclose(adv, exp_adv, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(ret, np.where(mask, R[:, None], 0.0), rtol=1e-5, atol=1e-4)
  # Bootstrapping V(s_end+1) = L adds L to every advantage and return of the row.
  boot = (R + last_values.astype(np.float64))[:, None]
  np.testing.assert_allclose(adv_b, np.where(mask, boot - v, 0.0), rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(ret_b, np.where(mask, boot, 0.0), rtol=1e-5, atol=1e-4)

  # shape_rewards with β = 0 puts exactly that reward vector on the mask.
  np.testing.assert_array_equal(np.asarray(shaped), np.where(mask, r, 0.0))


# ------------------------------------------------------------------------------------------------
# 3. Policy-loss gradient: exactly 0 where the clip is active in the advantage's favour
# ------------------------------------------------------------------------------------------------


@jax.jit
def _policy_grads(logp, old, adv, mask, eps, eps_lo, eps_hi, c):
  out = {}
  for agg in AGGS:
    variants = {
        "sym": dict(clip_eps=eps),
        "asym": dict(clip_eps_low=eps_lo, clip_eps_high=eps_hi),
        "asym_dual": dict(clip_eps_low=eps_lo, clip_eps_high=eps_hi, dual_clip=c),
        "sym_dual": dict(clip_eps=eps, dual_clip=c),
    }
    for name, kw in variants.items():
      f = lambda lp: losses.policy_loss(lp, old, adv, mask, aggregation=agg, **kw)[0]
      out[agg, name] = jax.grad(f)(logp)
  return out


ADV = st.one_of(st.just(0.0), fl(0.01, 10.0), fl(-10.0, -0.01))


@settings(SETTINGS, max_examples=60)
@given(
    sm=shape_and_mask(),
    data=st.data(),
    eps=st.floats(0.05, 0.5),
    eps_lo=st.floats(0.05, 0.5),
    eps_hi=st.floats(0.05, 0.5),
    c=st.floats(1.05, 3.0),
)
def test_policy_gradient_zero_exactly_where_clipped(sm, data, eps, eps_lo, eps_hi, c):
  B, T, mask = sm
  old = f32_array(data.draw, (B, T), fl(-10.0, 0.0))
  log_ratio = f32_array(data.draw, (B, T), st.one_of(fl(-2.0, 2.0), fl(1.0, 2.0)))
  adv = f32_array(data.draw, (B, T), ADV)
  logp = (old + log_ratio).astype(F32)
  eps, eps_lo, eps_hi, c = map(F32, (eps, eps_lo, eps_hi, c))
  grads = _policy_grads(logp, old, adv, mask, eps, eps_lo, eps_hi, c)

  ratio = np.exp((logp - old).astype(np.float64))
  n_tok = mask.sum()
  rows = mask.sum(1)
  n_rows = (rows > 0).sum()
  for (agg, name), g in grads.items():
    g = np.asarray(g)
    lo = 1.0 - float(eps if name.startswith("sym") else eps_lo)
    hi = 1.0 + float(eps if name.startswith("sym") else eps_hi)
    dual = name.endswith("dual")
    bounds = [lo, hi] + ([float(c)] if dual else [])
    near = np.zeros_like(mask)
    for b in bounds:  # the side of a boundary is ill-defined within float32 rounding
      near |= np.abs(ratio - b) <= 1e-4 * b
    zero = (
        ~mask
        | (adv == 0)
        | ((adv > 0) & (ratio > hi))
        | ((adv < 0) & (ratio < lo))
        | ((adv < 0) & (ratio > float(c)) & dual)
    )
    check = ~near
    for label, sel in [("A>0 clipped high", (adv > 0) & (ratio > hi)),
                       ("A<0 clipped low", (adv < 0) & (ratio < lo)),
                       ("A<0 dual-clipped", (adv < 0) & (ratio > float(c)) & dual),
                       ("A<0 above 1+eps_high, below c", (adv < 0) & (ratio > hi)
                        & (ratio < float(c)) & dual)]:
      if np.any(sel & mask & check):
        event(label)
    assert np.all(g[zero & check] == 0.0), (agg, name, g, ratio, adv)
    live = ~zero & check
    assert np.all(g[live] != 0.0), (agg, name, g, ratio, adv)
    # ... and equal to ∂(−A·ρ)/∂logp / weight, the unclipped surrogate's gradient.
    if agg == "token_mean":
      weight = np.broadcast_to(max(n_tok, 1), mask.shape)
    else:
      weight = np.maximum(rows, 1)[:, None] * max(n_rows, 1) * np.ones(mask.shape)
    np.testing.assert_allclose(g[live], (-adv * ratio / weight)[live], rtol=1e-4)


# ------------------------------------------------------------------------------------------------
# 4. Whitening: mean 0, unbiased variance 1 over the mask
# ------------------------------------------------------------------------------------------------


def _whitenable(x, mask):
  xs = np.asarray(x, np.float64)[mask]
  if xs.size < 2:
    return False
  var = xs.var(ddof=1)
  return var > 1e-4 and math.sqrt(var) > 1e-2 * np.abs(xs).max()


@jax.jit
def _whiten_both(x, mask):
  return ops.masked_whiten(x, mask), ops.masked_whiten(x, mask, shift_mean=False)


@SETTINGS
@given(batch=padded_batch(["x"], elements=fl(-100.0, 100.0)))
def test_masked_whiten_mean0_var1(batch):
  mask, _, junk = batch
  x = junk["x"]
  assume(_whitenable(x, mask))
  w, w_noshift = (np.asarray(a, np.float64) for a in _whiten_both(x, mask))
  xs = np.asarray(x, np.float64)[mask]
  assert abs(w[mask].mean()) < 1e-3
  np.testing.assert_allclose(w[mask].var(ddof=1), 1.0, rtol=1e-3)
  np.testing.assert_allclose(w, np.where(mask, (np.asarray(x, np.float64) - xs.mean())
                                         / xs.std(ddof=1), 0.0), rtol=1e-3, atol=1e-3)
  # shift_mean=False: variance 1, the mean is kept.
  np.testing.assert_allclose(w_noshift[mask].mean(), xs.mean(), rtol=1e-3, atol=1e-3)
  np.testing.assert_allclose(w_noshift[mask].var(ddof=1), 1.0, rtol=1e-3)
  assert np.all(w[~mask] == 0.0) and np.all(w_noshift[~mask] == 0.0)


@jax.jit
def _gae_whiten_pair(r, v, mask, gamma, lam):
  return (advantages.gae(r, v, mask, gamma, lam),
          advantages.gae(r, v, mask, gamma, lam, whiten=True))


@SETTINGS
@given(batch=padded_batch(["r", "v"]), gamma=st.floats(0.5, 1.0), lam=st.floats(0.0, 1.0))
def test_gae_whiten_mean0_var1(batch, gamma, lam):
  mask, _, junk = batch
  (raw, ret), (white, ret_w) = _gae_whiten_pair(junk["r"], junk["v"], mask, F32(gamma), F32(lam))
  assume(_whitenable(raw, mask))
  white = np.asarray(white, np.float64)
  assert abs(white[mask].mean()) < 1e-3
  np.testing.assert_allclose(white[mask].var(ddof=1), 1.0, rtol=1e-3)
  assert np.all(white[~mask] == 0.0)
  # Returns come from the raw advantages, whatever `whiten` says.
  np.testing.assert_array_equal(np.asarray(ret), np.asarray(ret_w))


# ------------------------------------------------------------------------------------------------
# 5. Stop-token masks, with pad_id == eos_id and several stop ids
# ------------------------------------------------------------------------------------------------

VOCAB = 10


@jax.jit
def _stop_ops(tokens, stop_ids, pad_id):
  trunc = ops.truncate_after_stop(tokens, stop_ids, pad_id)
  return {
      "mask": ops.response_mask(tokens, stop_ids),
      "has_stop": ops.has_stop_token(tokens, stop_ids),
      "trunc": trunc,
      "trunc2": ops.truncate_after_stop(trunc, stop_ids, pad_id),
      "mask_trunc": ops.response_mask(trunc, stop_ids),
      "last_index": ops.last_index(ops.response_mask(tokens, stop_ids)),
      "last_token": ops.last_token_mask(ops.response_mask(tokens, stop_ids)),
  }


@st.composite
def stop_ids_strategy(draw):
  stops = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=3, unique=True))
  return np.asarray(stops, np.int32)


@SETTINGS
@given(sm=shape_and_mask(), stops=stop_ids_strategy(), data=st.data())
def test_response_mask_pad_equals_eos(sm, stops, data):
  """Rows `content…, stop, eos, eos, …` (the padding is the EOS id): the first stop is inside the
  mask, every position after it is out; rows without a stop (length limit) are all response."""
  B, T, content = sm  # `content` marks the content tokens; position len(content) gets the stop
  eos = int(data.draw(st.sampled_from(list(stops))))
  non_stop = [i for i in range(VOCAB) if i not in set(stops.tolist())]
  tokens = np.full((B, T), eos, np.int32)
  lengths = content.sum(1)
  for b in range(B):
    for t in range(lengths[b]):
      tokens[b, t] = data.draw(st.sampled_from(non_stop))
    if lengths[b] < T:
      tokens[b, lengths[b]] = data.draw(st.sampled_from(list(stops)))
  out = _stop_ops(tokens, stops, np.int32(eos))
  expected = np.arange(T)[None, :] <= lengths[:, None]  # content + the stop token
  np.testing.assert_array_equal(out["mask"], expected)
  np.testing.assert_array_equal(out["has_stop"], lengths < T)
  np.testing.assert_array_equal(out["last_index"], np.minimum(lengths, T - 1))
  np.testing.assert_array_equal(out["last_token"], np.arange(T)[None, :] == np.minimum(
      lengths, T - 1)[:, None])
  # Already truncated: truncation is a no-op and keeps the mask.
  np.testing.assert_array_equal(out["trunc"], tokens)
  np.testing.assert_array_equal(out["mask_trunc"], expected)
  # A Python list of stop ids works the same (eagerly).
  np.testing.assert_array_equal(ops.response_mask(jnp.asarray(tokens), stops.tolist()), expected)


def _first_stop_mask(tokens, stops):
  B, T = tokens.shape
  mask = np.ones((B, T), bool)
  for b in range(B):
    for t in range(T):
      if tokens[b, t] in stops:
        mask[b, t + 1:] = False
        break
  return mask


@SETTINGS
@given(
    shape=st.sampled_from(SHAPES),
    stops=stop_ids_strategy(),
    pad_id=st.integers(0, VOCAB - 1),
    data=st.data(),
)
def test_response_mask_random_rows(shape, stops, pad_id, data):
  tokens = data.draw(hnp.arrays(np.int32, shape, elements=st.integers(0, VOCAB - 1)))
  out = _stop_ops(tokens, stops, np.int32(pad_id))
  mask = _first_stop_mask(tokens, set(stops.tolist()))
  np.testing.assert_array_equal(out["mask"], mask)
  np.testing.assert_array_equal(
      out["has_stop"], np.isin(tokens, stops).any(1))
  trunc = np.asarray(out["trunc"])
  np.testing.assert_array_equal(trunc[mask], tokens[mask])
  assert np.all(trunc[~mask] == pad_id)
  np.testing.assert_array_equal(out["trunc2"], trunc)  # idempotent
  np.testing.assert_array_equal(out["mask_trunc"], mask)  # the mask survives truncation


# ------------------------------------------------------------------------------------------------
# 6. bf16 logits: selective_log_softmax (and entropy) against float64 NumPy
# ------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("chunk",))
def _logp_entropy(logits, tokens, temperature, chunk):
  return (logprobs.selective_log_softmax(logits, tokens, temperature, chunk_size=chunk),
          logprobs.entropy_from_logits(logits, temperature, chunk_size=chunk))


@st.composite
def logits_case(draw):
  B, T = draw(st.sampled_from(SHAPES))
  V = draw(st.sampled_from([5, 300]))
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
  scale = draw(st.floats(0.0, 20.0))
  z = rng.uniform(-scale, scale, (B, T, V))
  for _ in range(draw(st.integers(0, 4))):  # spikes: a dominant (or very unlikely) logit
    z[draw(st.integers(0, B - 1)), draw(st.integers(0, T - 1)), draw(st.integers(0, V - 1))] = (
        draw(st.sampled_from([-20.0, 20.0])))
  tokens = rng.integers(0, V, (B, T)).astype(np.int32)
  if draw(st.booleans()):  # pick the argmax token (the likely case when sampling)
    tokens = np.argmax(z, -1).astype(np.int32)
  return z, tokens


@SETTINGS
@given(
    case=logits_case(),
    temperature=st.sampled_from([1.0, 0.7]),
    chunk=st.sampled_from([1024, 3]),
)
def test_bf16_selective_log_softmax_matches_float64(case, temperature, chunk):
  z, tokens = case
  logits = jnp.asarray(z, jnp.bfloat16)
  logp, ent = _logp_entropy(logits, tokens, F32(temperature), chunk)
  assert logp.dtype == jnp.float32 and ent.dtype == jnp.float32
  zz = np.asarray(logits.astype(jnp.float32), np.float64) / temperature  # bf16-rounded values
  mx = zz.max(-1, keepdims=True)
  lse = (mx + np.log(np.exp(zz - mx).sum(-1, keepdims=True)))[..., 0]
  ref = np.take_along_axis(zz, tokens[..., None], -1)[..., 0] - lse
  np.testing.assert_allclose(np.asarray(logp), ref, rtol=0, atol=1e-2)
  p = np.exp(zz - lse[..., None])
  ref_ent = lse - (p * zz).sum(-1)
  np.testing.assert_allclose(np.asarray(ent), ref_ent, rtol=0, atol=1e-2)


@functools.partial(jax.jit, static_argnames=("chunk",))
def _logp_entropy_grads(logits, tokens, temperature, w, chunk):
  def f(z, t):
    return jnp.sum(w * (logprobs.selective_log_softmax(z, tokens, t, chunk_size=chunk)
                        + logprobs.entropy_from_logits(z, t, chunk_size=chunk)))
  return jax.grad(f, argnums=(0, 1))(logits, temperature)


@settings(SETTINGS, max_examples=30)
@given(
    case=logits_case(),
    temperature=st.sampled_from([1.0, 0.7]),
    chunk=st.sampled_from([1024, 3]),
    data=st.data(),
)
def test_minus_inf_logits_are_inert(case, temperature, chunk, data):
  """Logits of −inf (top-k / vocabulary masking) give the log-probs and entropy of the remaining
  entries, and finite gradients (0 at the −inf entries)."""
  z, tokens = case
  V = z.shape[-1]
  banned = data.draw(hnp.arrays(np.bool_, (V,)))
  banned[tokens.reshape(-1)] = False  # the sampled tokens stay possible
  event("some logits are -inf" if banned.any() else "no -inf logit")
  z = np.where(banned, -np.inf, z).astype(F32)
  logp, ent = _logp_entropy(z, tokens, F32(temperature), chunk)
  zz = np.where(banned, -np.inf, z.astype(np.float64) / temperature)
  mx = zz.max(-1, keepdims=True)
  lse = (mx + np.log(np.exp(zz - mx).sum(-1, keepdims=True)))[..., 0]
  ref = np.take_along_axis(zz, tokens[..., None], -1)[..., 0] - lse
  np.testing.assert_allclose(np.asarray(logp), ref, rtol=1e-5, atol=1e-4)
  lp = zz - lse[..., None]
  ref_ent = -np.where(banned, 0.0, np.exp(lp) * np.where(banned, 0.0, lp)).sum(-1)
  np.testing.assert_allclose(np.asarray(ent), ref_ent, rtol=1e-4, atol=1e-4)
  w = np.ones(tokens.shape, F32)
  g_z, g_t = _logp_entropy_grads(z, tokens, F32(temperature), w, chunk)
  g_z = np.asarray(g_z)
  assert np.all(np.isfinite(g_z)) and np.isfinite(float(g_t))
  assert np.all(g_z[..., banned] == 0.0)


# ------------------------------------------------------------------------------------------------
# 7. KL estimators and controllers
# ------------------------------------------------------------------------------------------------

ESTIMATORS = ("k1", "kl", "k2", "mse", "k3", "abs", "clamp")


@jax.jit
def _all_kl(logp, ref_logp):
  return {name: kl.per_token_kl(logp, ref_logp, name) for name in ESTIMATORS}


DELTA = st.one_of(fl(-30.0, 30.0), fl(-(2.0**-20), 2.0**-20))


@SETTINGS
@given(shape=st.sampled_from(SHAPES), data=st.data())
def test_kl_estimators_nonnegative_and_zero_at_equality(shape, data):
  logp = data.draw(hnp.arrays(F32, shape, elements=fl(-30.0, 0.0)))
  delta = data.draw(hnp.arrays(F32, shape, elements=DELTA))
  ref = (logp - delta).astype(F32)
  out = {k: np.asarray(v) for k, v in _all_kl(logp, ref).items()}
  for name in ("k2", "mse", "k3", "abs", "clamp"):
    assert np.all(out[name] >= 0.0), (name, out[name])
  d = (logp - ref).astype(np.float64)  # float32 Δ, exactly as the estimators see it
  np.testing.assert_allclose(out["k1"], d, rtol=1e-6)
  np.testing.assert_allclose(out["k2"], 0.5 * d**2, rtol=1e-5, atol=1e-30)
  np.testing.assert_allclose(out["k3"], np.expm1(-d) + d, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(out["abs"], np.abs(d), rtol=1e-6)
  np.testing.assert_allclose(out["clamp"], np.maximum(d, 0.0), rtol=1e-6)
  for name in ESTIMATORS:  # every estimator is exactly 0 when the policies agree
    assert np.all(np.asarray(_all_kl(logp, logp)[name]) == 0.0), name


@SETTINGS
@given(
    init_beta=st.floats(1e-3, 1.0),
    target=st.floats(0.1, 20.0),
    horizon=st.floats(100.0, 1e5),
    steps=st.lists(st.tuples(st.floats(0.0, 100.0), st.floats(1e-3, 1.0)), min_size=1,
                   max_size=6),
)
def test_adaptive_kl_controller_positive_and_moves_towards_target(init_beta, target, horizon,
                                                                   steps):
  """β stays > 0 and moves in the sign of (KL − target), for n_steps ≤ horizon."""
  ctrl = kl.adaptive_kl_controller(init_beta, target, horizon)
  update = jax.jit(ctrl.update)
  state = ctrl.init()
  for kl_value, frac in steps:
    n_steps = F32(max(1.0, round(frac * horizon)))
    new = update(state, F32(kl_value), n_steps)
    old_b, new_b = float(state.beta), float(new.beta)
    assert new_b > 0.0
    rel = kl_value / target - 1.0
    if abs(rel) > 1e-3 and n_steps / horizon > 1e-3:
      assert np.sign(new_b - old_b) == np.sign(rel), (old_b, new_b, kl_value, target)
    elif kl_value == target:  # unchanged up to rounding (XLA may turn KL/target into KL·(1/target))
      assert abs(new_b / old_b - 1.0) <= 1e-6
    state = new
  fixed = kl.fixed_kl_controller(init_beta)
  assert float(fixed.update(fixed.init(), F32(steps[0][0]), 10).beta) == F32(init_beta)


def test_adaptive_kl_controller_exact_target_keeps_beta():
  ctrl = kl.adaptive_kl_controller(0.05, 6.0, 10000)
  for update in (ctrl.update, jax.jit(ctrl.update)):
    state = update(ctrl.init(), F32(6.0), 512)
    np.testing.assert_allclose(float(state.beta), 0.05, rtol=1e-6)


def test_adaptive_kl_controller_large_step_keeps_beta_positive():
  """β·(1 + e·n/horizon) with e = −0.2 would turn β ≤ 0 once n_steps ≥ 5·horizon (Ziegler et al.,
  trl); the factor is floored at ½ instead."""
  ctrl = kl.adaptive_kl_controller(0.1, 6.0, 10.0)
  state = ctrl.update(ctrl.init(), F32(0.0), 64)  # KL far below target, n_steps = 6.4·horizon
  np.testing.assert_allclose(float(state.beta), 0.05, rtol=1e-6)


def test_adaptive_kl_controller_refuses_zero_target_or_horizon_and_takes_small_ones():
  """target ≤ 0 or horizon ≤ 0 raises (KL/target and n/horizon would divide by 0 or flip the
  rule's sign); target = horizon = 0.5 is accepted and follows the rule, checked in float64:
  β·max(1 + clip(KL/target − 1, ±0.2)·n/horizon, ½)."""
  for target, horizon in ((0.0, 1.0), (1.0, 0.0), (-1.0, 1.0), (1.0, -1.0)):
    with pytest.raises(ValueError, match="target > 0 and horizon > 0"):
      kl.adaptive_kl_controller(0.1, target, horizon)
  ctrl = kl.adaptive_kl_controller(0.1, 0.5, 0.5)
  beta = 0.1
  state = ctrl.init()
  for kl_value, n in ((0.55, 1), (0.45, 1), (0.4, 2), (5.0, 1)):
    e = min(max(kl_value / 0.5 - 1.0, -0.2), 0.2)
    beta = beta * max(1.0 + e * n / 0.5, 0.5)
    state = ctrl.update(state, F32(kl_value), n)
    np.testing.assert_allclose(float(state.beta), beta, rtol=1e-5)


def test_loss_targets_are_constants_no_gradient_reaches_them():
  """The targets of each loss are constants (stop_gradient): the gradient with respect to
  old_logp and the advantages (policy_loss), old values and returns (value_loss), the reference
  log-probs (kl_loss) and the importance weights is exactly 0, whatever the inputs."""
  rng = np.random.default_rng(5)
  shape = (3, 4)
  mask = jnp.asarray(prefix_mask([4, 2, 3], 4))
  x = [jnp.asarray(rng.normal(size=shape).astype(F32)) for _ in range(4)]
  w = jnp.asarray(rng.uniform(0.5, 1.5, size=shape).astype(F32))

  def zero(g):
    np.testing.assert_array_equal(np.asarray(g), np.zeros(shape, F32))

  grads = jax.grad(lambda old, adv, w: losses.policy_loss(
      x[0], old, adv, mask, clip_eps=0.1, is_weight=w)[0], argnums=(0, 1, 2))(x[1], x[2], w)
  for g in grads:
    zero(g)
  clip_range = 0.1
  for clip in (clip_range, None):
    grads = jax.grad(lambda old, ret, c=clip: losses.value_loss(
        x[0], old, ret, mask, clip_range=c)[0], argnums=(0, 1))(x[1], x[2])
    for g in grads:
      zero(g)
  for est in ("k1", "k3"):
    zero(jax.grad(lambda ref, e=est: losses.kl_loss(x[0], ref, mask, coef=0.5, estimator=e)[0])(
        x[1]))
  zero(jax.grad(lambda old, smp: jnp.sum(correction.is_weight(old, smp, mask, 1.2)[0]))(
      x[1], x[2]))


def test_value_clipfrac_counts_only_a_strictly_larger_clipped_error():
  """value_loss by hand, with a tie: V = 2, V_old = 0, c = 0.5, R = 1.25 gives V_clip = 0.5 and
  (V − R)² = (V_clip − R)² = 0.5625 exactly, which is not clipping (the clipped error must be the
  larger); the loss and clipfrac against a float64 loop."""
  values = np.array([[2.0, 0.25, -1.0, 1.0]], F32)
  old = np.zeros((1, 4), F32)
  returns = np.array([[1.25, 0.0, 0.0, 3.0]], F32)
  c = 0.5
  terms, active = [], []
  for v, vo, r in zip(values[0].astype(float), old[0].astype(float), returns[0].astype(float)):
    v_clip = vo + min(max(v - vo, -c), c)
    err, err_clip = (v - r) ** 2, (v_clip - r) ** 2
    terms.append(max(err, err_clip))
    active.append(abs(v - vo) > c and err_clip > err)
  loss, metrics = losses.value_loss(jnp.asarray(values), jnp.asarray(old), jnp.asarray(returns),
                                    jnp.ones((1, 4), bool), clip_range=c)
  assert active == [False, False, False, True]
  np.testing.assert_allclose(float(loss), 0.5 * np.mean(terms), rtol=1e-6)
  assert float(metrics["clipfrac"]) == 0.25


def test_policy_gradient_dual_clip_examples():
  """A < 0: with dual clip c the gradient is 0 above c, nonzero between 1 + ε_high and c."""
  old = jnp.zeros((1, 4))
  logp = jnp.log(jnp.array([[0.5, 1.1, 2.0, 5.0]]))  # ρ = 0.5, 1.1, 2, 5
  adv = -jnp.ones((1, 4))
  mask = jnp.ones((1, 4), bool)
  g = jax.grad(lambda lp: losses.policy_loss(lp, old, adv, mask, dual_clip=3.0)[0])(logp)
  np.testing.assert_allclose(g, [[0.0, 1.1 / 4, 2.0 / 4, 0.0]], rtol=1e-6)
  assert g[0, 0] == 0.0 and g[0, 3] == 0.0
  g = jax.grad(lambda lp: losses.policy_loss(lp, old, adv, mask)[0])(logp)
  np.testing.assert_allclose(g, [[0.0, 1.1 / 4, 2.0 / 4, 5.0 / 4]], rtol=1e-6)
