"""Every public function of ppojax against the float64 NumPy references in ``reference.py``.

Random inputs, ragged prefix masks (with an empty and a full row where the batch allows), several
shapes. JAX computes in float32 on CPU; outputs are compared at ~1e-5 unless noted.
"""

from __future__ import annotations

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import reference as ref  # noqa: E402

from ppojax.core import advantages, kl, logprobs, losses, ops, rewards  # noqa: E402

SHAPES = [(1, 1), (3, 7), (8, 33), (5, 64)]
SEEDS = [0, 1]
AGGS = ["token_mean", "seq_mean", "seq_mean_token_sum_norm"]  # for the losses
AGG_MODES = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "seq_mean"]
ML = 80.0  # seq_mean_token_sum_norm's constant (a maximum response length ≥ every T here)

RTOL = 1e-5
ATOL = 1e-5


# ----------------------------------------------------------------------------------------------
# Helpers.


def _rng(shape, seed, salt=0):
  return np.random.default_rng([seed, shape[0], shape[1], salt])


def prefix_mask(rng, B, T, empty_row=True):
  """Random response-length prefix mask; for B ≥ 2 one row is empty (if asked) and one is full."""
  lengths = rng.integers(0, T + 1, size=B)
  if B == 1:
    lengths[0] = T
  else:
    lengths[1] = T
    if empty_row:
      lengths[0] = 0
    lengths = rng.permutation(lengths)
  return np.arange(T)[None, :] < lengths[:, None]


def f32(x):
  """float32 JAX array and the exact same values as float64 NumPy."""
  a = jnp.asarray(np.asarray(x), jnp.float32)
  return a, np.asarray(a, np.float64)


def poison(x, mask, value=np.nan):
  """x with every masked-out entry replaced by ``value`` (padding must never be read)."""
  return np.where(mask, x, value)


def close(actual, expected, rtol=RTOL, atol=ATOL, err_msg=""):
  np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(expected, np.float64),
                             rtol=rtol, atol=atol, err_msg=err_msg)


def as_mask(m, kind):
  if kind == "bool":
    return jnp.asarray(m, bool)
  if kind == "int":
    return jnp.asarray(m, jnp.int32)
  return jnp.asarray(m, jnp.float32)


# ----------------------------------------------------------------------------------------------
# ops: masked statistics.


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mask_kind", ["bool", "int", "float"])
def test_masked_sum_count_mean(shape, seed, mask_kind):
  rng = _rng(shape, seed)
  m = prefix_mask(rng, *shape)
  x64 = rng.normal(size=shape) * 3 + 1
  x, x64 = f32(poison(x64, m))
  x64 = np.where(m, x64, np.nan)
  mj = as_mask(m, mask_kind)
  for axis in [None, 0, 1, -1]:
    close(ops.masked_sum(x, mj, axis=axis), ref.masked_sum(x64, m, axis), err_msg=str(axis))
    cnt = ops.masked_count(mj, axis=axis)
    assert cnt.dtype == jnp.float32
    close(cnt, ref.masked_count(m, axis), err_msg=str(axis))
    close(ops.masked_mean(x, mj, axis=axis), ref.masked_mean(x64, m, axis), err_msg=str(axis))


def test_masked_mean_empty_mask_is_zero():
  x = jnp.full((3, 4), jnp.nan)
  m = jnp.zeros((3, 4), bool)
  assert float(ops.masked_mean(x, m)) == 0.0
  np.testing.assert_array_equal(np.asarray(ops.masked_mean(x, m, axis=1)), np.zeros(3))
  assert float(ops.masked_sum(x, m)) == 0.0
  assert float(ops.masked_count(m)) == 0.0
  assert float(ops.masked_var(x, m)) == 0.0
  np.testing.assert_array_equal(np.asarray(ops.masked_whiten(x, m)), np.zeros((3, 4)))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("unbiased", [True, False])
def test_masked_var(shape, seed, unbiased):
  rng = _rng(shape, seed)
  m = prefix_mask(rng, *shape)
  x, x64 = f32(poison(rng.normal(size=shape) * 2 - 0.5, m))
  close(ops.masked_var(x, m, unbiased=unbiased), ref.masked_var(x64, m, unbiased), rtol=1e-4)


def test_masked_var_single_element_no_bessel():
  x = jnp.array([[3.0, 5.0, 7.0]])
  m = jnp.array([[True, False, False]])
  assert float(ops.masked_var(x, m, unbiased=True)) == 0.0
  m2 = jnp.array([[True, True, False]])
  close(ops.masked_var(x, m2, unbiased=True), 2.0)   # ((3-4)² + (5-4)²)/1
  close(ops.masked_var(x, m2, unbiased=False), 1.0)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten(shape, seed, shift_mean):
  rng = _rng(shape, seed)
  m = prefix_mask(rng, *shape)
  x, x64 = f32(poison(rng.normal(size=shape) * 2 + 3, m))
  out = ops.masked_whiten(x, m, shift_mean=shift_mean)
  expected = ref.masked_whiten(x64, m, shift_mean)
  close(out, expected, rtol=1e-4, atol=1e-4)
  assert np.all(np.asarray(out)[~m] == 0)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate(shape, seed, mode):
  rng = _rng(shape, seed)
  m = prefix_mask(rng, *shape)
  x, x64 = f32(poison(rng.normal(size=shape), m))
  expected = ref.aggregate(x64, m, mode, ML)
  close(ops.aggregate(x, m, mode, ML), expected)
  close(ops.aggregate(x, as_mask(m, "float"), mode, max_len=ML), expected)
  g = jax.grad(lambda v: ops.aggregate(v, jnp.asarray(m), mode, ML))(x)
  close(g, ref.aggregate_weights(m, mode, ML))


def test_aggregate_by_hand():
  """Two rows of 1 and 3 tokens: token_mean weighs tokens, seq_mean_token_mean rows,
  seq_mean_token_sum_norm sums each row over the constant."""
  x = jnp.array([[4.0, 9.0, 9.0], [1.0, 2.0, 3.0]])
  m = jnp.array([[True, False, False], [True, True, True]])
  close(ops.aggregate(x, m, "token_mean"), 10.0 / 4)
  close(ops.aggregate(x, m, "seq_mean_token_mean"), (4.0 + 2.0) / 2)
  close(ops.aggregate(x, m, "seq_mean"), (4.0 + 2.0) / 2)
  close(ops.aggregate(x, m, "seq_mean_token_sum_norm", max_len=8), (4.0 / 8 + 6.0 / 8) / 2)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_empty_mask(mode):
  x = jnp.full((2, 3), jnp.nan)
  m = jnp.zeros((2, 3), bool)
  assert float(ops.aggregate(x, m, mode, ML)) == 0.0
  assert float(ops.aggregation_count(m, mode)) == 0.0


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregation_count_splits_exactly(mode):
  """Σ_k count_k/count · aggregate(part k) = aggregate(all): the micro-batch weights of gradient
  accumulation (update._micro_weight) for every mode; parts with empty rows included."""
  rng = _rng((8, 9), 0, salt=21)
  m = prefix_mask(rng, 8, 9)
  x, x64 = f32(poison(rng.normal(size=(8, 9)), m))
  mj = jnp.asarray(m)
  total = ops.aggregation_count(mj, mode)
  expected = {"token_mean": m.sum()}.get(mode, m.any(axis=1).sum())
  assert float(total) == expected
  parts = [slice(0, 2), slice(2, 3), slice(3, 8)]
  acc = sum(ops.aggregation_count(mj[p], mode) / total * ops.aggregate(x[p], mj[p], mode, ML)
            for p in parts)
  close(acc, ref.aggregate(x64, m, mode, ML))


def test_aggregate_sum_norm_needs_max_len():
  x, m = jnp.ones((2, 3)), jnp.ones((2, 3), bool)
  with pytest.raises(ValueError, match="pass max_len"):
    ops.aggregate(x, m, "seq_mean_token_sum_norm")
  with pytest.raises(ValueError, match="max_len=0 must be > 0"):
    ops.aggregate(x, m, "seq_mean_token_sum_norm", max_len=0)
  with pytest.raises(ValueError, match="pass max_len"):
    losses.policy_loss(x, x, x, m, aggregation="seq_mean_token_sum_norm")
  with pytest.raises(ValueError, match="unknown aggregation"):
    ops.aggregation_count(m, "bogus")


def test_aggregate_unknown_mode():
  with pytest.raises(ValueError):
    ops.aggregate(jnp.ones((2, 2)), jnp.ones((2, 2), bool), "bogus")


# ----------------------------------------------------------------------------------------------
# ops: selective_log_softmax and entropy_from_logits (forward, bf16, gradients).

V = 37


def _logits(shape, seed, dtype=jnp.float32, scale=2.0):
  rng = _rng(shape, seed, salt=7)
  logits = jnp.asarray(rng.normal(size=shape + (V,)) * scale, dtype)
  tokens = jnp.asarray(rng.integers(0, V, size=shape), jnp.int32)
  cot = jnp.asarray(rng.normal(size=shape), jnp.float32)
  return (logits, tokens, cot, np.asarray(logits.astype(jnp.float32), np.float64),
          np.asarray(tokens), np.asarray(cot, np.float64))


@functools.partial(jax.jit, static_argnums=(4,))
def _softmax_outputs(logits, tokens, cot, temperature, chunks):
  """For every chunk size: log-probs, entropies and the gradients (w.r.t. logits and
  temperature) of Σ cot·logp and Σ cot·H. One compilation per shape/dtype/chunk set."""
  out = {}
  for c in chunks:
    def f_lp(lg, temp, c=c):
      return jnp.sum(cot * logprobs.selective_log_softmax(lg, tokens, temp, chunk_size=c))

    def f_h(lg, temp, c=c):
      return jnp.sum(cot * logprobs.entropy_from_logits(lg, temp, chunk_size=c))
    out[c] = dict(
        lp=logprobs.selective_log_softmax(logits, tokens, temperature, chunk_size=c),
        h=logprobs.entropy_from_logits(logits, temperature, chunk_size=c),
        g_lp=jax.grad(f_lp, argnums=(0, 1))(logits, temperature),
        g_h=jax.grad(f_h, argnums=(0, 1))(logits, temperature),
    )
  return out


# (shape, chunk sizes): chunks of 1, ones that do not divide B·T, exactly B·T, and larger.
SOFTMAX_CASES = [((1, 1), (1, 1024)), ((3, 7), (1, 4, 21, 1024)), ((8, 33), (5, 64, 1024))]


@pytest.mark.parametrize("case", range(len(SOFTMAX_CASES)))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_selective_log_softmax_and_entropy(case, temperature):
  """Forward values and gradients (logits and temperature), float32, several chunk sizes."""
  shape, chunks = SOFTMAX_CASES[case]
  logits, tokens, cot, l64, t64, c64 = _logits(shape, 0)
  out = _softmax_outputs(logits, tokens, cot, jnp.float32(temperature), chunks)
  lp_ref = ref.selective_log_softmax(l64, t64, temperature)
  h_ref = ref.entropy_from_logits(l64, temperature)
  g_lp_ref = ref.selective_log_softmax_grads(l64, t64, c64, temperature)
  g_h_ref = ref.entropy_grads(l64, c64, temperature)
  for c, o in out.items():
    msg = f"chunk={c}"
    assert o["lp"].dtype == jnp.float32 and o["lp"].shape == shape
    assert o["h"].dtype == jnp.float32 and o["h"].shape == shape
    close(o["lp"], lp_ref, err_msg=msg)
    close(o["h"], h_ref, err_msg=msg)
    assert o["g_lp"][0].dtype == jnp.float32 and o["g_h"][0].dtype == jnp.float32
    close(o["g_lp"][0], g_lp_ref[0], err_msg=msg)
    close(o["g_h"][0], g_h_ref[0], err_msg=msg)
    close(o["g_lp"][1], g_lp_ref[1], rtol=1e-4, atol=1e-4, err_msg=msg)
    close(o["g_h"][1], g_h_ref[1], rtol=1e-4, atol=1e-4, err_msg=msg)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_selective_log_softmax_and_entropy_bf16(temperature):
  """bf16 logits: within 1e-2 of the float64 reference on the bf16-rounded logits; gradients
  come back in bf16."""
  shape, chunks = (4, 9), (1, 5, 1024)
  logits, tokens, cot, l64, t64, c64 = _logits(shape, 1, dtype=jnp.bfloat16)
  out = _softmax_outputs(logits, tokens, cot, jnp.float32(temperature), chunks)
  g_lp_ref = ref.selective_log_softmax_grads(l64, t64, c64, temperature)
  g_h_ref = ref.entropy_grads(l64, c64, temperature)
  for c, o in out.items():
    msg = f"chunk={c}"
    assert o["lp"].dtype == jnp.float32 and o["h"].dtype == jnp.float32
    close(o["lp"], ref.selective_log_softmax(l64, t64, temperature), rtol=0, atol=1e-2,
          err_msg=msg)
    close(o["h"], ref.entropy_from_logits(l64, temperature), rtol=0, atol=1e-2, err_msg=msg)
    assert o["g_lp"][0].dtype == jnp.bfloat16 and o["g_h"][0].dtype == jnp.bfloat16
    close(o["g_lp"][0].astype(jnp.float32), g_lp_ref[0], rtol=0, atol=1e-2, err_msg=msg)
    close(o["g_h"][0].astype(jnp.float32), g_h_ref[0], rtol=0, atol=1e-2, err_msg=msg)
    close(o["g_lp"][1], g_lp_ref[1], rtol=2e-2, atol=2e-2, err_msg=msg)
    close(o["g_h"][1], g_h_ref[1], rtol=2e-2, atol=2e-2, err_msg=msg)


def test_logsoftmax_entropy_python_float_temperature_eager():
  """The plain eager call with a Python-float temperature and the default chunk size."""
  logits, tokens, _, l64, t64, _ = _logits((3, 7), 2)
  close(logprobs.selective_log_softmax(logits, tokens, 0.7),
        ref.selective_log_softmax(l64, t64, 0.7))
  close(logprobs.entropy_from_logits(logits, 0.7), ref.entropy_from_logits(l64, 0.7))
  close(logprobs.selective_log_softmax(logits, tokens), ref.selective_log_softmax(l64, t64))
  close(logprobs.entropy_from_logits(logits), ref.entropy_from_logits(l64))


def test_logsoftmax_entropy_extra_leading_dims():
  rng = np.random.default_rng(3)
  for shape in [(5,), (2, 3, 4)]:
    logits = jnp.asarray(rng.normal(size=shape + (V,)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, V, size=shape), jnp.int32)
    l64 = np.asarray(logits, np.float64)
    lp = logprobs.selective_log_softmax(logits, tokens, 0.9, chunk_size=4)
    ent = logprobs.entropy_from_logits(logits, 0.9, chunk_size=4)
    assert lp.shape == shape and ent.shape == shape
    close(lp, ref.selective_log_softmax(l64, np.asarray(tokens), 0.9))
    close(ent, ref.entropy_from_logits(l64, 0.9))


def test_logsoftmax_extreme_logits_stable():
  logits = jnp.array([[[1000.0, -1000.0, 0.0], [-1e4, -1e4, -1e4]]], jnp.float32)
  tokens = jnp.array([[1, 2]], jnp.int32)
  l64 = np.asarray(logits, np.float64)
  for chunk in [1, 2]:
    # z_tok − lse(z) near −1e4 is only representable to float32's ulp(1e4) ≈ 1e-3.
    close(logprobs.selective_log_softmax(logits, tokens, chunk_size=chunk),
          ref.selective_log_softmax(l64, np.asarray(tokens)), rtol=1e-6, atol=2e-3)


@pytest.mark.parametrize("offset", [1000.0, -1e4])
def test_entropy_shift_invariant_large_logits(offset):
  """Entropy is invariant to adding a constant to the logits. Input logits of magnitude |c| are
  float32-exact here. ppojax's −Σ p·log p has no cancellation (lse(z) − Σ p·z, its former form,
  lost ~|z|·eps: 2e-2 at offset 1000, negative entropies at −1e4); what is left is log p = z − lse
  with lse rounded to float32, half an ulp of |c| (5e-4 at 1e4): the tolerance is one ulp."""
  rng = np.random.default_rng(0)
  base = np.round(rng.normal(size=(2, 4, V)) * 3 * 64) / 64   # exactly representable + offset
  logits = jnp.asarray(base + offset, jnp.float32)
  l64 = np.asarray(logits, np.float64)
  expected = ref.entropy_from_logits(l64)
  for chunk in [3, 1024]:
    out = logprobs.entropy_from_logits(logits, chunk_size=chunk)
    assert np.all(np.asarray(out) >= 0), f"negative entropy {out} (offset={offset})"
    close(out, expected, rtol=0, atol=max(1e-5, float(np.spacing(np.float32(abs(offset))))),
          err_msg=f"offset={offset} chunk={chunk}")


def test_logsoftmax_grad_finite_difference():
  """One independent float64 finite-difference check of the analytic reference itself."""
  rng = np.random.default_rng(0)
  l64 = rng.normal(size=(2, 3, 5))
  t64 = rng.integers(0, 5, size=(2, 3))
  cot = rng.normal(size=(2, 3))
  T = 0.8
  f_lp = lambda lg, tt: np.sum(cot * ref.selective_log_softmax(lg, t64, tt))  # noqa: E731
  f_h = lambda lg, tt: np.sum(cot * ref.entropy_from_logits(lg, tt))  # noqa: E731
  for f, g in [(f_lp, ref.selective_log_softmax_grads(l64, t64, cot, T)),
               (f_h, ref.entropy_grads(l64, cot, T))]:
    h = 1e-6
    num = np.zeros_like(l64)
    for idx in np.ndindex(*l64.shape):
      e = np.zeros_like(l64)
      e[idx] = h
      num[idx] = (f(l64 + e, T) - f(l64 - e, T)) / (2 * h)
    np.testing.assert_allclose(g[0], num, atol=1e-7)
    np.testing.assert_allclose(g[1], (f(l64, T + h) - f(l64, T - h)) / (2 * h), atol=1e-7)


# ----------------------------------------------------------------------------------------------
# ops: stop tokens and masks.

STOP_CASES = [
    # (tokens, stop_ids, pad_id)
    ([[5, 7, 2, 2, 2]], [2], 2),                       # pad_id == eos_id
    ([[5, 7, 2, 2, 2], [2, 2, 2, 2, 2], [5, 6, 7, 8, 9], [1, 1, 1, 1, 2]], [2], 2),
    ([[5, 3, 7, 2, 0], [9, 9, 9, 9, 9], [3, 0, 0, 0, 0]], [2, 3], 0),  # several stop ids
    ([[4]], [4], 0),
    ([[4]], [5], 0),
]


def _check_stop_fns(tokens, stop_ids, pad_id):
  tok = jnp.asarray(tokens, jnp.int32)
  for ids in [list(stop_ids), tuple(stop_ids), jnp.asarray(stop_ids, jnp.int32)]:
    is_stop = ops.is_stop_token(tok, ids)
    assert is_stop.dtype == jnp.bool_
    np.testing.assert_array_equal(np.asarray(is_stop), ref.is_stop_token(tokens, stop_ids))
    rm = ops.response_mask(tok, ids)
    assert rm.dtype == jnp.bool_
    np.testing.assert_array_equal(np.asarray(rm), ref.response_mask(tokens, stop_ids))
    hs = ops.has_stop_token(tok, ids)
    assert hs.dtype == jnp.bool_
    np.testing.assert_array_equal(np.asarray(hs), ref.has_stop_token(tokens, stop_ids))
    np.testing.assert_array_equal(np.asarray(ops.truncate_after_stop(tok, ids, pad_id)),
                                  ref.truncate_after_stop(tokens, stop_ids, pad_id))


@pytest.mark.parametrize("case", range(len(STOP_CASES)))
def test_stop_token_fns_handcrafted(case):
  _check_stop_fns(*STOP_CASES[case])


def test_response_mask_pad_equals_eos_example():
  tok = jnp.array([[5, 7, 2, 2, 2]])
  np.testing.assert_array_equal(np.asarray(ops.response_mask(tok, [2])),
                                [[True, True, True, False, False]])
  np.testing.assert_array_equal(np.asarray(ops.has_stop_token(tok, [2])), [True])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("stop_ids", [[2], [2, 7, 3]])
def test_stop_token_fns_random(shape, seed, stop_ids):
  rng = _rng(shape, seed, salt=3)
  tokens = rng.integers(0, 12, size=shape)
  if shape[0] > 1:   # one row without any stop token
    tokens[0] = rng.choice([t for t in range(12) if t not in stop_ids], size=shape[1])
  _check_stop_fns(tokens, stop_ids, pad_id=stop_ids[0])
  _check_stop_fns(tokens, stop_ids, pad_id=0)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", SEEDS)
def test_last_index_and_last_token_mask(shape, seed):
  rng = _rng(shape, seed)
  m = prefix_mask(rng, *shape)
  li = ops.last_index(jnp.asarray(m))
  assert li.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(li), ref.last_index(m))
  ltm = ops.last_token_mask(jnp.asarray(m))
  assert ltm.dtype == jnp.bool_
  np.testing.assert_array_equal(np.asarray(ltm), ref.last_token_mask(m))
  # Non-prefix masks: still the last set position.
  g = rng.random(shape) < 0.3
  np.testing.assert_array_equal(np.asarray(ops.last_index(jnp.asarray(g))), ref.last_index(g))
  np.testing.assert_array_equal(np.asarray(ops.last_token_mask(jnp.asarray(g))),
                                ref.last_token_mask(g))
  np.testing.assert_array_equal(np.asarray(ops.last_index(jnp.asarray(g.astype(np.int32)))),
                                ref.last_index(g))


# ----------------------------------------------------------------------------------------------
# kl.

KL_FNS = {"k1": kl.kl_k1, "k2": kl.kl_k2, "k3": kl.kl_k3, "abs": kl.kl_abs, "clamp": kl.kl_clamp}
ESTIMATORS = ["k1", "kl", "k2", "mse", "k3", "abs", "clamp"]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", SEEDS)
def test_kl_estimators(shape, seed):
  rng = _rng(shape, seed, salt=4)
  logp, lp64 = f32(-np.abs(rng.normal(size=shape)) * 2)
  ref_logp, rlp64 = f32(-np.abs(rng.normal(size=shape)) * 2)
  for name, fn in KL_FNS.items():
    close(fn(logp, ref_logp), ref.KL[name](lp64, rlp64), err_msg=name)
  for est in ESTIMATORS:
    out = kl.per_token_kl(logp, ref_logp, est)
    close(out, ref.per_token_kl(lp64, rlp64, est), err_msg=est)
  assert np.all(np.asarray(kl.kl_k3(logp, ref_logp)) >= 0)
  assert np.all(np.asarray(kl.kl_k2(logp, ref_logp)) >= 0)


def test_per_token_kl_default_is_k1_and_unknown_raises():
  a, b = jnp.array([[-1.0, -2.0]]), jnp.array([[-1.5, -0.5]])
  close(kl.per_token_kl(a, b), [[0.5, -1.5]])
  with pytest.raises(ValueError):
    kl.per_token_kl(a, b, "k4")
  with pytest.raises(ValueError):
    kl.per_token_kl(a, b, "K1")


def test_fixed_kl_controller():
  ctl = kl.fixed_kl_controller(0.05)
  state = ctl.init()
  close(state.beta, 0.05)
  for k, n in [(0.0, 1), (100.0, 64), (-3.0, 8)]:
    state = ctl.update(state, jnp.float32(k), n)
    close(state.beta, 0.05)


@pytest.mark.parametrize("use_jit", [False, True])
def test_adaptive_kl_controller(use_jit):
  init_beta, target, horizon = 0.2, 6.0, 10000.0
  ctl = kl.adaptive_kl_controller(init_beta, target, horizon)
  kls = [0.0, 3.0, 6.0, 7.0, 100.0, 5.5, -1.0, 6.6, 8.0, 12.0]
  ns = [64, 64, 128, 1, 512, 64, 64, 256, 1000, 3]
  expected = ref.adaptive_kl_betas(init_beta, target, horizon, kls, ns)
  update = jax.jit(ctl.update) if use_jit else ctl.update
  state = ctl.init()
  close(state.beta, init_beta)
  for k, n, e in zip(kls, ns, expected):
    state = update(state, jnp.float32(k), n)
    close(state.beta, e, rtol=1e-5, atol=0)
  assert isinstance(state, kl.KLControllerState)


# ----------------------------------------------------------------------------------------------
# rewards.


@pytest.mark.parametrize("clip", [None, 1.5])
@pytest.mark.parametrize("penalty", [None, 0.7])
def test_adjust_scores(clip, penalty):
  rng = np.random.default_rng(11)
  scores, s64 = f32(rng.normal(size=9) * 2)
  has_stop = rng.random(9) < 0.5
  out = rewards.adjust_scores(scores, jnp.asarray(has_stop), score_clip=clip,
                              missing_stop_penalty=penalty)
  close(out, ref.adjust_scores(s64, has_stop, clip, penalty))
  # Without has_stop there is nothing to penalise.
  out = rewards.adjust_scores(scores, score_clip=clip)
  close(out, ref.adjust_scores(s64, None, clip, None))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("estimator", ["k1", "k3", "abs", "mse"])
@pytest.mark.parametrize("opts", [
    dict(),
    dict(with_stop=True, score_clip=1.0, missing_stop_penalty=0.5),
    dict(with_stop=True, whiten=True),
])
def test_shape_rewards(shape, seed, estimator, opts):
  opts = dict(opts)
  with_stop = opts.pop("with_stop", False)
  rng = _rng(shape, seed, salt=5)
  B, T = shape
  m = prefix_mask(rng, B, T)
  scores, s64 = f32(rng.normal(size=B) * 2)
  logp, lp64 = f32(poison(-np.abs(rng.normal(size=shape)), m))
  ref_logp, rlp64 = f32(poison(-np.abs(rng.normal(size=shape)), m))
  has_stop = (rng.random(B) < 0.5) if with_stop else None
  beta = 0.05
  r, metrics = rewards.shape_rewards(
      scores, logp, ref_logp, jnp.asarray(m), beta,
      has_stop=None if has_stop is None else jnp.asarray(has_stop), kl_estimator=estimator,
      **opts)
  r_ref, m_ref = ref.shape_rewards(s64, lp64, rlp64, m, beta, has_stop=has_stop,
                                   kl_estimator=estimator, **opts)
  assert r.dtype == jnp.float32 and r.shape == shape
  tol = 1e-4 if opts.get("whiten") else ATOL
  close(r, r_ref, rtol=tol, atol=tol)
  assert np.all(np.asarray(r)[~m] == 0)
  for key, val in m_ref.items():
    close(metrics[key], val, rtol=1e-5, atol=1e-5, err_msg=key)


def test_shape_rewards_traced_beta_under_jit():
  rng = np.random.default_rng(2)
  m = prefix_mask(rng, 4, 6)
  scores, s64 = f32(rng.normal(size=4))
  logp, lp64 = f32(-np.abs(rng.normal(size=(4, 6))))
  ref_logp, rlp64 = f32(-np.abs(rng.normal(size=(4, 6))))
  fn = jax.jit(lambda s, a, b, mm, beta: rewards.shape_rewards(s, a, b, mm, beta)[0])
  close(fn(scores, logp, ref_logp, jnp.asarray(m), jnp.float32(0.1)),
        ref.shape_rewards(s64, lp64, rlp64, m, 0.1)[0])


# ----------------------------------------------------------------------------------------------
# advantages.gae.


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 1.0), (0.99, 0.0)])
@pytest.mark.parametrize("bootstrap", [False, True])
def test_gae(shape, seed, gamma, lam, bootstrap):
  rng = _rng(shape, seed, salt=6)
  m = prefix_mask(rng, *shape)
  r, r64 = f32(poison(rng.normal(size=shape), m))
  v, v64 = f32(poison(rng.normal(size=shape), m))
  last, last64 = f32(rng.normal(size=shape[0])) if bootstrap else (None, None)
  adv, ret = advantages.gae(r, v, jnp.asarray(m), gamma, lam, last_values=last)
  adv_ref, ret_ref = ref.gae(r64, v64, m, gamma, lam, last_values=last64)
  assert adv.dtype == jnp.float32 and ret.dtype == jnp.float32
  close(adv, adv_ref, atol=3e-5)
  close(ret, ret_ref, atol=3e-5)
  assert np.all(np.asarray(adv)[~m] == 0) and np.all(np.asarray(ret)[~m] == 0)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", SEEDS)
def test_gae_whiten(shape, seed):
  rng = _rng(shape, seed, salt=6)
  m = prefix_mask(rng, *shape)
  r, r64 = f32(poison(rng.normal(size=shape), m))
  v, v64 = f32(poison(rng.normal(size=shape), m))
  adv, ret = advantages.gae(r, v, jnp.asarray(m), 0.97, 0.9, whiten=True)
  adv_ref, ret_ref = ref.gae(r64, v64, m, 0.97, 0.9, whiten=True)
  close(adv, adv_ref, rtol=1e-4, atol=1e-4)
  close(ret, ret_ref, atol=3e-5)   # returns come from the raw advantages
  assert np.all(np.asarray(adv)[~m] == 0)


def test_gae_defaults_and_jit():
  rng = np.random.default_rng(5)
  m = prefix_mask(rng, 4, 9)
  r, r64 = f32(rng.normal(size=(4, 9)))
  v, v64 = f32(rng.normal(size=(4, 9)))
  adv, ret = advantages.gae(r, v, jnp.asarray(m))   # gamma=1, lam=0.95
  a_ref, R_ref = ref.gae(r64, v64, m, 1.0, 0.95)
  close(adv, a_ref, atol=3e-5)
  close(ret, R_ref, atol=3e-5)
  fn = jax.jit(lambda r, v, m, g, lam: advantages.gae(r, v, m, g, lam))
  adv, ret = fn(r, v, jnp.asarray(m), jnp.float32(0.9), jnp.float32(0.8))
  a_ref, R_ref = ref.gae(r64, v64, m, 0.9, 0.8)
  close(adv, a_ref, atol=3e-5)
  close(ret, R_ref, atol=3e-5)


def test_gae_single_step_by_hand():
  # One response token: A = r - V (episode ends), R = r.
  adv, ret = advantages.gae(jnp.array([[2.0, 9.0]]), jnp.array([[0.5, 9.0]]),
                            jnp.array([[True, False]]), 0.9, 0.5)
  close(adv, [[1.5, 0.0]])
  close(ret, [[2.0, 0.0]])


# ----------------------------------------------------------------------------------------------
# losses.

POLICY_OPTS = [
    dict(),
    dict(clip_eps=0.1),
    dict(clip_eps_low=0.1, clip_eps_high=0.28),
    dict(dual_clip=3.0),
    dict(clip_eps_low=0.2, clip_eps_high=0.3, dual_clip=2.0),
]


def _policy_inputs(shape, seed):
  rng = _rng(shape, seed, salt=8)
  m = prefix_mask(rng, *shape)
  old = -np.abs(rng.normal(size=shape)) - 0.1
  logp = old + rng.normal(size=shape) * 0.6
  adv = rng.normal(size=shape)
  lp, lp64 = f32(poison(logp, m))
  ol, ol64 = f32(poison(old, m))
  a, a64 = f32(poison(adv, m))
  return m, (lp, lp64), (ol, ol64), (a, a64)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("opts", range(len(POLICY_OPTS)))
@pytest.mark.parametrize("aggregation", AGGS)
def test_policy_loss_and_grad(shape, seed, opts, aggregation):
  opts = POLICY_OPTS[opts]
  m, (lp, lp64), (ol, ol64), (a, a64) = _policy_inputs(shape, seed)
  mj = jnp.asarray(m)
  loss_ref, met_ref, grad_ref = ref.policy_loss(lp64, ol64, a64, m, aggregation=aggregation,
                                                max_len=ML,
                                                **opts)
  fn = lambda x: losses.policy_loss(x, ol, a, mj, aggregation=aggregation,  # noqa: E731
                                    max_len=ML, **opts)
  (loss, metrics), grad = jax.value_and_grad(fn, has_aux=True)(lp)
  close(loss, loss_ref)
  for key in ["loss", "approxkl", "clipfrac", "dual_clipfrac", "ratio"]:
    close(metrics[key], met_ref[key], err_msg=key)
  close(metrics["ratio_var"], met_ref["ratio_var"], rtol=1e-4, err_msg="ratio_var")
  close(grad, grad_ref, err_msg="grad")
  assert np.all(np.isfinite(np.asarray(grad)))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("clip_range", [0.2, 0.05, None])
@pytest.mark.parametrize("aggregation", AGGS)
def test_value_loss_and_grad(shape, seed, clip_range, aggregation):
  rng = _rng(shape, seed, salt=10)
  m = prefix_mask(rng, *shape)
  old = rng.normal(size=shape)
  vals = old + rng.normal(size=shape) * 0.3
  rets = rng.normal(size=shape)
  v, v64 = f32(poison(vals, m))
  ov, ov64 = f32(poison(old, m))
  R, R64 = f32(poison(rets, m))
  mj = jnp.asarray(m)
  loss_ref, met_ref, grad_ref = ref.value_loss(v64, ov64, R64, m, clip_range, aggregation, ML)
  fn = lambda x: losses.value_loss(x, ov, R, mj, clip_range=clip_range,  # noqa: E731
                                   aggregation=aggregation, max_len=ML)
  (loss, metrics), grad = jax.value_and_grad(fn, has_aux=True)(v)
  close(loss, loss_ref)
  for key, val in met_ref.items():
    close(metrics[key], val, err_msg=key)
  close(grad, grad_ref, err_msg="grad")
  assert np.all(np.isfinite(np.asarray(grad)))


def test_value_clipfrac_float32_rounding():
  """|V − V_old| = 0.13 < clip_range 0.2, so the clip is inactive and clipfrac must be 0, although
  in float32 V_old + (V − V_old) is one ulp away from V and (V_clip − R)² > (V − R)² by an ulp
  (trl's vf_clipfrac counts such tokens as clipped)."""
  bits = lambda u: jnp.asarray(np.array([[u]], np.uint32).view(np.float32))  # noqa: E731
  v, old, ret = bits(3175607021), bits(1034457356), bits(3182101967)
  assert abs(float(v[0, 0]) - float(old[0, 0])) < 0.2
  _, metrics = losses.value_loss(v, old, ret, jnp.ones((1, 1), bool), clip_range=0.2)
  assert float(metrics["clipfrac"]) == 0.0


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("aggregation", AGGS)
def test_entropy_bonus(shape, seed, aggregation):
  rng = _rng(shape, seed, salt=12)
  m = prefix_mask(rng, *shape)
  h, h64 = f32(poison(rng.random(size=shape) * 3, m))
  close(losses.entropy_bonus(h, jnp.asarray(m), aggregation, ML),
        ref.entropy_bonus(h64, m, aggregation, ML))
  g = jax.grad(lambda x: losses.entropy_bonus(x, jnp.asarray(m), aggregation, ML))(h)
  close(g, ref.aggregate_weights(m, aggregation, ML))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("estimator", ["k3", "k1", "k2"])
@pytest.mark.parametrize("aggregation", AGGS)
def test_kl_loss_and_grad(shape, estimator, aggregation):
  """β·agg(KL_t) and its gradient w.r.t. log π (none w.r.t. log π_ref), NaN padding inert."""
  m, (lp, lp64), (rl, rl64), _ = _policy_inputs(shape, 1)
  mj = jnp.asarray(m)
  loss_ref, met_ref, grad_ref = ref.kl_loss(lp64, rl64, m, 0.04, estimator, aggregation, ML)
  fn = lambda x, y: losses.kl_loss(x, y, mj, coef=0.04, estimator=estimator,  # noqa: E731
                                   aggregation=aggregation, max_len=ML)
  (loss, metrics), (g, g_ref) = jax.value_and_grad(fn, argnums=(0, 1), has_aux=True)(lp, rl)
  close(loss, loss_ref)
  close(metrics["loss"], met_ref["loss"])
  close(metrics["kl"], met_ref["kl"])
  close(g, grad_ref)
  assert np.all(np.asarray(g_ref) == 0.0)


def test_kl_loss_k3_by_hand():
  # Δ = log 2: k3 = ½ − 1 + log 2; ∂/∂logp = 1 − ½; a padded NaN is never read.
  lp = jnp.array([[jnp.log(2.0), jnp.nan]])
  m = jnp.array([[True, False]])
  (loss, metrics), g = jax.value_and_grad(
      lambda x: losses.kl_loss(x, jnp.zeros((1, 2)), m, coef=0.5), has_aux=True)(lp)
  close(loss, 0.5 * (np.log(2.0) - 0.5))
  close(metrics["kl"], np.log(2.0) - 0.5)
  close(g, [[0.25, 0.0]])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("aggregation", AGGS)
@pytest.mark.parametrize("with_entropy", [False, True])
def test_ppo_loss(shape, aggregation, with_entropy):
  m, (lp, lp64), (ol, ol64), (a, a64) = _policy_inputs(shape, 0)
  rng = _rng(shape, 0, salt=13)
  v, v64 = f32(poison(rng.normal(size=shape), m))
  ov, ov64 = f32(poison(np.asarray(v64) + rng.normal(size=shape) * 0.3, m))
  R, R64 = f32(poison(rng.normal(size=shape), m))
  h, h64 = f32(poison(rng.random(size=shape) * 3, m)) if with_entropy else (None, None)
  kw = dict(vf_coef=0.3, ent_coef=0.01 if with_entropy else 0.0, clip_eps_high=0.28,
            dual_clip=3.0, value_clip=0.1, aggregation=aggregation, max_len=ML)
  mj = jnp.asarray(m)
  total, metrics = losses.ppo_loss(lp, ol, a, v, ov, R, mj, h, **kw)
  total_ref, met_ref = ref.ppo_loss(lp64, ol64, a64, v64, ov64, R64, m, h64, **kw)
  close(total, total_ref)
  for key, val in met_ref.items():
    tol = 1e-4 if key == "val/ratio_token_var" else RTOL
    close(metrics[key], val, rtol=tol, err_msg=key)
  for key in ["loss/policy", "loss/value", "loss/total", "policy/approxkl_masked", "policy/clipfrac",
              "policy/dual_clipfrac", "val/ratio_masked", "val/ratio_token_var", "val/clipfrac",
              "val/error", "val/values"]:
    assert key in metrics, key
  if with_entropy:
    assert "policy/entropy_masked" in metrics
  # Gradients of the total w.r.t. logp, values (and entropy): sums of the pieces.
  _, _, g_pol = ref.policy_loss(lp64, ol64, a64, m, clip_eps_high=0.28, dual_clip=3.0,
                                aggregation=aggregation, max_len=ML)
  _, _, g_val = ref.value_loss(v64, ov64, R64, m, 0.1, aggregation, ML)
  g_lp, g_v = jax.grad(lambda x, y: losses.ppo_loss(x, ol, a, y, ov, R, mj, h, **kw)[0],
                       argnums=(0, 1))(lp, v)
  close(g_lp, g_pol)
  close(g_v, 0.3 * g_val)
  if with_entropy:
    g_h = jax.grad(lambda e: losses.ppo_loss(lp, ol, a, v, ov, R, mj, e, **kw)[0])(h)
    close(g_h, -0.01 * ref.aggregate_weights(m, aggregation, ML))


def test_ppo_loss_defaults():
  m, (lp, lp64), (ol, ol64), (a, a64) = _policy_inputs((3, 7), 1)
  rng = np.random.default_rng(1)
  v, v64 = f32(rng.normal(size=(3, 7)))
  ov, ov64 = f32(v64 + rng.normal(size=(3, 7)) * 0.3)
  R, R64 = f32(rng.normal(size=(3, 7)))
  total, metrics = losses.ppo_loss(lp, ol, a, v, ov, R, jnp.asarray(m))
  total_ref, met_ref = ref.ppo_loss(lp64, ol64, a64, v64, ov64, R64, m)  # trl defaults
  close(total, total_ref)
  for key, val in met_ref.items():
    close(metrics[key], val, rtol=1e-4, err_msg=key)


def test_ppo_loss_ent_coef_without_entropy_raises():
  x = jnp.zeros((2, 3))
  m = jnp.ones((2, 3), bool)
  with pytest.raises(ValueError, match="ent_coef needs the per-token entropy"):
    losses.ppo_loss(x, x, x, x, x, x, m, None, ent_coef=0.01)
  with pytest.raises(ValueError, match="ent_coef needs the per-token entropy"):
    losses.ppo_loss(x, x, x, x, x, x, m, None, ent_coef=jnp.asarray(0.5))  # traced: can't check
  losses.ppo_loss(x, x, x, x, x, x, m, None, ent_coef=0.0)


@pytest.mark.parametrize("shape", SHAPES)
def test_gather_last(shape):
  rng = np.random.default_rng(3)
  m = prefix_mask(rng, *shape)
  x = rng.normal(size=shape)
  expected = [x[b, m[b].nonzero()[0][-1]] if m[b].any() else 0.0 for b in range(shape[0])]
  close(ops.gather_last(jnp.asarray(x, jnp.float32), jnp.asarray(m)), np.asarray(expected))
