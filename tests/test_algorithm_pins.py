"""Each algorithm's defining settings, pinned against docs/algorithms.md's table written out
here (not imported): the names ``algorithms.resolve`` gives a config that sets only
``algorithm`` (advantage estimator, where the KL goes, KL estimator, aggregation, policy term
``rl.loss_mode``), whether the
record has a critic, and what the resolved pieces compute on small hand-made inputs against
NumPy lines in this file: the KL estimator on given log-probs, the aggregation of a loss over a
ragged mask, the advantages of hand-made scores and rewards."""

from __future__ import annotations

import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

from ppojax.core import advantages, algorithms, ops, surrogates
from ppojax.run import build as build_lib

_TOY = pathlib.Path(__file__).parents[1] / "configs" / "toy.py"

# docs/algorithms.md's table, one row per algorithm: advantage (rl.estimator) | KL (rl.kl_in,
# rl.kl_estimator) | aggregation (rl.aggregation) | policy term (rl.loss_mode) | critic
TABLE = {
    "ppo": dict(estimator="gae", kl_in="reward", kl_estimator="k1",
                aggregation="token_mean", loss_mode="clip", critic=True),
    "grpo": dict(estimator="grpo", kl_in="loss", kl_estimator="k3",
                 aggregation="seq_mean_token_mean", loss_mode="clip", critic=False),
    "dr_grpo": dict(estimator="dr_grpo", kl_in="loss", kl_estimator="k3",
                    aggregation="seq_mean_token_sum_norm", loss_mode="clip", critic=False),
    "rloo": dict(estimator="rloo", kl_in="reward", kl_estimator="k1",
                 aggregation="token_mean", loss_mode="clip", critic=False),
    "reinforce_pp": dict(estimator="reinforce_pp", kl_in="reward", kl_estimator="k2",
                         aggregation="token_mean", loss_mode="clip", critic=False),
    "gspo": dict(estimator="grpo", kl_in="loss", kl_estimator="k3",
                 aggregation="seq_mean_token_mean", loss_mode="gspo", critic=False),
    "cispo": dict(estimator="grpo", kl_in="loss", kl_estimator="k3",
                  aggregation="token_mean", loss_mode="cispo", critic=False),
}
N_GROUP = 4  # samples per prompt of the hand-made batch (2 groups)


def _config(name: str):
  """configs/toy.py with only ``algorithm`` (and a group size the group estimators accept)."""
  return build_lib.load_config(_TOY, algorithm=name, rl__batch_size=4,
                               sampling__num_samples_per_prompt=N_GROUP)


def test_the_table_covers_every_algorithm():
  assert sorted(TABLE) == sorted(algorithms.ALGORITHMS)


@pytest.mark.parametrize("name", list(TABLE))
def test_a_config_naming_only_the_algorithm_resolves_to_the_documented_settings(name):
  want = TABLE[name]
  rl = algorithms.resolve(_config(name)).rl
  got = {k: rl[k] for k in ("estimator", "kl_in", "kl_estimator", "aggregation", "loss_mode")}
  assert got == {k: v for k, v in want.items() if k != "critic"}
  record = algorithms.from_config(_config(name))
  assert record.surrogate is surrogates.SURROGATES[want["loss_mode"]]  # tests/test_surrogates.py
  assert record.needs_critic is want["critic"]
  assert record.kl_in_loss is (want["kl_in"] == "loss")
  assert record.aggregation == want["aggregation"]


# ---------------------------------------------------------------------------------------------
# Behaviour of the resolved pieces, against NumPy lines written from the table's formulas.
# ---------------------------------------------------------------------------------------------

NUMPY_KL = {  # d = log π − log π_ref
    "k1": lambda d: d,
    "k2": lambda d: 0.5 * d ** 2,
    "k3": lambda d: np.exp(-d) - 1.0 + d,
}


@pytest.mark.parametrize("name", list(TABLE))
def test_the_resolved_kl_estimator_computes_its_formula(name):
  rng = np.random.default_rng(0)
  logp, ref_logp = -rng.uniform(0.1, 3.0, (2, 2, 6))  # two sets of [2, 6] log-probs
  got = np.asarray(algorithms.from_config(_config(name)).kl(jnp.asarray(logp, jnp.float32),
                                                            jnp.asarray(ref_logp, jnp.float32)))
  want = NUMPY_KL[TABLE[name]["kl_estimator"]](logp - ref_logp)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  # the three estimators differ on these inputs, so the formula picked is the one pinned
  others = [k for k in NUMPY_KL if k != TABLE[name]["kl_estimator"]]
  assert all(np.abs(NUMPY_KL[k](logp - ref_logp) - got).max() > 1e-2 for k in others)


def _ragged():
  """A [3, 5] loss and prefix mask of lengths 5, 2, 4 (max_len = 5)."""
  loss = np.array([[1.0, 2.0, 3.0, 4.0, 5.0],
                   [10.0, -4.0, 7.0, 7.0, 7.0],
                   [0.5, 0.5, 2.0, -1.0, 9.0]])
  mask = np.arange(5)[None] < np.array([5, 2, 4])[:, None]
  return loss, mask


NUMPY_AGGREGATION = {  # x [B, T], m [B, T], T_max
    # every token weighs the same: Σ x·m / Σ m
    "token_mean": lambda x, m, t_max: (x * m).sum() / m.sum(),
    # mean per sequence over its own tokens, then the mean over sequences (GRPO)
    "seq_mean_token_mean": lambda x, m, t_max: np.mean((x * m).sum(1) / m.sum(1)),
    # each sequence's token sum ÷ max_new_tokens, then the mean over sequences (Dr. GRPO)
    "seq_mean_token_sum_norm": lambda x, m, t_max: np.mean((x * m).sum(1) / t_max),
}


@pytest.mark.parametrize("name", list(TABLE))
def test_the_resolved_aggregation_reduces_a_ragged_loss_as_documented(name):
  loss, mask = _ragged()
  record = algorithms.from_config(_config(name))
  got = float(ops.aggregate(jnp.asarray(loss, jnp.float32), jnp.asarray(mask),
                            record.aggregation, max_len=loss.shape[1]))
  values = {k: f(loss, mask, loss.shape[1]) for k, f in NUMPY_AGGREGATION.items()}
  assert len({round(v, 6) for v in values.values()}) == 3  # the three differ on this input
  assert got == pytest.approx(values[TABLE[name]["aggregation"]], rel=1e-6)


# The advantage estimators, each as the table's formula in NumPy: scores s [N] in groups of n,
# token rewards r [N, T], mask m [N, T], values v [N, T].


def _whiten(x, m, eps):
  """(x − mean) / √(var + eps) over the masked entries, unbiased variance; 0 off the mask."""
  vals = x[m]
  return np.where(m, (x - vals.mean()) / np.sqrt(vals.var(ddof=1) + eps), 0.0)


def _np_gae(s, r, m, v, gamma, lam):
  """δ_t = r_t + γV_{t+1} − V_t, A_t = Σ_k (γλ)^k δ_{t+k} (V after the last token: 0),
  whitened over the batch's tokens."""
  adv = np.zeros(r.shape)
  for b in range(r.shape[0]):
    n = int(m[b].sum())
    for t in range(n):
      delta = [r[b, k] + gamma * (v[b, k + 1] if k + 1 < n else 0.0) - v[b, k]
               for k in range(t, n)]
      adv[b, t] = sum((gamma * lam) ** i * dk for i, dk in enumerate(delta))
  return _whiten(adv, m, 1e-8)


def _per_row(seq_adv, m):
  return np.where(m, np.asarray(seq_adv)[:, None], 0.0)


def _np_grpo(s, r, m, v, gamma, lam):
  g = s.reshape(-1, N_GROUP)
  return _per_row(((g - g.mean(1, keepdims=True)) / (g.std(1, ddof=1, keepdims=True) + 1e-6)
                   ).ravel(), m)


def _np_dr_grpo(s, r, m, v, gamma, lam):
  g = s.reshape(-1, N_GROUP)
  return _per_row((g - g.mean(1, keepdims=True)).ravel(), m)


def _np_rloo(s, r, m, v, gamma, lam):
  g = s.reshape(-1, N_GROUP)
  others = (g.sum(1, keepdims=True) - g) / (N_GROUP - 1)
  return _per_row((g - others).ravel(), m)


def _np_reinforce_pp(s, r, m, v, gamma, lam):
  """G_t = Σ_{k≥t} γ^{k−t} r_k, whitened over every token of the batch."""
  returns = np.zeros(r.shape)
  for b in range(r.shape[0]):
    for t in range(int(m[b].sum())):
      returns[b, t] = sum(gamma ** (k - t) * r[b, k] for k in range(t, int(m[b].sum())))
  return _whiten(returns, m, 1e-8)


NUMPY_ESTIMATORS = {"gae": _np_gae, "grpo": _np_grpo, "dr_grpo": _np_dr_grpo, "rloo": _np_rloo,
                    "reinforce_pp": _np_reinforce_pp}


def _batch():
  """2 groups of 4: ragged prefix masks, KL-like token rewards plus the score on the last
  token, the sequence score = the rewards' sum (as the step forms it), critic values."""
  rng = np.random.default_rng(1)
  lengths = np.array([6, 3, 5, 1, 4, 6, 2, 5])
  m = np.arange(6)[None] < lengths[:, None]
  r = np.where(m, -0.1 * rng.uniform(size=m.shape), 0.0)
  r[np.arange(8), lengths - 1] += np.array([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.5])
  v = np.where(m, rng.normal(size=m.shape), 0.0)
  return r.sum(1), r, m, v


@pytest.mark.parametrize("name", list(TABLE))
def test_the_resolved_estimator_computes_the_documented_advantage(name):
  s, r, m, v = _batch()
  gamma, lam = 0.9, 0.8
  record = algorithms.from_config(_config(name))
  f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
  inputs = advantages.AdvantageInputs(scores=f32(s), rewards=f32(r), mask=jnp.asarray(m),
                                      values=f32(v) if record.needs_critic else None)
  adv, _ = record.estimate(inputs, advantages.AdvantageParams(
      gamma=gamma, lam=lam, whiten=True, group_size=N_GROUP))
  want = {k: f(s, r, m, v, gamma, lam) for k, f in NUMPY_ESTIMATORS.items()}
  np.testing.assert_allclose(np.asarray(adv), want[TABLE[name]["estimator"]], rtol=1e-4,
                             atol=1e-5)
  others = [k for k in want if k != TABLE[name]["estimator"]]
  assert all(np.abs(want[k] - np.asarray(adv)).max() > 1e-2 for k in others)
