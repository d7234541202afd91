"""The policy term's loss modes (``ppojax.core.surrogates``: GSPO, GSPO-token, CISPO beside PPO's
token clip) against float64 loops written out in tests/reference.py, value, metrics and gradient;
and the choice of one from the config (``rl.loss_mode``, the ``gspo`` and ``cispo`` algorithms)."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref

from ppojax.core import algorithms, losses, surrogates
from ppojax.run import build as build_lib
from ppojax.run import checks

_TOY = pathlib.Path(__file__).parents[1] / "configs" / "toy.py"
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


def _inputs(seed: int, per_token_adv: bool):
  """Ragged rows of log-probs whose ratios spread well past a 0.2 clip (and one empty row)."""
  rng = np.random.default_rng(seed)
  b, t = 5, 7
  mask = np.arange(t)[None] < rng.integers(1, t + 1, b)[:, None]
  mask[-1] = False
  old = -rng.uniform(0.2, 3.0, (b, t))
  logp = old + rng.normal(0, 0.4, (b, t))
  adv = rng.normal(size=(b, t)) if per_token_adv else np.repeat(rng.normal(size=(b, 1)), t, 1)
  return logp, old, adv, mask


def _ppojax(mode, logp, old, adv, mask, lo, hi, aggregation):
  def loss(lp):
    return losses.policy_loss(lp, jnp.asarray(old, jnp.float32), jnp.asarray(adv, jnp.float32),
                              jnp.asarray(mask), clip_eps_low=lo, clip_eps_high=hi,
                              aggregation=aggregation, max_len=mask.shape[1],
                              surrogate=surrogates.SURROGATES[mode])
  (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(logp, jnp.float32))
  return float(value), jax.device_get(metrics), np.asarray(grad, np.float64)


def _reference(mode, logp, old, adv, mask, lo, hi, aggregation):
  agg = dict(aggregation=aggregation, max_len=mask.shape[1])
  if mode == "clip":
    return ref.policy_loss(logp, old, adv, mask, 0.2, lo, hi, **agg)
  if mode == "cispo":
    return ref.cispo_loss(logp, old, adv, mask, lo, hi, **agg)
  return ref.gspo_loss(logp, old, adv, mask, lo, hi, token=mode == "gspo_token", **agg)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("mode", list(surrogates.SURROGATES))
def test_each_loss_mode_equals_its_written_out_loss_metrics_and_gradient(mode, aggregation, seed):
  logp, old, adv, mask = _inputs(seed, per_token_adv=mode in ("clip", "cispo", "gspo_token"))
  lo, hi = (0.2, 0.28) if mode in ("clip", "cispo") else (0.05, 0.08)
  value, metrics, grad = _ppojax(mode, logp, old, adv, mask, lo, hi, aggregation)
  want, want_metrics, want_grad = _reference(mode, logp, old, adv, mask, lo, hi, aggregation)
  np.testing.assert_allclose(value, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-6)
  for name in ("approxkl", "clipfrac", "ratio", "ratio_var"):
    np.testing.assert_allclose(metrics[name], want_metrics[name], rtol=1e-4, atol=1e-6,
                               err_msg=name)
  assert 0 < want_metrics["clipfrac"] < 1  # both branches exercised
  assert np.all(grad[~mask] == 0)


def test_gspo_token_equals_gspo_where_the_advantage_is_the_sequences():
  """GSPO-token's value is GSPO's always; its gradient is GSPO's when A is constant over each
  sequence and the loss is the mean over sequences of their token means (the paper's eq. 13)."""
  logp, old, adv, mask = _inputs(3, per_token_adv=False)
  args = (logp, old, adv, mask, 0.05, 0.08, "seq_mean_token_mean")
  (v_seq, _, g_seq), (v_tok, _, g_tok) = _ppojax("gspo", *args), _ppojax("gspo_token", *args)
  np.testing.assert_allclose(v_tok, v_seq, rtol=1e-6)
  np.testing.assert_allclose(g_tok, g_seq, rtol=1e-4, atol=1e-7)
  # with per-token advantages they differ: the token form keeps each token's own gradient
  _, _, adv_t, _ = _inputs(3, per_token_adv=True)
  g1 = _ppojax("gspo", logp, old, adv_t, mask, 0.05, 0.08, "seq_mean_token_mean")[2]
  g2 = _ppojax("gspo_token", logp, old, adv_t, mask, 0.05, 0.08, "seq_mean_token_mean")[2]
  assert np.abs(g1 - g2).max() > 1e-3


def test_cispo_keeps_the_gradient_of_tokens_ppo_clips():
  """Where PPO's clip zeroes a token's gradient (A > 0, ρ > 1 + ε_high), CISPO keeps it,
  weighted by the capped ratio: −(1 + ε_high)·A per token of a token mean."""
  logp = np.log(np.array([[1.5, 1.0]]))  # ρ = 1.5 (clipped at 1.28) and 1
  old, adv, mask = np.zeros((1, 2)), np.ones((1, 2)), np.ones((1, 2), bool)
  _, _, g_clip = _ppojax("clip", logp, old, adv, mask, 0.2, 0.28, "token_mean")
  _, _, g_cispo = _ppojax("cispo", logp, old, adv, mask, 0.2, 0.28, "token_mean")
  np.testing.assert_allclose(g_clip, [[0.0, -0.5]], atol=1e-7)
  np.testing.assert_allclose(g_cispo, [[-1.28 / 2, -0.5]], rtol=1e-6)


def test_cispo_without_a_floor_weights_small_ratios_by_themselves():
  """verl's CISPO example sets clip_ratio_low=10: ε_low >= 1 leaves the weight without a floor,
  w = min(ρ, 1 + ε_high), so a token with ρ = 0.3 is weighted 0.3 (0.8 under ε_low = 0.2) and
  none counts as clipped from below; the written-out loss agrees."""
  logp = np.log(np.array([[0.3, 1.0, 1.5]]))
  old, adv, mask = np.zeros((1, 3)), np.ones((1, 3)), np.ones((1, 3), bool)
  value, metrics, grad = _ppojax("cispo", logp, old, adv, mask, 10.0, 0.28, "token_mean")
  np.testing.assert_allclose(grad, [[-0.3 / 3, -1 / 3, -1.28 / 3]], rtol=1e-6)
  assert metrics["clipfrac"] == pytest.approx(1 / 3)  # the ratio above 1 + ε_high only
  want, _, want_grad = ref.cispo_loss(logp, old, adv, mask, 10.0, 0.28,
                                      aggregation="token_mean", max_len=3)
  np.testing.assert_allclose(value, want, rtol=1e-6)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-6)
  floor = _ppojax("cispo", logp, old, adv, mask, 0.2, 0.28, "token_mean")[2]
  np.testing.assert_allclose(floor[0, 0], -0.8 / 3, rtol=1e-6)


@pytest.mark.parametrize("mode", ["clip", "gspo", "gspo_token"])
def test_a_floor_at_or_below_zero_is_refused_where_the_ratio_is_clipped(mode):
  """ε_low >= 1 would turn PPO's (and GSPO's) clip off below for negative advantages: refused
  in the loss and in the config, with the way out named; CISPO takes it."""
  logp, old, adv, mask = (jnp.zeros((1, 2)),) * 3 + (jnp.ones((1, 2), bool),)
  with pytest.raises(ValueError, match=r"clip_eps_low=10\.0 must be in \(0, 1\).*cispo"):
    losses.policy_loss(logp, old, adv, mask, clip_eps_low=10.0,
                       surrogate=surrogates.SURROGATES[mode])
  config = build_lib.load_config(_TOY, algorithm="grpo", rl__batch_size=4,
                                 sampling__num_samples_per_prompt=4, rl__clip_eps_low=10.0)
  config.rl.loss_mode = mode
  with pytest.raises(checks.ConfigError, match=r"rl.clip_eps_low=10\.0 must be in \(0, 1\)"):
    checks.validate(config, num_devices=1)
  config.rl.loss_mode = "cispo"
  checks.validate(config, num_devices=1)
  with pytest.raises(checks.ConfigError, match=r"rl.clip_eps_low=0\.0 must be > 0 with "):
    checks.validate(build_lib.load_config(_TOY, algorithm="cispo", rl__batch_size=4,
                                          sampling__num_samples_per_prompt=4,
                                          rl__clip_eps_low=0.0), num_devices=1)


def test_an_unknown_loss_mode_or_dual_clip_beside_another_mode_is_refused():
  with pytest.raises(ValueError, match="rl.loss_mode='gpso': choose one of clip, gspo"):
    surrogates.surrogate("gpso")
  logp, old, adv, mask = (jnp.zeros((1, 2)),) * 3 + (jnp.ones((1, 2), bool),)
  with pytest.raises(ValueError, match="dual_clip caps PPO's token-ratio term only"):
    losses.policy_loss(logp, old, adv, mask, dual_clip=3.0, surrogate=surrogates.gspo)


@pytest.mark.parametrize("algorithm, mode, aggregation", [
    ("gspo", "gspo", "seq_mean_token_mean"), ("cispo", "cispo", "token_mean"),
    ("grpo", "clip", "seq_mean_token_mean"), ("ppo", "clip", "token_mean")])
def test_the_algorithm_picks_its_loss_mode_and_the_config_overrides_it(algorithm, mode,
                                                                       aggregation):
  config = build_lib.load_config(_TOY, algorithm=algorithm, rl__batch_size=4,
                                 sampling__num_samples_per_prompt=4)
  record = algorithms.from_config(config)
  assert record.surrogate is surrogates.SURROGATES[mode]
  assert record.aggregation == aggregation
  assert algorithms.resolve(config).rl.loss_mode == mode
  config.rl.loss_mode = "gspo_token"
  assert algorithms.from_config(config).surrogate is surrogates.gspo_token
  checks.validate(config, num_devices=1)


def test_the_config_refuses_a_bad_loss_mode_and_dual_clip_with_gspo():
  config = build_lib.load_config(_TOY, rl__loss_mode="gpso")
  with pytest.raises(checks.ConfigError, match="rl.loss_mode"):
    checks.validate(config, num_devices=1)
  config = build_lib.load_config(_TOY, algorithm="gspo", rl__batch_size=4,
                                 sampling__num_samples_per_prompt=4, rl__dual_clip=3.0)
  with pytest.raises(checks.ConfigError, match=r"rl.dual_clip=3.0 caps PPO's token-ratio term"):
    checks.validate(config, num_devices=1)
