"""The sort-free draw (``rollout/draw.py``, issue 62): top-k and top-p as one cut found among the
most likely tokens, with the full sort as the exact fallback, min-p as a weight threshold, and
the inverse CDF without padding the vocabulary. Each against the sort-based reference
(``truncate_logits``, Hugging Face's warpers, which ``test_sampling.reference_keep`` checks in
float64) and against the previous draw, written out here, token for token on fixed keys."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_sampling import chi_square_pvalue, reference_keep

from ppojax.rollout import draw
from ppojax.rollout.sampling import SamplingConfig

NEG = float(jnp.finfo(jnp.float32).min)


def _logits(seed, rows=64, vocab=1000, scale=4.0):
  """Peaked rows (a few likely tokens) and flat ones (mass spread over hundreds of tokens, so
  top-p's cut lies beyond the 256 candidates), with ties."""
  rng = np.random.default_rng(seed)
  z = rng.normal(size=(rows, vocab)) * np.linspace(0.05, scale, rows)[:, None]
  z[::7, :40] = np.round(z[::7, :40])  # ties
  return z.astype(np.float32)


def _config(**kw):
  return SamplingConfig(4, stop_ids=(1,), pad_id=0, **kw)


def _cut_keep(z, config):
  """The kept set ``sample_token`` draws from: z ≥ top_threshold (top-k and top-p)."""
  zj = jnp.asarray(z)
  tau = jax.jit(draw.top_threshold, static_argnums=2)(
      zj, jnp.max(zj, -1, keepdims=True), config)
  return np.asarray(zj >= tau)


@pytest.mark.parametrize("top_k, top_p", [(0, 0.5), (0, 0.9), (0, 0.99), (5, 1.0), (50, 0.9),
                                          (300, 0.95), (0, 0.999999)])
def test_the_cut_keeps_what_the_sort_keeps(top_k, top_p):
  """Equal kept sets, rows with and without the fallback; and both are Hugging Face's."""
  config = _config(top_k=top_k, top_p=top_p)
  z = _logits(0)
  want = np.asarray(jax.jit(draw.truncate_logits, static_argnums=1)(jnp.asarray(z), config)) > NEG
  got = _cut_keep(z, config)
  np.testing.assert_array_equal(got, want)
  hf, ambiguous = reference_keep(z.astype(np.float64), config)
  ambiguous[::7] = True  # tied rows: ppojax keeps every tie at the cut, the sort order splits them
  np.testing.assert_array_equal(got[~ambiguous], hf[~ambiguous])


def test_flat_rows_take_the_sort_and_peaked_rows_do_not_need_it():
  """Where the 256 most likely tokens hold less than p, the cut needs the sort (the fallback);
  on peaked rows alone the candidates decide it, with the same cut."""
  config = _config(top_p=0.9)
  z = _logits(1)
  probs = np.exp(z - z.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  top = -np.sort(-probs, axis=-1)[:, :draw.TOP_P_CANDIDATES].sum(-1)
  assert np.any(top < 0.9) and np.any(top >= 0.9)  # both kinds of row in the batch
  peaked = z[top >= 0.9]
  want = np.asarray(draw.truncate_logits(jnp.asarray(peaked), config)) > NEG
  np.testing.assert_array_equal(_cut_keep(peaked, config), want)


def _previous_draw(logits, key, config, banned=None):
  """The draw before issue 62: the sort-based truncation, two softmax normalisers, the inverse
  CDF over the vocabulary padded to a multiple of 256."""
  z = logits.astype(jnp.float32) / config.temperature
  zt = z if banned is None else jnp.where(banned, NEG, z)
  zt = draw.truncate_logits(zt, config) if config.truncates else zt
  lse = jax.nn.logsumexp(z, -1, keepdims=True)
  zt_max = jnp.max(zt, -1, keepdims=True)
  weights = jnp.exp(zt - zt_max)
  lse_t = zt_max + jnp.log(jnp.sum(weights, -1, keepdims=True))
  if config.greedy:
    tokens = jnp.argmax(zt, -1).astype(jnp.int32)
  else:
    u = jax.random.uniform(key, (z.shape[0], 1), minval=jnp.finfo(jnp.float32).tiny, maxval=1.0)
    cdf = jnp.cumsum(weights, -1)
    tokens = jnp.sum(cdf < u * cdf[:, -1:], -1).astype(jnp.int32)
  pick = lambda x: jnp.take_along_axis(x, tokens[:, None], -1)[:, 0]  # noqa: E731
  return tokens, pick(z - lse), pick(zt - lse_t)


@pytest.mark.parametrize("kw", [dict(), dict(top_p=0.9), dict(top_k=20, top_p=0.95),
                                dict(min_p=0.05), dict(top_k=50, top_p=0.9, min_p=0.02,
                                                       temperature=0.7), dict(greedy=True)])
@pytest.mark.parametrize("banned", [False, True])
def test_tokens_and_logprobs_equal_the_previous_draw(kw, banned):
  """Fixed keys, 64 rows × 1000 tokens (blocks of 250): the same tokens as the sort-based
  draw with a flat CDF, the same log-probs to float32 rounding. The rows whose draw falls within
  rounding of a CDF step may differ: at most 2 of 64 × 5 keys."""
  config = _config(**kw)
  z = jnp.asarray(_logits(2))
  ban = jnp.zeros(1000, bool).at[jnp.asarray([0, 3, int(jnp.argmax(z[0]))])].set(True)
  ban = ban if banned else None
  new = jax.jit(draw.sample_token, static_argnums=2)
  old = jax.jit(_previous_draw, static_argnums=2)
  differ = 0
  for seed in range(5):
    key = jax.random.key(seed)
    tok, logp, slogp = new(z, key, config, ban)
    tok0, logp0, slogp0 = old(z, key, config, ban)
    same = np.asarray(tok) == np.asarray(tok0)
    differ += int((~same).sum())
    np.testing.assert_allclose(np.asarray(logp)[same], np.asarray(logp0)[same], atol=2e-5)
    np.testing.assert_allclose(np.asarray(slogp)[same], np.asarray(slogp0)[same], atol=2e-5)
    if banned:
      assert not np.any(np.isin(np.asarray(tok), [0, 3]))
  assert differ <= 2, differ


@pytest.mark.parametrize("vocab, block", [(1009, 256), (151936, 128), (49152, 256)])
def test_the_blocks_divide_the_vocabulary_or_pad_it(vocab, block):
  """Qwen's 151936 = 1187 · 128 takes blocks of 128 (a reshape, no copy); a prime vocabulary
  pads to a multiple of 256; the draw is right either way (a tail of 15 padded slots)."""
  assert draw.cdf_block(vocab) == block
  if vocab != 1009:
    return
  rng = np.random.default_rng(3)
  weights = rng.gamma(0.5, size=vocab).astype(np.float32)
  weights[900:] *= 20  # much of the mass in the last, padded block
  tokens = np.asarray(jax.jit(lambda k: draw._inverse_cdf_sample(  # pylint: disable=protected-access
      k, jnp.broadcast_to(jnp.asarray(weights), (40_000, vocab))))(jax.random.key(4)))
  assert tokens.max() < vocab and np.mean(tokens >= 768) > 0.5
  p_value, _, _ = chi_square_pvalue(np.bincount(tokens, minlength=vocab), weights)
  assert p_value > 1e-3, p_value
