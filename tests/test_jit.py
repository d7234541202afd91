"""Every public function of ops, kl, rewards, advantages and losses (and the KL controllers) is
jit-compatible, traces exactly once for fixed shapes and dtypes (hyper-parameters that may be
arrays are passed as traced float32 scalars and changed between calls), and gives under
``jax.vmap`` over an extra leading axis the same result as a Python loop.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppojax.core import advantages, correction, kl, logprobs, losses, ops, rewards, surrogates

B, T, V = 2, 5, 11
N_CALLS = 3
F32 = np.float32
STOP_IDS = np.asarray([3, 7], np.int32)
ML = 8.0  # seq_mean_token_sum_norm's constant


class Case(NamedTuple):
  fn: Callable  # takes only arrays
  gen: Callable[[np.random.Generator], tuple]  # one call's arguments, fixed shapes and dtypes


def _x(rng, shape=(B, T), lo=-3.0, hi=3.0):
  return rng.uniform(lo, hi, shape).astype(F32)


def _logp(rng, shape=(B, T)):
  return rng.uniform(-8.0, 0.0, shape).astype(F32)


def _mask(rng, kind=np.bool_, shape=(B, T), min_rows=0):
  lengths = rng.integers(0, shape[1] + 1, shape[0])
  lengths[0] = max(lengths[0], 2)  # not all empty, so values differ between calls
  if min_rows:  # a random number of non-empty rows, the others empty
    lengths[rng.integers(min_rows, shape[0] + 1):] = 0
  return (np.arange(shape[1])[None, :] < lengths[:, None]).astype(kind)


def _scalar(rng, lo, hi):
  return F32(rng.uniform(lo, hi))


def _tokens(rng):
  return rng.integers(0, V, (B, T)).astype(np.int32)


def _logits(rng, dtype=np.float32):
  return jnp.asarray(rng.normal(0, 3, (B, T, V)), dtype)


CASES: dict[str, Case] = {}


def case(name, fn, gen):
  assert name not in CASES
  CASES[name] = Case(fn, gen)


# --- ops: masked statistics ------------------------------------------------------------------------
case("ops.masked_sum", ops.masked_sum, lambda r: (_x(r), _mask(r)))
case("ops.masked_sum/axis1", lambda x, m: ops.masked_sum(x, m, axis=1), lambda r: (_x(r), _mask(r)))
case("ops.masked_count", ops.masked_count, lambda r: (_mask(r),))
case("ops.masked_mean", ops.masked_mean, lambda r: (_x(r), _mask(r)))
case("ops.masked_mean/axis1/float_mask", lambda x, m: ops.masked_mean(x, m, axis=1),
     lambda r: (_x(r), _mask(r, np.float32)))
case("ops.masked_var", ops.masked_var, lambda r: (_x(r), _mask(r)))
case("ops.masked_var/biased", lambda x, m: ops.masked_var(x, m, unbiased=False),
     lambda r: (_x(r), _mask(r)))
case("ops.masked_whiten", lambda x, m, eps: ops.masked_whiten(x, m, eps=eps),
     lambda r: (_x(r), _mask(r), _scalar(r, 1e-8, 1e-6)))
case("ops.masked_whiten/no_shift", lambda x, m: ops.masked_whiten(x, m, shift_mean=False),
     lambda r: (_x(r), _mask(r)))
for _agg in ops.AGGREGATIONS:
  case(f"ops.aggregate/{_agg}", lambda x, m, a=_agg: ops.aggregate(x, m, a, ML),
       lambda r: (_x(r), _mask(r)))
  case(f"ops.aggregation_count/{_agg}", lambda m, a=_agg: ops.aggregation_count(m, a),
       lambda r: (_mask(r, shape=(32, T), min_rows=1),))
case("ops.aggregate/seq_mean_token_sum_norm/traced_max_len",
     lambda x, m, c: ops.aggregate(x, m, "seq_mean_token_sum_norm", c),
     lambda r: (_x(r), _mask(r), _scalar(r, 5, 10)))

# --- logprobs: log-probs and entropy (value and custom VJP, float32 and bf16, chunked) ---------
case("logprobs.selective_log_softmax", logprobs.selective_log_softmax,
     lambda r: (_logits(r), _tokens(r), _scalar(r, 0.5, 1.5)))
case("logprobs.selective_log_softmax/bf16/chunk3",
     lambda z, tok, temp: logprobs.selective_log_softmax(z, tok, temp, chunk_size=3),
     lambda r: (_logits(r, jnp.bfloat16), _tokens(r), _scalar(r, 0.5, 1.5)))
case("logprobs.selective_log_softmax/grad",
     jax.grad(lambda z, tok, temp, w: jnp.sum(w * logprobs.selective_log_softmax(z, tok, temp, 4)),
              argnums=(0, 2)),
     lambda r: (_logits(r), _tokens(r), _scalar(r, 0.5, 1.5), _x(r)))
case("logprobs.entropy_from_logits", logprobs.entropy_from_logits,
     lambda r: (_logits(r), _scalar(r, 0.5, 1.5)))
case("logprobs.entropy_from_logits/bf16/chunk3",
     lambda z, temp: logprobs.entropy_from_logits(z, temp, chunk_size=3),
     lambda r: (_logits(r, jnp.bfloat16), _scalar(r, 0.5, 1.5)))
case("logprobs.entropy_from_logits/grad",
     jax.grad(lambda z, temp, w: jnp.sum(w * logprobs.entropy_from_logits(z, temp, 4)),
              argnums=(0, 1)),
     lambda r: (_logits(r), _scalar(r, 0.5, 1.5), _x(r)))

# --- ops: stop tokens and masks ------------------------------------------------------------------
case("ops.is_stop_token", ops.is_stop_token, lambda r: (_tokens(r), STOP_IDS))
case("ops.response_mask", ops.response_mask, lambda r: (_tokens(r), STOP_IDS))
case("ops.response_mask/static_ids", lambda tok: ops.response_mask(tok, [3, 7]),
     lambda r: (_tokens(r),))
case("ops.has_stop_token", ops.has_stop_token, lambda r: (_tokens(r), STOP_IDS))
case("ops.truncate_after_stop", ops.truncate_after_stop,
     lambda r: (_tokens(r), STOP_IDS, np.int32(r.integers(0, V))))
case("ops.last_index", ops.last_index, lambda r: (_mask(r),))
case("ops.last_token_mask", ops.last_token_mask, lambda r: (_mask(r),))
case("ops.gather_last", ops.gather_last, lambda r: (_x(r), _mask(r)))

# --- kl ------------------------------------------------------------------------------------------
for _name, _fn in [("kl_k1", kl.kl_k1), ("kl_k2", kl.kl_k2), ("kl_k3", kl.kl_k3),
                   ("kl_abs", kl.kl_abs), ("kl_clamp", kl.kl_clamp)]:
  case(f"kl.{_name}", _fn, lambda r: (_logp(r), _logp(r)))
for _est in sorted(kl.KL_ESTIMATORS):
  case(f"kl.per_token_kl/{_est}", lambda a, b, e=_est: kl.per_token_kl(a, b, e),
       lambda r: (_logp(r), _logp(r)))
_fixed = kl.fixed_kl_controller(0.05)
_adaptive = kl.adaptive_kl_controller(0.05, target=6.0, horizon=1000.0)
case("kl.fixed_kl_controller.init", _fixed.init, lambda r: ())
case("kl.fixed_kl_controller.update", _fixed.update,
     lambda r: (kl.KLControllerState(_scalar(r, 0.01, 0.2)), _scalar(r, 0, 20), F32(64)))
case("kl.adaptive_kl_controller.init", _adaptive.init, lambda r: ())
case("kl.adaptive_kl_controller.update", _adaptive.update,
     lambda r: (kl.KLControllerState(_scalar(r, 0.01, 0.2)), _scalar(r, 0, 20),
                F32(r.integers(1, 512))))

# --- rewards -------------------------------------------------------------------------------------
case("rewards.adjust_scores",
     lambda s, hs, c, p: rewards.adjust_scores(s, hs, score_clip=c, missing_stop_penalty=p),
     lambda r: (_x(r, (B,), -10, 10), r.random(B) < 0.5, _scalar(r, 1, 5), _scalar(r, 0, 2)))
case("rewards.adjust_scores/plain", rewards.adjust_scores, lambda r: (_x(r, (B,)),))
for _est in ("k1", "k3"):
  for _whiten in (False, True):
    case(f"rewards.shape_rewards/{_est}/whiten={_whiten}",
         lambda s, lp, ref, m, beta, hs, c, p, e=_est, w=_whiten: rewards.shape_rewards(
             s, lp, ref, m, beta, has_stop=hs, kl_estimator=e, score_clip=c,
             missing_stop_penalty=p, whiten=w),
         lambda r: (_x(r, (B,)), _logp(r), _logp(r), _mask(r), _scalar(r, 0, 0.2),
                    r.random(B) < 0.5, _scalar(r, 1, 5), _scalar(r, 0, 2)))
case("rewards.shape_rewards/defaults", rewards.shape_rewards,
     lambda r: (_x(r, (B,)), _logp(r), _logp(r), _mask(r), _scalar(r, 0, 0.2)))

# --- advantages ----------------------------------------------------------------------------------
for _whiten in (False, True):
  case(f"advantages.gae/whiten={_whiten}",
       lambda rw, v, m, g, l, w=_whiten: advantages.gae(rw, v, m, g, l, whiten=w),
       lambda r: (_x(r), _x(r), _mask(r), _scalar(r, 0.9, 1), _scalar(r, 0.5, 1)))
case("advantages.gae/last_values",
     lambda rw, v, m, g, l, lv: advantages.gae(rw, v, m, g, l, last_values=lv),
     lambda r: (_x(r), _x(r), _mask(r), _scalar(r, 0.9, 1), _scalar(r, 0.5, 1), _x(r, (B,))))
case("advantages.gae_episodes",
     lambda rw, v, nv, c, l: advantages.gae_episodes(rw, v, nv, 0.99 * c, c, l),
     lambda r: (_x(r), _x(r), _x(r), (r.random((B, T)) < 0.9).astype(np.float32),
                _scalar(r, 0.5, 1)))
case("advantages.discounted_returns", advantages.discounted_returns,
     lambda r: (_x(r), _mask(r), _scalar(r, 0.9, 1)))
case("advantages.reinforce_pp", advantages.reinforce_pp,
     lambda r: (_x(r), _mask(r), _scalar(r, 0.9, 1)))
_N = 2  # samples per prompt: B = 2 rows form one group
for _name in ("grpo", "dr_grpo", "rloo"):
  case(f"advantages.{_name}", lambda s, m, f=getattr(advantages, _name): f(s, m, _N)[0],
       lambda r: (_x(r, (B,)), _mask(r)))
for _name in sorted(advantages.ESTIMATORS):
  case(f"advantages.estimator/{_name}",
       lambda s, rw, m, v, g, e=advantages.estimator(_name): e.fn(
           advantages.AdvantageInputs(s, rw, m, v), advantages.AdvantageParams(
               gamma=g, lam=0.9, whiten=True, group_size=_N)),
       lambda r: (_x(r, (B,)), _x(r), _mask(r), _x(r), _scalar(r, 0.9, 1)))


# --- rollout correction, overlong shaping, the policy terms' loss modes ---------------------------
for _level in correction.IS_LEVELS:
  case(f"correction.is_weight/{_level}",
       lambda old, smp, m, lv=_level: correction.is_weight(old, smp, m, 2.0, lv),
       lambda r: (_logp(r), _logp(r), _mask(r)))
for _level in correction.REJECT_LEVELS:
  case(f"correction.rejection_mask/{_level}",
       lambda old, smp, m, lo, hi, lv=_level: correction.rejection_mask(old, smp, m, lo, hi, lv),
       lambda r: (_logp(r), _logp(r), _mask(r), _scalar(r, 0.2, 0.9), _scalar(r, 1.1, 5.0)))
case("correction.sequence_log_ratio", correction.sequence_log_ratio,
     lambda r: (_x(r), _mask(r)))
case("rewards.overlong_penalty", lambda n: rewards.overlong_penalty(n, T, 3, 0.5),
     lambda r: (r.integers(0, T + 1, B).astype(np.int32),))
for _mode, _fn in surrogates.SURROGATES.items():
  case(f"surrogates.{_fn.__name__}/grad", jax.grad(
      lambda lr, adv, m, f=_fn: jnp.sum(f(lr, adv, m, 0.2, 0.28).per_token)),
      lambda r: (_x(r, lo=-0.5, hi=0.5), _x(r), _mask(r)))
case("policy_loss/gspo/grad", jax.grad(lambda lp, old, adv, m: losses.policy_loss(
    lp, old, adv, m, aggregation="seq_mean_token_mean", surrogate=surrogates.gspo)[0]),
     lambda r: (_logp(r), _logp(r), _x(r), _mask(r)))


# --- losses (value, metrics and gradients) -------------------------------------------------------
def _policy(lp, old, adv, m, eps_lo, eps_hi, c, agg):
  return losses.policy_loss(lp, old, adv, m, clip_eps_low=eps_lo, clip_eps_high=eps_hi,
                            dual_clip=c, aggregation=agg, max_len=ML)


def _policy_gen(r):
  old = _logp(r)
  return (old + _x(r, lo=-0.5, hi=0.5), old, _x(r), _mask(r), _scalar(r, 0.1, 0.3),
          _scalar(r, 0.1, 0.3), _scalar(r, 2, 4))


def _ppo(lp, old, adv, v, old_v, ret, m, ent, vf, ec, eps, vclip, agg):
  return losses.ppo_loss(lp, old, adv, v, old_v, ret, m, ent, vf_coef=vf, ent_coef=ec,
                         clip_eps=eps, value_clip=vclip, aggregation=agg, max_len=ML)


def _ppo_gen(r):
  old = _logp(r)
  return (old + _x(r, lo=-0.5, hi=0.5), old, _x(r), _x(r), _x(r), _x(r), _mask(r),
          _x(r, lo=0, hi=3), _scalar(r, 0.05, 0.5), _scalar(r, 0, 0.1), _scalar(r, 0.1, 0.3),
          _scalar(r, 0.1, 0.3))


for _agg in ops.AGGREGATIONS:
  case(f"losses.policy_loss/{_agg}", lambda *a, g=_agg: _policy(*a, g), _policy_gen)
  case(f"losses.policy_loss/{_agg}/grad",
       jax.grad(lambda *a, g=_agg: _policy(*a, g)[0]), _policy_gen)
  case(f"losses.value_loss/{_agg}",
       lambda v, ov, ret, m, c, g=_agg: losses.value_loss(v, ov, ret, m, clip_range=c,
                                                          aggregation=g, max_len=ML),
       lambda r: (_x(r), _x(r), _x(r), _mask(r), _scalar(r, 0.1, 0.3)))
  case(f"losses.value_loss/{_agg}/grad",
       jax.grad(lambda v, ov, ret, m, g=_agg: losses.value_loss(
           v, ov, ret, m, clip_range=None, aggregation=g, max_len=ML)[0]),
       lambda r: (_x(r), _x(r), _x(r), _mask(r)))
  case(f"losses.entropy_bonus/{_agg}", lambda e, m, g=_agg: losses.entropy_bonus(e, m, g, ML),
       lambda r: (_x(r, lo=0, hi=3), _mask(r)))
  case(f"losses.ppo_loss/{_agg}", lambda *a, g=_agg: _ppo(*a, g), _ppo_gen)
  case(f"losses.ppo_loss/{_agg}/grad",
       jax.grad(lambda *a, g=_agg: _ppo(*a, g)[0], argnums=(0, 3, 7)), _ppo_gen)
case("losses.policy_loss/defaults", losses.policy_loss,
     lambda r: _policy_gen(r)[:4])
case("losses.bradley_terry_loss", losses.bradley_terry_loss,
     lambda r: (_x(r, shape=(B,)), _x(r, shape=(B,))))
case("losses.bradley_terry_loss/grad",
     jax.grad(lambda c, rj: losses.bradley_terry_loss(c, rj)[0], argnums=(0, 1)),
     lambda r: (_x(r, shape=(B,)), _x(r, shape=(B,))))
for _agg in ("token_mean", "seq_mean", "seq_mean_token_sum_norm"):
  case(f"losses.sft_loss/{_agg}", lambda lp, m, g=_agg: losses.sft_loss(lp, m, g, ML),
       lambda r: (_logp(r), _mask(r)))
for _agg in ops.AGGREGATIONS:
  case(f"losses.kl_loss/{_agg}",
       lambda lp, rl, m, beta, g=_agg: losses.kl_loss(lp, rl, m, coef=beta, aggregation=g,
                                                      max_len=ML),
       lambda r: (_logp(r), _logp(r), _mask(r), _scalar(r, 0.01, 0.1)))
case("losses.kl_loss/k1/grad",
     jax.grad(lambda lp, rl, m: losses.kl_loss(lp, rl, m, coef=0.05, estimator="k1")[0]),
     lambda r: (_logp(r), _logp(r), _mask(r)))
case("losses.kl_loss/k3/grad",
     jax.grad(lambda lp, rl, m, beta: losses.kl_loss(lp, rl, m, coef=beta)[0]),
     lambda r: (_logp(r), _logp(r), _mask(r), _scalar(r, 0.01, 0.1)))
case("correction.is_weight",
     lambda old, smp, m: correction.is_weight(old, smp, m, 2.0),
     lambda r: (_logp(r), _logp(r), _mask(r)))
case("losses.policy_loss/is_weight/grad",
     jax.grad(lambda lp, old, adv, m, w: losses.policy_loss(lp, old, adv, m, is_weight=w)[0]),
     lambda r: (_logp(r), _logp(r), _x(r), _mask(r), _x(r, lo=0.0, hi=2.0)))
case("losses.ppo_loss/no_entropy",
     lambda lp, old, adv, v, ov, ret, m: losses.ppo_loss(lp, old, adv, v, ov, ret, m),
     lambda r: _ppo_gen(r)[:7])


# ------------------------------------------------------------------------------------------------

NAMES = sorted(CASES)


def _inputs(name):
  return [CASES[name].gen(np.random.default_rng([i, len(name)])) for i in range(N_CALLS)]


def _assert_tree_close(a, b, **tol):
  la, ta = jax.tree.flatten(a)
  lb, tb = jax.tree.flatten(b)
  assert ta == tb
  for x, y in zip(la, lb):
    x, y = np.asarray(x), np.asarray(y)
    assert x.shape == y.shape and x.dtype == y.dtype
    if np.issubdtype(x.dtype, np.floating) or x.dtype == jnp.bfloat16:
      np.testing.assert_allclose(x.astype(np.float64), y.astype(np.float64), **tol)
    else:
      np.testing.assert_array_equal(x, y)


def test_every_public_function_is_covered():
  """Each public function of the six modules has at least one case here."""
  import inspect

  for mod in (ops, kl, rewards, advantages, losses, correction):
    for fname, obj in vars(mod).items():
      if fname.startswith("_") or not inspect.isfunction(obj) or obj.__module__ != mod.__name__:
        continue
      prefix = f"{mod.__name__.split('.')[-1]}.{fname}"
      assert any(n == prefix or n.startswith(prefix + "/") or n.startswith(prefix + ".")
                 for n in CASES), prefix


@pytest.mark.parametrize("name", NAMES)
def test_traces_once(name):
  fn = CASES[name].fn
  traces = []

  def counted(*args):
    traces.append(1)
    return fn(*args)

  jitted = jax.jit(counted)
  calls = _inputs(name)
  outs = [jax.block_until_ready(jitted(*args)) for args in calls]
  assert len(traces) == 1, f"{name} traced {len(traces)} times for {N_CALLS} same-shape calls"
  # The values were really used: a cheap sanity check that the calls differed.
  if calls[0]:
    leaves = [jax.tree.leaves(o) for o in outs]
    assert any(not np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(leaves[0], leaves[1])) or name.startswith("kl.fixed")


@pytest.mark.parametrize("name", [n for n in NAMES if CASES[n].gen(np.random.default_rng(0))])
def test_vmap_matches_loop(name):
  fn = CASES[name].fn
  calls = _inputs(name)
  jitted = jax.jit(fn)
  looped = [jitted(*args) for args in calls]
  stacked = jax.tree.map(lambda *xs: jnp.stack([jnp.asarray(x) for x in xs]), *calls)
  batched = jax.jit(jax.vmap(fn))(*stacked)
  expected = jax.tree.map(lambda *xs: jnp.stack(xs), *looped)
  _assert_tree_close(batched, expected, rtol=1e-4, atol=1e-5)  # float32 reassociation
