"""Dynamic sampling (``rl.dynamic_sampling``, ``rl.oversample``; ``ppojax.core.selection``): the
groups kept against a NumPy rule written out here, the fill's rows out of the loss, and through
the compiled step: B·f prompts sampled, B groups learned from, and the update on the kept rows
(packed, the fill's rows taking no slot) equal to an update given those rows directly."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_step import _assert_close, toy_config

from ppojax.core import algorithms, selection
from ppojax.infra import sharding
from ppojax.learner import experience
from ppojax.models import passes
from ppojax.run import build as build_lib
from ppojax.run import checks


def _np_select(scores, n, keep):
  """Groups whose scores differ, in their order, then the others in theirs; the first ``keep``."""
  groups = scores.reshape(-1, n)
  spread = [g for g in range(len(groups)) if groups[g].max() != groups[g].min()]
  flat = [g for g in range(len(groups)) if groups[g].max() == groups[g].min()]
  chosen = (spread + flat)[:keep]
  rows = np.concatenate([np.arange(g * n, g * n + n) for g in chosen])
  in_loss = np.repeat([g in spread for g in chosen], n)
  return rows, in_loss, len(flat) / len(groups), np.mean([g in spread for g in chosen])


@pytest.mark.parametrize("seed, keep", [(0, 3), (1, 5), (2, 8)])
def test_the_groups_kept_are_those_with_a_spread_first_in_sampled_order(seed, keep):
  rng = np.random.default_rng(seed)
  scores = rng.integers(0, 2, (8, 4)).astype(np.float32)
  scores[[1, 4, 6]] = scores[[1, 4, 6], :1]  # three groups whose scores are all equal
  rows, in_loss, metrics = selection.select_groups(jnp.asarray(scores.ravel()), 4, keep)
  want_rows, want_in, zero, kept = _np_select(scores.ravel(), 4, keep)
  np.testing.assert_array_equal(np.asarray(rows), want_rows)
  np.testing.assert_array_equal(np.asarray(in_loss), want_in)
  assert float(metrics["zero_spread_fraction"]) == pytest.approx(zero)
  assert float(metrics["kept_fraction"]) == pytest.approx(kept)
  if keep == 8:  # a shortfall: the fill's rows are out of the loss
    assert not np.asarray(in_loss).all()
  with pytest.raises(ValueError, match="keep=9 groups of the 8 sampled"):
    selection.select_groups(jnp.asarray(scores.ravel()), 4, 9)


def _config(**over):
  return toy_config(**{"algorithm": "grpo", "rl.batch_size": 4, "sampling.num_samples_per_prompt":
                       4, "rl.num_epochs": 1, "rl.num_minibatches": 1, **over})


def test_the_options_are_checked():
  for over, match in (({"rl.oversample": 2.0}, "rl.oversample=2.0 samples more prompts"),
                      ({"rl.oversample": 0.5, "rl.dynamic_sampling": True},
                       "rl.oversample=0.5 must be >= 1"),
                      ({"rl.dynamic_sampling": True, "algorithm": "ppo",
                        "sampling.num_samples_per_prompt": 1}, "rl.dynamic_sampling keeps")):
    with pytest.raises(checks.ConfigError, match=match):
      checks.validate(_config(**over), num_devices=1)


def test_the_fills_rows_leave_the_loss():
  config = _config(**{"rl.dynamic_sampling": True})
  rows, b = 8, 5
  mask = np.arange(b)[None] < np.array([5, 3, 4, 1, 5, 2, 5, 5])[:, None]
  in_loss = np.repeat([True, False], 4)
  from ppojax.rollout.rollout import Rollout  # pylint: disable=import-outside-toplevel
  z = jnp.zeros((rows, b))
  r = Rollout(jnp.zeros((rows, 2), jnp.int32), jnp.ones((rows, 2), bool), jnp.zeros((rows, b),
              jnp.int32), jnp.asarray(mask), jnp.ones(rows, bool), z, z, None,
              sampler_logp=z, in_loss=jnp.asarray(in_loss))
  exp, metrics = experience.make_experience(r, jnp.arange(rows, dtype=jnp.float32), 0.0,
                                            algorithms.from_config(config),
                                            algorithms.resolve(config).rl, 4)
  np.testing.assert_array_equal(np.asarray(experience.loss_tokens(exp)), mask & in_loss[:, None])
  assert float(metrics["rollout/rows_in_loss"]) == 0.5


def test_the_step_samples_b_times_f_prompts_and_learns_from_b_groups():
  """GRPO, 4 prompts × 4 samples, oversample 2, two shuffled minibatches of 8 rows: the source
  draws 8 prompts, the rollout has 32 rows, the update 16. Its result equals the plain step's
  update given those 16 rows (their scores, and the fill's rows marked out of the loss)
  directly; the metrics say what was kept. The scores given: only groups 1 and 6 differ, so 2
  of the 4 groups learned from are the fill's. The step packs its minibatches
  (``rl.pack_fractions`` (1,): 8 rows of T slots each) and the plain one does not: the fill's
  rows take no slot (``loss.packed_or_padded`` given the loss mask), so the slots filled are
  the kept groups' tokens whatever the shuffle."""
  two = {"rl.num_minibatches": 2}
  dyn = build_lib.build(_config(**two, **{"rl.dynamic_sampling": True, "rl.oversample": 2.0,
                                          "rl.pack_fractions": (1.0,)}))
  plain = build_lib.build(_config(**two))
  prompts = sharding.place_prompts(dyn.source.batch(0).prompts, dyn.mesh)
  assert prompts.tokens.shape[0] == 8
  state = jax.tree.map(jnp.copy, dyn.state)
  r = dyn.step.rollout(state, dyn.frozen, prompts)
  assert r.responses.shape[0] == 32 and dyn.step.score(dyn.frozen, r).shape == (32,)
  scores = jnp.zeros(32).at[jnp.array([4, 6, 25])].set(1.0)
  rows, in_loss, _ = selection.select_groups(scores, 4, 4)
  new, metrics = dyn.step.learn(jax.tree.map(jnp.copy, state), r, scores)
  kept = jax.tree.map(lambda x: x[rows], r._replace(prefix=None))._replace(
      prefix=r.prefix, in_loss=in_loss)
  want, want_metrics = plain.step.learn(jax.tree.map(jnp.copy, state), kept, scores[rows])
  assert float(metrics["rollout/zero_spread_fraction"]) == 0.75
  assert float(metrics["rollout/kept_fraction"]) == 0.5  # a fill: rows out of the loss
  _assert_close((new.actor, new.step), (want.actor, want.step), rtol=2e-5, atol=2e-6)
  assert float(metrics["loss/policy_avg"]) == pytest.approx(
      float(want_metrics["loss/policy_avg"]), rel=2e-5, abs=1e-7)
  _, seq_mask, _ = passes.sequence(r.prompts, r.prompt_mask, r.responses, r.mask, r.prefix)
  tokens_in_loss = float(jnp.sum(seq_mask[rows] & in_loss[:, None]))
  assert float(metrics["update/pack_fill_avg"]) == pytest.approx(
      tokens_in_loss / (16 * seq_mask.shape[1]))  # the mean of two minibatches' 8 rows
