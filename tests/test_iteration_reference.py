"""One whole PPO iteration of the compiled step against the independent float64 reference.

Every other step test compares the step with its own variants (fused vs phases, 8 devices vs
1, single vs two pass), which share ``make_experience`` and the minibatch code: a wiring bug
common to all of them (old and reference log-probs swapped, the wrong rows in a minibatch, the
update at another temperature than the sampler) would pass them all. Here the step's rollout
(its sampled responses only) is pushed through ``tests/reference.py``:

    log π_old, log π_ref, V_old   plain forward passes of the models over whole rows (no prefix,
                                  no cache, no chunking), log-softmax at T in NumPy
    rewards, GAE, whitening       reference.shape_rewards, reference.gae
    E × M minibatches             the step's documented row order (permutations of the update
                                  key), each minibatch's loss and its analytic cotangents from
                                  reference.ppo_loss / policy_loss / value_loss, pulled back
                                  through the models' forward passes; one SGD step each

and the step's metrics, rollout and updated parameters must equal the reference's. The step is
built with SGD (lr 0.2) instead of Adam so that its parameter change *is* the gradient. The
mis-wired twins below must fail the same check. GRPO, Dr. GRPO, RLOO and REINFORCE++ go through
the same check, each algorithm's estimator, KL placement, KL estimator and aggregation as the
reference reads them (``ALGORITHMS``, written out here), never from the resolved config.
"""

from __future__ import annotations

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import reference as ref

from ppojax.core import algorithms
from ppojax.learner import step as step_lib
from ppojax.learner import loss as loss_lib
from ppojax.learner import update as update_lib
from ppojax.run import build as build_lib
from ppojax.tasks import count

_TOY = pathlib.Path(__file__).parents[1] / "configs" / "toy.py"
LR = 0.2
STOP_IDS = (count.STOP,)  # configs/toy.py: sampling.stop_ids
# Two-pass: 2 epochs × 2 minibatches × 2 micro-batches (shuffled rows, parameters that move
# between minibatches, ratios away from 1); single-pass: the default 1 × 1 × 1 of the quickstart.
SPLITS = {"two_pass": (2, 2, 2), "single_pass": (1, 1, 1)}


def _config(split: str, temperature: float, algorithm: str = "ppo"):
  e, m, k = SPLITS[split]
  grouped = {} if algorithm == "ppo" else {
      "algorithm": algorithm, "rl__batch_size": 4, "sampling__num_samples_per_prompt": 4}
  return algorithms.resolve(build_lib.load_config(
      _TOY, **{"rl__batch_size": 16, "rl__num_epochs": e, "rl__num_minibatches": m,
               "rl__grad_accum": k, "rl__clip_eps": 0.05, "rl__value_clip": 0.05,
               "rl__kl_coef": 0.2, "rl__ent_coef": 0.01, "sampling__temperature": temperature,
               **grouped}))


def _moved(run):
  """(run, a state whose actor has moved away from the reference, prompts): the actor is the
  reference plus noise (as after some training), so that old and reference log-probs differ
  and the KL is not 0."""
  state = jax.device_get(run.state)
  leaves, treedef = jax.tree.flatten(state.actor)
  keys = jax.random.split(jax.random.key(7), len(leaves))
  moved = [x + 0.05 * np.asarray(jax.random.normal(k, x.shape), x.dtype) * np.std(x)
           for x, k in zip(leaves, keys)]
  return run, state._replace(actor=jax.tree.unflatten(treedef, moved)), run.source.batch(0).prompts


@pytest.fixture(scope="module", params=[1.0, 0.7], ids=["T1.0", "T0.7"])
def trained(request):
  """``_moved`` at the sampling temperature ``request.param``."""
  return _moved(build_lib.build(_config("two_pass", request.param)))


def _sgd_step(run, config):
  """The run's compiled step with SGD(LR) for both models: parameter change = −LR·gradient."""
  sgd = optax.sgd(LR)
  return sgd, step_lib.make_step(run.models, run.algorithm, sgd, sgd, optax.constant_schedule(LR),
                                     run.sampling, config.rl)


# ---------------------------------------------------------------------------------------------
# The reference: plain forward passes, then tests/reference.py.
# ---------------------------------------------------------------------------------------------


def _whole_rows(r):
  """prompt + response as whole rows: tokens, mask, positions [B, P + R] (the response mask
  from the reference's first-stop rule)."""
  tokens = np.concatenate([r.prompts, r.responses], axis=1)
  mask = np.concatenate([np.asarray(r.prompt_mask, bool),
                         ref.response_mask(r.responses, STOP_IDS)], axis=1)
  positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
  return tokens, mask, positions


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def _policy_outputs(policy, params, rows, n_resp: int, temperature: float):
  """(log π_T(response_t), H_T at t) [B, R] in JAX float32, differentiable in ``params``."""
  tokens, mask, positions = rows
  logits, _ = policy.apply({"params": params}, tokens, positions, mask)
  z = logits[:, -n_resp - 1:-1].astype(jnp.float32) / temperature
  logp_all = jax.nn.log_softmax(z, axis=-1)
  logp = jnp.take_along_axis(logp_all, tokens[:, -n_resp:, None], axis=-1)[..., 0]
  entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
  return logp, entropy


@functools.partial(jax.jit, static_argnums=(0, 3))
def _values(critic, params, rows, n_resp: int):
  tokens, mask, positions = rows
  out, _ = critic.apply({"params": params}, tokens, positions, mask)
  return out[:, -n_resp - 1:-1]


def _np_logp(policy, params, rows, responses, temperature):
  """log π_T(response_t) from the logits in float64 NumPy (reference.selective_log_softmax)."""
  n = responses.shape[1]
  logits = _logits(policy, params, rows)
  return ref.selective_log_softmax(np.asarray(logits[:, -n - 1:-1], np.float64), responses,
                                   temperature)


@functools.partial(jax.jit, static_argnums=0)
def _logits(policy, params, rows):
  tokens, mask, positions = rows
  return policy.apply({"params": params}, tokens, positions, mask)[0]


@functools.partial(jax.jit, static_argnums=(0, 1, 5))
def _pullback(fn, model, params, rows, cotangent, static):
  """∂⟨cotangent, fn(model, params, rows, *static)⟩/∂params (one jitted VJP)."""
  return jax.vjp(lambda p: fn(model, p, rows, *static), params)[1](cotangent)[0]


# Each algorithm as the reference reads it (docs/algorithms.md's table), written out here and
# never taken from the resolved config: (advantage estimator, the KL as a loss term (else in the
# token rewards), KL estimator, aggregation, policy term).
ALGORITHMS = {
    "ppo": ("gae", False, "k1", "token_mean", "clip"),
    "grpo": ("grpo", True, "k3", "seq_mean_token_mean", "clip"),
    "dr_grpo": ("dr_grpo", True, "k3", "seq_mean_token_sum_norm", "clip"),
    "rloo": ("rloo", False, "k1", "token_mean", "clip"),
    "reinforce_pp": ("reinforce_pp", False, "k2", "token_mean", "clip"),
    "gspo": ("grpo", True, "k3", "seq_mean_token_mean", "gspo"),
    "cispo": ("grpo", True, "k3", "token_mean", "cispo"),
}


def _policy_term(mode, logp, old_logp, adv, mask, clip_eps, agg):
  """(loss, metrics, dloss/dlogp) of the reference's policy term ``mode`` (clip ε both sides)."""
  if mode == "clip":
    return ref.policy_loss(logp, old_logp, adv, mask, clip_eps, **agg)
  if mode == "cispo":
    return ref.cispo_loss(logp, old_logp, adv, mask, clip_eps, clip_eps, **agg)
  return ref.gspo_loss(logp, old_logp, adv, mask, clip_eps, clip_eps, **agg)


def _advantages(estimator, rewards, old_values, mask, rl, n):
  """(advantages, returns or None) of the reference's estimator on the shaped token rewards."""
  if estimator == "gae":
    return ref.gae(rewards, old_values, mask, rl.gamma, rl.lam, whiten=rl.whiten_advantages)
  if estimator == "reinforce_pp":  # discounted returns, whitened over every token of the batch
    return ref.reinforce_pp(rewards, mask, rl.gamma)[0], None
  # a sequence estimator on the groups of n: the sequence reward Σ_t r_t
  group = {"grpo": ref.grpo, "dr_grpo": ref.dr_grpo, "rloo": ref.rloo}[estimator]
  return group(rewards.sum(axis=1), mask, n), None


def reference_iteration(run, config, state, r):
  """(metrics, actor, critic, rollout fields) of one iteration from the step's sampled
  ``r.responses``, computed by the reference (the algorithm's settings from ``ALGORITHMS``)."""
  rl, temperature = config.rl, config.sampling.temperature
  estimator, kl_in_loss, kl_estimator, aggregation, mode = ALGORITHMS[config.algorithm]
  policy, critic = run.models.policy, run.models.critic  # critic None: critic-free
  responses = np.asarray(r.responses)
  n_resp = responses.shape[1]
  rows = _whole_rows(r)
  mask = rows[1][:, -n_resp:]
  has_stop = ref.has_stop_token(responses, STOP_IDS)
  old_logp = np.where(mask, _np_logp(policy, state.actor, rows, responses, temperature), 0.0)
  ref_logp = np.where(mask, _np_logp(policy, run.frozen.reference, rows, responses,
                                     temperature), 0.0)
  old_values = None if critic is None else np.where(
      mask, np.asarray(_values(critic, state.critic, rows, n_resp), np.float64), 0.0)
  scores = count.count_reward_numpy(r).astype(np.float64)
  beta = float(state.kl.beta)
  rewards, kl_metrics = ref.shape_rewards(
      scores, old_logp, ref_logp, mask, 0.0 if kl_in_loss else beta, has_stop,
      kl_estimator, rl.score_clip, rl.missing_stop_penalty, rl.whiten_rewards)
  adv, ret = _advantages(estimator, rewards, old_values, mask, rl,
                         run.sampling.num_samples_per_prompt)
  agg = dict(aggregation=aggregation, max_len=n_resp)

  # The update: the rows of minibatch j of epoch e are permutation_e(rows)[j·n : (j+1)·n], the
  # permutations drawn from the third key of split(state.key, 3) (step._keys).
  e, m = rl.num_epochs, rl.num_minibatches
  k_update = jax.random.split(state.key, 3)[2]
  perms = [np.asarray(jax.random.permutation(k, len(responses)))
           for k in jax.random.split(k_update, e)]
  n = len(responses) // m
  actor, critic_params, steps = state.actor, state.critic, []
  for idx in (p[j * n:(j + 1) * n] for p in perms for j in range(m)):
    sub = tuple(x[idx] for x in rows)
    logp, entropy = _policy_outputs(policy, actor, sub, n_resp, temperature)
    logp, entropy = np.asarray(logp, np.float64), np.asarray(entropy, np.float64)
    pg, pm, d_logp = _policy_term(mode, logp, old_logp[idx], adv[idx], mask[idx], rl.clip_eps,
                                  agg)
    ent = ref.entropy_bonus(entropy, mask[idx], **agg)
    total = pg - rl.ent_coef * ent
    metrics = {"loss/policy": pg, "policy/approxkl_masked": pm["approxkl"],
               "policy/clipfrac": pm["clipfrac"], "policy/dual_clipfrac": pm["dual_clipfrac"],
               "val/ratio_masked": pm["ratio"], "policy/entropy_masked": ent}
    if kl_in_loss:  # + β·agg(KL_t) and its gradient
      kl_term, km, d_kl = ref.kl_loss(logp, ref_logp[idx], mask[idx], beta, kl_estimator,
                                      **agg)
      total, d_logp = total + kl_term, d_logp + d_kl
      metrics.update({"loss/kl": kl_term, "policy/kl": km["kl"]})
    d_entropy = -rl.ent_coef * ref.aggregate_weights(mask[idx], aggregation, n_resp)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    g_actor = _pullback(_policy_outputs.__wrapped__, policy, actor, sub,
                        (f32(d_logp), f32(d_entropy)), (n_resp, temperature))
    if critic is not None:
      values = np.asarray(_values(critic, critic_params, sub, n_resp), np.float64)
      vf, vm, d_values = ref.value_loss(values, old_values[idx], ret[idx], mask[idx],
                                        rl.value_clip, **agg)
      total += rl.vf_coef * vf
      metrics.update({"loss/value": vf, "val/clipfrac": vm["clipfrac"], "val/error": vm["error"],
                      "val/values": vm["values"]})
      g_critic = _pullback(_values.__wrapped__, critic, critic_params, sub,
                           f32(rl.vf_coef * d_values), (n_resp,))
      metrics["val/grad_norm"] = float(optax.tree.norm(g_critic))
      critic_params = jax.tree.map(lambda p, g: p - LR * g, critic_params, g_critic)
    metrics["loss/total"] = total
    # a variance does not add up over micro-batches: the step's val/ratio_token_var is the
    # token-weighted mean of its K micro-batches' variances (micro-batch k: rows k·n/K ...)
    ratio = np.exp(logp - old_logp[idx])
    if mode.startswith("gspo"):  # the sequence's ratio on each of its tokens
      lengths = np.maximum(mask[idx].sum(axis=1, keepdims=True), 1)
      ratio = np.broadcast_to(np.exp(np.where(mask[idx], logp - old_logp[idx], 0.0).sum(
          axis=1, keepdims=True) / lengths), ratio.shape)
    micro = np.array_split(np.arange(n), rl.grad_accum)
    metrics["val/ratio_token_var"] = sum(
        mask[idx][i].sum() * ref.masked_var(ratio[i], mask[idx][i]) for i in micro
    ) / mask[idx].sum()
    metrics["policy/grad_norm"] = float(optax.tree.norm(g_actor))
    actor = jax.tree.map(lambda p, g: p - LR * g, actor, g_actor)
    steps.append(metrics)
  metrics = {f"{k}_avg": np.mean([s[k] for s in steps]) for k in steps[0]}
  metrics.update({f"objective/{k}": v for k, v in kl_metrics.items()
                  if k in ("kl", "scores", "non_score_reward", "rlhf_reward")})
  metrics["objective/entropy_masked"] = np.mean(np.sum(-old_logp, axis=1))
  if run.sampling.num_samples_per_prompt > 1:  # trl GRPOTrainer's names
    groups = ref.adjust_scores(scores).reshape(-1, run.sampling.num_samples_per_prompt)
    metrics.update(reward=groups.mean(), reward_std=groups.std(axis=1, ddof=1).mean())
  fields = {"mask": mask, "has_stop": has_stop, "old_logp": old_logp, "ref_logp": ref_logp}
  if old_values is not None:
    fields["old_values"] = old_values
  return metrics, actor, critic_params, fields


def check_iteration(run, config, state, prompts):
  """Runs the step's fused iteration with SGD and asserts it equals the reference's."""
  sgd, step = _sgd_step(run, config)
  sgd_state = state._replace(actor_opt=sgd.init(state.actor), critic_opt=(
      None if state.critic is None else sgd.init(state.critic)))
  new, metrics, r, _ = step.fused(jax.tree.map(jnp.copy, sgd_state), run.frozen, prompts)  # donated
  new, metrics, r = jax.device_get((new, metrics, r))
  want, actor, critic, fields = reference_iteration(run, config, sgd_state, r)
  for name, value in fields.items():
    np.testing.assert_allclose(np.asarray(getattr(r, name), np.float64), value, rtol=0,
                               atol=2e-5, err_msg=f"rollout.{name}")
  for name, value in want.items():
    assert name in metrics, name
    np.testing.assert_allclose(metrics[name], value, rtol=2e-4, atol=2e-6, err_msg=name)
  assert (new.critic is None) == (critic is None) == (run.models.critic is None)
  for got, expected, model in ((new.actor, actor, "actor"), (new.critic, critic, "critic")):
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(expected)):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-6,
                                 err_msg=f"{model}{jax.tree_util.keystr(path)}")
  return want


@pytest.mark.parametrize("split", list(SPLITS))
def test_step_equals_the_reference_iteration(trained, split):
  run, state, prompts = trained
  config = _config(split, run.config.sampling.temperature)
  want = check_iteration(run, config, state, prompts)
  assert abs(want["objective/kl"]) > 1e-4  # the actor has moved away from the reference
  if split == "two_pass":  # the clips were exercised, not only the unclipped branch
    assert want["policy/clipfrac_avg"] > 0 and want["val/clipfrac_avg"] > 0
    assert abs(want["val/ratio_masked_avg"] - 1) > 1e-3


# The critic-free algorithms: 4 prompts × 4 samples, the KL as a loss term (GRPO, Dr. GRPO), in
# the sequence reward (RLOO) or in the token rewards (REINFORCE++, k2), each with its own
# aggregation (seq_mean_token_mean, seq_mean_token_sum_norm, token_mean, token_mean); GSPO and
# CISPO: GRPO's advantages under the sequence-ratio and the clipped-weight policy terms.
@pytest.fixture(scope="module", params=["grpo", "dr_grpo", "rloo", "reinforce_pp", "gspo",
                                        "cispo"])
def trained_grouped(request):
  return _moved(build_lib.build(_config("two_pass", 0.7, request.param)))


@pytest.mark.parametrize("split", list(SPLITS))
def test_critic_free_step_equals_the_reference_iteration(trained_grouped, split):
  run, state, prompts = trained_grouped
  algorithm = run.config.algorithm
  if split == "single_pass" and algorithm != "grpo":
    pytest.skip("the single-pass path once (GRPO) is enough: it shares everything else")
  assert run.models.critic is None and state.critic is None and state.critic_opt is None
  want = check_iteration(run, _config(split, 0.7, algorithm), state, prompts)
  assert abs(want["objective/kl"]) > 1e-4
  assert want["reward_std"] > 0  # the groups' scores differ: the advantages are not all 0
  if ALGORITHMS[algorithm][1]:  # the KL as a loss term
    assert want["loss/kl_avg"] > 1e-5
  if split == "two_pass":
    assert want["policy/clipfrac_avg"] > 0


def _miswired(monkeypatch, module, name, wrap):
  monkeypatch.setattr(module, name, wrap(getattr(module, name)))


MISWIRINGS = {
    # log π_old and log π_ref exchanged in the rollout
    "swapped_old_ref": (step_lib, "passes_on", lambda f: lambda *a, **k: (lambda r: r._replace(
        old_logp=r.ref_logp, ref_logp=r.old_logp))(f(*a, **k))),
    # each minibatch takes the rows after its own
    "wrong_minibatch_rows": (update_lib, "take_rows", lambda f: lambda exp, idx: f(
        exp, (idx + 1) % exp.advantages.shape[0])),
    # the update's log-probs and entropy at T = 1 whatever the sampler's temperature
    "update_at_temperature_1": (loss_lib, "actor_forward", lambda f: (
        lambda a, m, r, t, e, *rest: f(a, m, r, 1.0, e, *rest))),
}


@pytest.mark.parametrize("name", list(MISWIRINGS))
def test_a_miswired_step_fails_the_check(trained, monkeypatch, name):
  run, state, prompts = trained
  temperature = run.config.sampling.temperature
  if temperature == 1.0:
    pytest.skip("the twins run at T = 0.7 only (at T = 1 the temperature twin changes nothing)")
  config = _config("two_pass", temperature)
  _miswired(monkeypatch, *MISWIRINGS[name])
  with pytest.raises(AssertionError):
    check_iteration(run, config, state, prompts)
