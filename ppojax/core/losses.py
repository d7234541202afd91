"""PPO losses (Schulman et al. 2017) over masked [B, T] token arrays.

Every loss returns ``(scalar_loss, metrics)``. ``aggregation`` picks how per-token terms become a
scalar (``ops.aggregate``): ``"token_mean"`` (every token weighs the same; trl),
``"seq_mean_token_mean"`` or its alias ``"seq_mean"`` (mean per sequence, then over sequences;
GRPO) or ``"seq_mean_token_sum_norm"`` (token sum per sequence over the constant ``max_len``, then
the mean over sequences; Dr. GRPO). Metrics are always token means over the mask.
Hyper-parameters given as Python numbers are checked (``ValueError`` saying what is wrong);
traced ones cannot be, and are not.
Inputs at padded positions are replaced by neutral values before any arithmetic, so they affect
neither the loss nor its gradient (not even NaN/Inf there).
"""

from __future__ import annotations

from typing import Callable

import chex
import jax
import jax.numpy as jnp

from ppojax.core import kl as kl_lib
from ppojax.core import ops, surrogates
from ppojax.core.options import check_option, clip_floor_option

Array = jax.Array


def _masked_inputs(mask: Array, *xs: Array, fill: float = 0.0):
  mask = mask.astype(jnp.bool_)
  return (mask,) + tuple(jnp.where(mask, x.astype(jnp.float32), fill) for x in xs)


def policy_loss(
    logp: Array, old_logp: Array, advantages: Array, mask: Array, *, clip_eps: float = 0.2,
    clip_eps_low: float | None = None, clip_eps_high: float | None = None,
    dual_clip: float | None = None, aggregation: str = "token_mean",
    max_len: float | None = None, is_weight: Array | None = None,
    surrogate: Callable[..., surrogates.Terms] = surrogates.token_clip,
) -> tuple[Array, dict[str, Array]]:
  """Clipped surrogate: L = agg( max(−A·ρ, −A·clip(ρ, 1 − ε_low, 1 + ε_high)) ), ρ = e^{logp − old}.

  ε_low and ε_high default to ``clip_eps`` (set them apart for "clip-higher", DAPO). With
  ``dual_clip`` = c > 1 (Ye et al. 2020), tokens with A < 0 have their loss capped at −c·A, so a
  huge ratio on a bad action cannot dominate the batch. Where the clip is active in the
  advantage's favour (A > 0, ρ > 1 + ε_high; or A < 0, ρ < 1 − ε_low) the gradient is exactly 0.
  ``surrogate`` (``surrogates.SURROGATES``): the per-token term, PPO's token ratio by default,
  or a sequence ratio (GSPO) or a clipped-weight REINFORCE term (CISPO); ``dual_clip`` only
  with PPO's. ``is_weight`` w [B, T] (constant; ``correction.is_weight``) multiplies each token's
  term: L = agg(w_t · ℓ_t), the importance correction for tokens sampled by another engine.
  ``aggregation`` and ``max_len``: ``ops.aggregate``. Checked where given as Python numbers:
  ε and ε_low in (0, 1), ε_high > 0, c > 1 (with CISPO any ε_low > 0: >= 1 is no floor).

  Args:
    logp: [B, T] log-probs under the current policy (differentiated).
    old_logp: [B, T] log-probs under the sampling policy (constant).
    advantages: [B, T] (constant).
    mask: [B, T] response mask.
    is_weight: [B, T] per-token weights (constant), or None (all 1).

  Returns:
    loss and metrics: ``loss``; ``approxkl`` = ½·mean((logp − old_logp)²); ``clipfrac``, the
    fraction of tokens where the clip decides the term (``Terms.clipped``); ``dual_clipfrac``;
    ``ratio`` and ``ratio_var``, mean and (unbiased) variance of the surrogate's ratio.
  """
  chex.assert_rank([logp, old_logp, advantages, mask], 2)
  chex.assert_equal_shape([logp, old_logp, advantages, mask])
  _check_policy_options(clip_eps, clip_eps_low, clip_eps_high, dual_clip, surrogate)
  if dual_clip is not None and surrogate is not surrogates.token_clip:
    raise ValueError("dual_clip caps PPO's token-ratio term only: set it to None with another "
                     "loss mode (rl.loss_mode)")
  mask, logp, old_logp, adv = _masked_inputs(mask, logp, old_logp, advantages)
  old_logp, adv = jax.lax.stop_gradient((old_logp, adv))

  log_ratio = logp - old_logp
  eps_low = clip_eps if clip_eps_low is None else clip_eps_low
  eps_high = clip_eps if clip_eps_high is None else clip_eps_high
  terms = surrogate(log_ratio, adv, mask, eps_low, eps_high)
  per_token, dual_active = _dual_clip(terms.per_token, adv, dual_clip)
  if is_weight is not None:
    chex.assert_equal_shape([is_weight, mask])
    per_token = per_token * jax.lax.stop_gradient(jnp.where(mask, is_weight, 0.0))

  loss = ops.aggregate(per_token, mask, aggregation, max_len)
  metrics = {
      "loss": loss,
      "approxkl": 0.5 * ops.masked_mean(jnp.square(log_ratio), mask),
      "clipfrac": ops.masked_mean(terms.clipped.astype(jnp.float32), mask),
      "dual_clipfrac": ops.masked_mean(dual_active.astype(jnp.float32), mask),
      "ratio": ops.masked_mean(terms.ratio, mask),
      "ratio_var": ops.masked_var(terms.ratio, mask),
  }
  return loss, jax.tree.map(jax.lax.stop_gradient, metrics)


def _dual_clip(per_token: Array, adv: Array, dual_clip: float | None) -> tuple[Array, Array]:
  """Dual-clip PPO's cap: ℓ_t ← min(ℓ_t, −c·A_t) where A_t < 0, and where the cap is active."""
  if dual_clip is None:
    return per_token, jnp.zeros(per_token.shape, jnp.bool_)
  capped = jnp.where(adv < 0, jnp.minimum(per_token, -dual_clip * adv), per_token)
  return capped, (adv < 0) & (capped < per_token)


def _check_policy_options(clip_eps=0.2, clip_eps_low=None, clip_eps_high=None,
                          dual_clip=None, surrogate=surrogates.token_clip) -> None:
  """``ValueError`` for a clipped-surrogate option that is a Python number out of its range
  (``options.OPTION_RANGES``; ε_low's under the surrogate: ``options.clip_floor_option``)."""
  for name, value in (("clip_eps", clip_eps), ("clip_eps_high", clip_eps_high),
                      ("dual_clip", dual_clip)):
    check_option(name, value)
  check_option("clip_eps_low", clip_eps_low,
               clip_floor_option("cispo" if surrogate is surrogates.cispo else "clip"))


def value_loss(
    values: Array,
    old_values: Array,
    returns: Array,
    mask: Array,
    *,
    clip_range: float | None = 0.2,
    aggregation: str = "token_mean",
    max_len: float | None = None,
) -> tuple[Array, dict[str, Array]]:
  """Clipped value loss: L = agg( ½·max((V − R)², (V_clip − R)²) ),

  V_clip = V_old + clip(V − V_old, −c, c) (PPO2 / trl). ``clip_range=None`` gives ½·(V − R)²;
  a Python number must be > 0.

  Returns:
    loss and metrics: ``loss``; ``clipfrac``, the fraction of tokens where the clipped error is
    the larger; ``error`` = mean((V − R)²); ``values``, the mean prediction.
  """
  chex.assert_rank([values, old_values, returns, mask], 2)
  chex.assert_equal_shape([values, old_values, returns, mask])
  check_option("clip_range", clip_range, "value_clip")
  mask, values, old_values, returns = _masked_inputs(mask, values, old_values, returns)
  old_values, returns = jax.lax.stop_gradient((old_values, returns))

  err = jnp.square(values - returns)
  if clip_range is None:
    per_token, clip_active = err, jnp.zeros_like(mask)
  else:
    v_clip = old_values + jnp.clip(values - old_values, -clip_range, clip_range)
    err_clip = jnp.square(v_clip - returns)
    # Counted only where the clip moved V: float32 V_old + (V − V_old) can differ from V by an
    # ulp, which must not count as clipping.
    clip_active = (jnp.abs(values - old_values) > clip_range) & (err_clip > err)
    per_token = jnp.maximum(err, err_clip)
  loss = 0.5 * ops.aggregate(per_token, mask, aggregation, max_len)
  metrics = {
      "loss": loss,
      "clipfrac": ops.masked_mean(clip_active.astype(jnp.float32), mask),
      "error": ops.masked_mean(err, mask),
      "values": ops.masked_mean(values, mask),
  }
  return loss, jax.tree.map(jax.lax.stop_gradient, metrics)


def entropy_bonus(entropy: Array, mask: Array, aggregation: str = "token_mean",
                  max_len: float | None = None) -> Array:
  """Mean policy entropy agg(H_t) over the mask (``logprobs.entropy_from_logits`` gives H_t)."""
  mask, entropy = _masked_inputs(mask, entropy)
  return ops.aggregate(entropy, mask, aggregation, max_len)


# ppo_loss's names of policy_loss's metrics
_POLICY_METRICS = {"loss/policy": "loss", "policy/approxkl_masked": "approxkl",
                   "policy/clipfrac": "clipfrac", "policy/dual_clipfrac": "dual_clipfrac",
                   "val/ratio_masked": "ratio", "val/ratio_token_var": "ratio_var"}


def ppo_loss(
    logp: Array, old_logp: Array, advantages: Array, values: Array | None,
    old_values: Array | None, returns: Array | None, mask: Array, entropy: Array | None = None,
    *, vf_coef: float = 0.1, ent_coef: float = 0.0, clip_eps: float = 0.2,
    clip_eps_low: float | None = None, clip_eps_high: float | None = None,
    dual_clip: float | None = None, value_clip: float | None = 0.2,
    aggregation: str = "token_mean", max_len: float | None = None,
    is_weight: Array | None = None, ref_logp: Array | None = None,
    kl_coef: float | Array = 0.0, kl_estimator: str = "k3",
    surrogate: Callable[..., surrogates.Terms] = surrogates.token_clip,
) -> tuple[Array, dict[str, Array]]:
  """Total PPO loss  L = L_policy + vf_coef·L_value − ent_coef·H + β·agg(KL_t)
  (``is_weight``, ``surrogate``: see ``policy_loss``).

  Without a critic (``values`` None: GRPO, RLOO, REINFORCE++) there is no value term and no
  ``loss/value`` / ``val/*`` metric. With ``ref_logp`` the KL to the reference is a loss term
  (``kl_loss``: β = ``kl_coef``, estimator ``kl_estimator``; GRPO), reported as ``loss/kl``
  and ``policy/kl``. The defaults are trl's (vf_coef 0.1, no entropy bonus, ε = 0.2 for ratio
  and value clip). Metrics: ``loss/{policy,value,kl,total}``, ``policy/{clipfrac,
  dual_clipfrac,approxkl_masked,entropy_masked,kl}``, ``val/{clipfrac,error,values,
  ratio_masked,ratio_token_var}`` (trl's names, without its ``_avg``, where they mean what
  trl's mean; ``_masked`` where trl averages over padding too: docs/explanation/step.md,
  "Metric names").
  ``ent_coef`` other than a Python 0 without ``entropy`` raises ``ValueError``, as does a Python
  ``vf_coef`` < 0.
  """
  check_option("vf_coef", vf_coef)
  pg_loss, pg = policy_loss(
      logp, old_logp, advantages, mask, clip_eps=clip_eps, clip_eps_low=clip_eps_low,
      clip_eps_high=clip_eps_high, dual_clip=dual_clip, aggregation=aggregation,
      max_len=max_len, is_weight=is_weight, surrogate=surrogate)
  total = pg_loss
  metrics = {name: pg[key] for name, key in _POLICY_METRICS.items()}
  if values is not None:
    vf_loss, vf = value_loss(
        values, old_values, returns, mask, clip_range=value_clip, aggregation=aggregation,
        max_len=max_len)
    total = total + vf_coef * vf_loss
    metrics.update({"loss/value": vf["loss"], "val/clipfrac": vf["clipfrac"],
                    "val/error": vf["error"], "val/values": vf["values"]})
  if ref_logp is not None:
    kl_term, kl = kl_loss(logp, ref_logp, mask, coef=kl_coef, estimator=kl_estimator,
                          aggregation=aggregation, max_len=max_len)
    total = total + kl_term
    metrics.update({"loss/kl": kl["loss"], "policy/kl": kl["kl"]})
  if entropy is not None:
    ent = entropy_bonus(entropy, mask, aggregation, max_len)
    total = total - ent_coef * ent
    metrics["policy/entropy_masked"] = jax.lax.stop_gradient(ent)
  elif isinstance(ent_coef, jax.Array) or ent_coef != 0:
    raise ValueError(
        "ent_coef needs the per-token entropy: pass entropy=logprobs.entropy_from_logits(logits), "
        "or leave ent_coef at 0.0")
  metrics["loss/total"] = jax.lax.stop_gradient(total)
  return total, metrics


def kl_loss(
    logp: Array,
    ref_logp: Array,
    mask: Array,
    *,
    coef: float | Array,
    estimator: str = "k3",
    aggregation: str = "token_mean",
    max_len: float | None = None,
) -> tuple[Array, dict[str, Array]]:
  """KL to the reference policy as a loss term, not a reward (GRPO; Shao et al. 2024,
  "DeepSeekMath", eq. 4):

      L_KL = β·agg(k3_t),   k3_t = π_ref/π − log(π_ref/π) − 1 = e^{−Δ_t} − 1 + Δ_t,
      Δ_t = log π(y_t) − log π_ref(y_t),   ∂k3_t/∂ log π(y_t) = 1 − e^{−Δ_t}

  added to the policy loss with the same ``aggregation`` (and ``max_len``), so agg(pg + β·k3)
  = agg(pg) + L_KL. ``estimator`` is any of ``kl.KL_ESTIMATORS`` (k3, unbiased and ≥ 0, by
  default). β = ``coef`` (a Python number must be >= 0). The gradient flows through ``logp``
  only; ``ref_logp`` is a constant.

  Args:
    logp: [B, T] log-probs of the sampled tokens under the current policy (differentiated).
    ref_logp: [B, T] log-probs under the reference policy.
    mask: [B, T] response mask.

  Returns:
    loss and metrics: ``loss`` = β·agg(KL_t); ``kl`` = the token mean of KL_t over the mask.
  """
  chex.assert_rank([logp, ref_logp, mask], 2)
  chex.assert_equal_shape([logp, ref_logp, mask])
  check_option("coef", coef, "kl_coef")
  mask, logp, ref_logp = _masked_inputs(mask, logp, ref_logp)
  per_token = kl_lib.per_token_kl(logp, jax.lax.stop_gradient(ref_logp), estimator)
  per_token = jnp.where(mask, per_token, 0.0)
  loss = coef * ops.aggregate(per_token, mask, aggregation, max_len)
  metrics = {"loss": loss, "kl": ops.masked_mean(per_token, mask)}
  return loss, jax.tree.map(jax.lax.stop_gradient, metrics)


def bradley_terry_loss(chosen: Array, rejected: Array) -> tuple[Array, dict[str, Array]]:
  """Pairwise reward-model loss (Bradley & Terry 1952; Ouyang et al. 2022):

      L = mean_b −log σ(r_c,b − r_r,b)

  computed as −log_sigmoid of the margin, which stays finite for any margin. It depends on the
  scores only through their difference, is ≥ 0, and equals log 2 where r_c = r_r.

  Args:
    chosen: [B] scores of the preferred responses.
    rejected: [B] scores of the rejected responses.

  Returns:
    loss and metrics: ``accuracy`` = mean(r_c > r_r) (ties count as wrong), ``margin`` =
    mean(r_c − r_r).
  """
  chex.assert_rank([chosen, rejected], 1)
  chex.assert_equal_shape([chosen, rejected])
  margin = chosen.astype(jnp.float32) - rejected.astype(jnp.float32)
  loss = -jnp.mean(jax.nn.log_sigmoid(margin))
  metrics = {"accuracy": jnp.mean((margin > 0).astype(jnp.float32)), "margin": jnp.mean(margin)}
  return loss, jax.tree.map(jax.lax.stop_gradient, metrics)


def sft_loss(logp: Array, mask: Array, aggregation: str = "token_mean",
             max_len: float | None = None) -> Array:
  """Negative log-likelihood of the response tokens: L = −agg(log π(y_t | x, y_<t)).

  ``logp`` [B, T] holds the log-probs of the response tokens (prompt tokens are context, never
  targets); ``mask`` [B, T] marks the real response tokens (the stop token included).
  """
  chex.assert_rank([logp, mask], 2)
  mask, logp = _masked_inputs(mask, logp)
  return -ops.aggregate(logp, mask, aggregation, max_len)
