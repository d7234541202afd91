"""Independent float64 NumPy reference implementations of ppojax's public functions.

Written from the formulas (not from ppojax's code), as plainly as possible: explicit Python loops
over rows and time steps where that is the natural reading of the definition. Everything here
works in float64 on NumPy arrays; masks are read as booleans.
"""

from __future__ import annotations

import math

import numpy as np

# ----------------------------------------------------------------------------------------------
# Masked statistics.


def _f64(x):
  return np.asarray(x, dtype=np.float64)


def _b(mask):
  return np.asarray(mask).astype(bool)


def masked_sum(x, mask, axis=None):
  x, m = _f64(x), _b(mask)
  return np.sum(np.where(m, x, 0.0), axis=axis)


def masked_count(mask, axis=None):
  return np.sum(_b(mask).astype(np.float64), axis=axis)


def masked_mean(x, mask, axis=None):
  s = masked_sum(x, mask, axis)
  n = masked_count(mask, axis)
  return np.where(n > 0, s / np.maximum(n, 1.0), 0.0)


def masked_var(x, mask, unbiased=True):
  x, m = _f64(x), _b(mask)
  vals = x[m]
  n = vals.size
  if n == 0:
    return 0.0
  mu = vals.sum() / n
  var = ((vals - mu) ** 2).sum() / n
  if unbiased and n > 1:
    var = var * n / (n - 1)
  return var


def masked_whiten(x, mask, shift_mean=True, eps=1e-8):
  x, m = _f64(x), _b(mask)
  mu = masked_mean(x, m)
  var = masked_var(x, m, unbiased=True)
  out = (x - mu) / np.sqrt(var + eps)
  if not shift_mean:
    out = out + mu
  return np.where(m, out, 0.0)


def aggregate(x, mask, mode="token_mean", max_len=None):
  x, m = _f64(x), _b(mask)
  if mode == "token_mean":
    n = m.sum()
    return float(np.where(m, x, 0.0).sum() / n) if n > 0 else 0.0
  if mode in ("seq_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
    per_row = []
    for b in range(x.shape[0]):
      n = m[b].sum()
      if n > 0:
        total = np.where(m[b], x[b], 0.0).sum()
        per_row.append(total / max_len if mode == "seq_mean_token_sum_norm" else total / n)
    return float(np.mean(per_row)) if per_row else 0.0
  raise ValueError(mode)


def aggregate_weights(mask, mode="token_mean", max_len=None):
  """w such that aggregate(x, mask, mode) == Σ w·x (the gradient of the aggregation)."""
  m = _b(mask)
  w = np.zeros(m.shape)
  if mode == "token_mean":
    n = m.sum()
    if n > 0:
      w[m] = 1.0 / n
    return w
  nonempty = [b for b in range(m.shape[0]) if m[b].sum() > 0]
  for b in nonempty:
    per_seq = max_len if mode == "seq_mean_token_sum_norm" else m[b].sum()
    w[b, m[b]] = 1.0 / (per_seq * len(nonempty))
  return w


# ----------------------------------------------------------------------------------------------
# Log-softmax / entropy over a vocabulary, with gradients.


def _softmax(z):
  z = z - z.max(axis=-1, keepdims=True)
  e = np.exp(z)
  return e / e.sum(axis=-1, keepdims=True)


def _logsumexp(z):
  mx = z.max(axis=-1, keepdims=True)
  return (mx + np.log(np.exp(z - mx).sum(axis=-1, keepdims=True)))[..., 0]


def selective_log_softmax(logits, tokens, temperature=1.0):
  z = _f64(logits) / float(temperature)
  tokens = np.asarray(tokens)
  z_tok = np.take_along_axis(z, tokens[..., None], axis=-1)[..., 0]
  return z_tok - _logsumexp(z)


def entropy_from_logits(logits, temperature=1.0):
  z = _f64(logits) / float(temperature)
  p = _softmax(z)
  return _logsumexp(z) - (p * z).sum(-1)


def selective_log_softmax_grads(logits, tokens, cotangent, temperature=1.0):
  """(∂/∂logits, ∂/∂temperature) of Σ cotangent·log p_tok.

  ∂ log p_tok/∂z = onehot − softmax(z); z = logits/T, so ∂z/∂logits = 1/T, ∂z/∂T = −z/T.
  """
  T = float(temperature)
  z = _f64(logits) / T
  p = _softmax(z)
  onehot = np.zeros_like(z)
  tokens = np.asarray(tokens)
  np.put_along_axis(onehot, tokens[..., None], 1.0, axis=-1)
  g_z = _f64(cotangent)[..., None] * (onehot - p)
  g_logits = g_z / T
  g_T = float(np.sum(g_z * (-z / T)))
  return g_logits, g_T


def entropy_grads(logits, cotangent, temperature=1.0):
  """(∂/∂logits, ∂/∂temperature) of Σ cotangent·H, with ∂H/∂z_i = −p_i (z_i − E_p[z])."""
  T = float(temperature)
  z = _f64(logits) / T
  p = _softmax(z)
  ez = (p * z).sum(-1, keepdims=True)
  g_z = _f64(cotangent)[..., None] * (-p * (z - ez))
  g_logits = g_z / T
  g_T = float(np.sum(g_z * (-z / T)))
  return g_logits, g_T


# ----------------------------------------------------------------------------------------------
# Stop tokens and response masks (explicit loops).


def is_stop_token(tokens, stop_ids):
  tokens = np.asarray(tokens)
  out = np.zeros(tokens.shape, dtype=bool)
  for b in range(tokens.shape[0]):
    for t in range(tokens.shape[1]):
      out[b, t] = int(tokens[b, t]) in set(int(s) for s in stop_ids)
  return out


def first_stop(tokens, stop_ids):
  """Per row: index of the first stop token, or None."""
  stops = set(int(s) for s in stop_ids)
  res = []
  for row in np.asarray(tokens):
    idx = None
    for t, tok in enumerate(row):
      if int(tok) in stops:
        idx = t
        break
    res.append(idx)
  return res


def response_mask(tokens, stop_ids):
  tokens = np.asarray(tokens)
  B, T = tokens.shape
  out = np.zeros((B, T), dtype=bool)
  for b, idx in enumerate(first_stop(tokens, stop_ids)):
    end = T if idx is None else idx + 1
    out[b, :end] = True
  return out


def has_stop_token(tokens, stop_ids):
  return np.array([idx is not None for idx in first_stop(tokens, stop_ids)], dtype=bool)


def truncate_after_stop(tokens, stop_ids, pad_id):
  out = np.array(tokens, copy=True)
  for b, idx in enumerate(first_stop(tokens, stop_ids)):
    if idx is not None:
      out[b, idx + 1:] = pad_id
  return out


def last_index(mask):
  m = _b(mask)
  res = np.full(m.shape[0], -1, dtype=np.int64)
  for b in range(m.shape[0]):
    for t in range(m.shape[1]):
      if m[b, t]:
        res[b] = t
  return res


def last_token_mask(mask):
  m = _b(mask)
  out = np.zeros(m.shape, dtype=bool)
  for b, t in enumerate(last_index(m)):
    if t >= 0:
      out[b, t] = True
  return out


# ----------------------------------------------------------------------------------------------
# KL estimators and controllers.


def kl_k1(logp, ref_logp):
  return _f64(logp) - _f64(ref_logp)


def kl_k2(logp, ref_logp):
  d = _f64(logp) - _f64(ref_logp)
  return 0.5 * d * d


def kl_k3(logp, ref_logp):
  d = _f64(logp) - _f64(ref_logp)
  return np.exp(-d) - 1.0 + d


def kl_abs(logp, ref_logp):
  return np.abs(_f64(logp) - _f64(ref_logp))


def kl_clamp(logp, ref_logp):
  return np.maximum(_f64(logp) - _f64(ref_logp), 0.0)


KL = {"k1": kl_k1, "kl": kl_k1, "k2": kl_k2, "mse": kl_k2, "k3": kl_k3, "abs": kl_abs,
      "clamp": kl_clamp}


def per_token_kl(logp, ref_logp, estimator="k1"):
  if estimator not in KL:
    raise ValueError(estimator)
  return KL[estimator](logp, ref_logp)


def adaptive_kl_betas(init_beta, target, horizon, kls, n_steps):
  """β after each update of the adaptive controller."""
  beta = float(init_beta)
  out = []
  for kl, n in zip(kls, n_steps):
    e = kl / target - 1.0
    e = min(max(e, -0.2), 0.2)
    beta = beta * (1.0 + e * n / horizon)
    out.append(beta)
  return out


# ----------------------------------------------------------------------------------------------
# Rewards.


def adjust_scores(scores, has_stop=None, score_clip=None, missing_stop_penalty=None):
  s = _f64(scores).copy()
  for b in range(s.shape[0]):
    if score_clip is not None:
      s[b] = min(max(s[b], -score_clip), score_clip)
    if missing_stop_penalty is not None and has_stop is not None and not bool(has_stop[b]):
      s[b] = s[b] - missing_stop_penalty
  return s


def shape_rewards(scores, logp, ref_logp, mask, beta, has_stop=None, kl_estimator="k1",
                  score_clip=None, missing_stop_penalty=None, whiten=False):
  m = _b(mask)
  B, T = m.shape
  s = adjust_scores(scores, has_stop, score_clip, missing_stop_penalty)
  kl = per_token_kl(logp, ref_logp, kl_estimator)
  r = np.zeros((B, T))
  kl_sum = np.zeros(B)
  for b in range(B):
    last = -1
    for t in range(T):
      if m[b, t]:
        r[b, t] = -beta * kl[b, t]
        kl_sum[b] += kl[b, t]
        last = t
    if last >= 0:
      r[b, last] += s[b]
  if whiten:
    r = masked_whiten(r, m, shift_mean=False)
  non_score = -beta * kl_sum
  metrics = {
      "kl": kl_sum.mean(),
      "non_score_reward": non_score.mean(),
      "scores": s.mean(),
      "rlhf_reward": (s + non_score).mean(),
      "missing_stop_frac": (0.0 if has_stop is None else
                            float(np.mean(~np.asarray(has_stop).astype(bool)))),
  }
  return r, metrics


# ----------------------------------------------------------------------------------------------
# GAE: the classic reversed loop over each row's valid length.


def gae(rewards, values, mask, gamma=1.0, lam=0.95, last_values=None, whiten=False):
  r, v, m = _f64(rewards), _f64(values), _b(mask)
  B, T = m.shape
  adv = np.zeros((B, T))
  ret = np.zeros((B, T))
  for b in range(B):
    L = int(m[b].sum())
    assert m[b, :L].all() and not m[b, L:].any(), "prefix masks only"
    next_value = 0.0 if last_values is None else float(last_values[b])
    last_gae = 0.0
    for t in reversed(range(L)):
      delta = r[b, t] + gamma * next_value - v[b, t]
      last_gae = delta + gamma * lam * last_gae
      adv[b, t] = last_gae
      next_value = v[b, t]
    ret[b, :L] = adv[b, :L] + v[b, :L]
  if whiten:
    adv = masked_whiten(adv, m, shift_mean=True)
  return adv, ret


# ----------------------------------------------------------------------------------------------
# Critic-free estimators, each from its paper's formula: plain loops over groups and samples.


def _group_list(scores, n):
  s = _f64(scores)
  assert s.shape[0] % n == 0
  return [list(s[g * n:(g + 1) * n]) for g in range(s.shape[0] // n)]


def _broadcast(seq_adv, mask):
  m = _b(mask)
  out = np.zeros(m.shape)
  for b in range(m.shape[0]):
    for t in range(m.shape[1]):
      if m[b, t]:
        out[b, t] = seq_adv[b]
  return out


def grpo(scores, mask, n, eps=1e-6):
  """A_i = (r_i − mean)/(std + eps), std with n − 1; 0 where all equal or n = 1."""
  adv = []
  for group in _group_list(scores, n):
    mean = sum(group) / n
    if n == 1 or all(r == group[0] for r in group):
      adv += [0.0] * n
      continue
    std = (sum((r - mean) ** 2 for r in group) / (n - 1)) ** 0.5
    adv += [(r - mean) / (std + eps) for r in group]
  return _broadcast(adv, mask)


def dr_grpo(scores, mask, n):
  """A_i = r_i − mean."""
  adv = []
  for group in _group_list(scores, n):
    mean = sum(group) / n
    adv += [0.0 if all(r == group[0] for r in group) else r - mean for r in group]
  return _broadcast(adv, mask)


def rloo(scores, mask, n):
  """A_i = r_i − mean of the other n − 1 scores; 0 for n = 1."""
  adv = []
  for group in _group_list(scores, n):
    for i, r in enumerate(group):
      others = [group[j] for j in range(n) if j != i]
      adv.append(r - sum(others) / len(others) if others else 0.0)
  return _broadcast(adv, mask)


def discounted_returns(rewards, mask, gamma=1.0):
  r, m = _f64(rewards), _b(mask)
  out = np.zeros(m.shape)
  for b in range(m.shape[0]):
    for t in range(m.shape[1]):
      if m[b, t]:
        out[b, t] = sum(gamma ** (k - t) * r[b, k] for k in range(t, m.shape[1]) if m[b, k])
  return out


def reinforce_pp(rewards, mask, gamma=1.0, eps=1e-8):
  """(whitened G over all masked tokens, G); A = 0 where all masked G are equal."""
  m = _b(mask)
  G = discounted_returns(rewards, m, gamma)
  vals = G[m]
  if vals.size == 0 or np.all(vals == vals[0]):
    return np.zeros(m.shape), G
  mean = vals.mean()
  var = ((vals - mean) ** 2).sum() / max(vals.size - 1, 1)
  return np.where(m, (G - mean) / np.sqrt(var + eps), 0.0), G


# ----------------------------------------------------------------------------------------------
# Losses (with analytic gradients).


def _token_mean(x, m):
  n = m.sum()
  return float(np.where(m, x, 0.0).sum() / n) if n > 0 else 0.0


def policy_loss(logp, old_logp, advantages, mask, clip_eps=0.2, clip_eps_low=None,
                clip_eps_high=None, dual_clip=None, aggregation="token_mean", max_len=None):
  """Returns (loss, metrics, dloss/dlogp)."""
  m = _b(mask)
  lo = clip_eps if clip_eps_low is None else clip_eps_low
  hi = clip_eps if clip_eps_high is None else clip_eps_high
  logp, old, A = _f64(logp), _f64(old_logp), _f64(advantages)
  B, T = m.shape
  per_tok = np.zeros((B, T))
  dtok = np.zeros((B, T))  # ∂ per_tok / ∂ logp
  clipped = np.zeros((B, T), dtype=bool)
  dual = np.zeros((B, T), dtype=bool)
  ratio = np.ones((B, T))
  for b in range(B):
    for t in range(T):
      if not m[b, t]:
        continue
      lr = logp[b, t] - old[b, t]
      rho = np.exp(lr)
      ratio[b, t] = rho
      a = A[b, t]
      unclipped = -a * rho
      rho_c = min(max(rho, 1.0 - lo), 1.0 + hi)
      clipped_term = -a * rho_c
      if clipped_term > unclipped:
        loss = clipped_term
        grad = 0.0 if (rho_c != rho) else -a * rho
        clipped[b, t] = True
      else:
        loss = unclipped
        grad = -a * rho
      if dual_clip is not None and a < 0 and loss > -dual_clip * a:
        loss = -dual_clip * a
        grad = 0.0
        dual[b, t] = True
      per_tok[b, t] = loss
      dtok[b, t] = grad
  loss = aggregate(per_tok, m, aggregation, max_len)
  w = aggregate_weights(m, aggregation, max_len)
  logratio = logp - old
  metrics = {
      "loss": loss,
      "approxkl": 0.5 * _token_mean(logratio ** 2, m),
      "clipfrac": _token_mean(clipped.astype(float), m),
      "dual_clipfrac": _token_mean(dual.astype(float), m),
      "ratio": _token_mean(ratio, m),
      "ratio_var": masked_var(ratio, m, unbiased=True),
  }
  return loss, metrics, w * dtok


def _clip_branch(a, x, lo, hi):
  """PPO's pessimistic term at ratio x: (ℓ, ∂ℓ/∂x, clipped) with ℓ = max(−a·x, −a·clip(x))."""
  x_c = min(max(x, 1.0 - lo), 1.0 + hi)
  if -a * x_c > -a * x:
    return -a * x_c, (0.0 if x_c != x else -a), True
  return -a * x, -a, False


def gspo_loss(logp, old_logp, advantages, mask, clip_eps_low=0.2, clip_eps_high=0.2,
              aggregation="seq_mean_token_mean", max_len=None, token=False):
  """GSPO, written out: s_b = exp((1/|y_b|)·Σ_t (logp − old)), ℓ_{b,t} = max(−A·s_b,
  −A·clip(s_b)); loss = agg(ℓ). Gradient: the sequence form spreads each token's ∂ℓ/∂s over the
  row (∂s_b/∂logp_{b,u} = s_b/|y_b|); the token form (GSPO-token) keeps it on its own token
  (∂s_{b,t}/∂logp_{b,t} = s_b). Returns (loss, metrics, dloss/dlogp)."""
  m = _b(mask)
  logp, old, A = _f64(logp), _f64(old_logp), _f64(advantages)
  B, T = m.shape
  w = aggregate_weights(m, aggregation, max_len)
  per_tok, grad = np.zeros((B, T)), np.zeros((B, T))
  clipped, ratio = np.zeros((B, T), dtype=bool), np.ones((B, T))
  for b in range(B):
    n = int(m[b].sum())
    if n == 0:
      continue
    s = math.exp(sum(logp[b, t] - old[b, t] for t in range(T) if m[b, t]) / n)
    d_s = np.zeros(T)  # ∂ℓ_{b,t}/∂s
    for t in range(T):
      if m[b, t]:
        per_tok[b, t], d_s[t], clipped[b, t] = _clip_branch(A[b, t], s, clip_eps_low,
                                                            clip_eps_high)
        ratio[b, t] = s
    for u in range(T):
      if m[b, u]:
        grad[b, u] = (w[b, u] * d_s[u] * s if token
                      else sum(w[b, t] * d_s[t] for t in range(T) if m[b, t]) * s / n)
  return aggregate(per_tok, m, aggregation, max_len), _surrogate_metrics(
      logp - old, m, clipped, ratio), grad


def cispo_loss(logp, old_logp, advantages, mask, clip_eps_low=0.2, clip_eps_high=0.2,
               aggregation="token_mean", max_len=None):
  """CISPO, written out: ℓ_t = −w_t·A_t·(logp − old) with the constant w_t = clip(ρ_t, 1 − lo,
  1 + hi); ∂ℓ_t/∂logp_t = −w_t·A_t. Returns (loss, metrics, dloss/dlogp)."""
  m = _b(mask)
  logp, old, A = _f64(logp), _f64(old_logp), _f64(advantages)
  lr = np.where(m, logp - old, 0.0)
  ratio = np.exp(lr)
  weight = np.clip(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
  clipped = m & ((ratio < 1.0 - clip_eps_low) | (ratio > 1.0 + clip_eps_high))
  per_tok = np.where(m, -weight * A * lr, 0.0)
  grad = aggregate_weights(m, aggregation, max_len) * np.where(m, -weight * A, 0.0)
  return aggregate(per_tok, m, aggregation, max_len), _surrogate_metrics(
      lr, m, clipped, ratio), grad


def _surrogate_metrics(logratio, m, clipped, ratio):
  return {"approxkl": 0.5 * _token_mean(logratio ** 2, m),
          "clipfrac": _token_mean(clipped.astype(float), m), "dual_clipfrac": 0.0,
          "ratio": _token_mean(ratio, m), "ratio_var": masked_var(ratio, m, unbiased=True)}


def value_loss(values, old_values, returns, mask, clip_range=0.2, aggregation="token_mean",
               max_len=None):
  """Returns (loss, metrics, dloss/dvalues)."""
  m = _b(mask)
  V, Vo, R = _f64(values), _f64(old_values), _f64(returns)
  B, T = m.shape
  per_tok = np.zeros((B, T))
  dtok = np.zeros((B, T))
  clipped = np.zeros((B, T), dtype=bool)
  for b in range(B):
    for t in range(T):
      if not m[b, t]:
        continue
      e1 = V[b, t] - R[b, t]
      if clip_range is None:
        per_tok[b, t] = 0.5 * e1 * e1
        dtok[b, t] = e1
        continue
      dv = V[b, t] - Vo[b, t]
      dv_c = min(max(dv, -clip_range), clip_range)
      e2 = Vo[b, t] + dv_c - R[b, t]
      if e2 * e2 > e1 * e1:
        per_tok[b, t] = 0.5 * e2 * e2
        dtok[b, t] = e2 if dv_c == dv else 0.0
        clipped[b, t] = True
      else:
        per_tok[b, t] = 0.5 * e1 * e1
        dtok[b, t] = e1
  loss = aggregate(per_tok, m, aggregation, max_len)
  w = aggregate_weights(m, aggregation, max_len)
  metrics = {
      "loss": loss,
      "clipfrac": _token_mean(clipped.astype(float), m),
      "error": _token_mean((V - R) ** 2, m),
      "values": _token_mean(V, m),
  }
  return loss, metrics, w * dtok


def kl_loss(logp, ref_logp, mask, coef, estimator="k3", aggregation="token_mean", max_len=None):
  """Returns (loss, metrics, dloss/dlogp) of coef·agg(KL_t)."""
  m = _b(mask)
  d = np.where(m, _f64(logp) - _f64(ref_logp), 0.0)
  per_tok = np.where(m, per_token_kl(d, np.zeros_like(d), estimator), 0.0)
  dkl = {"k1": np.ones_like(d), "kl": np.ones_like(d), "k2": d, "mse": d,
         "k3": 1.0 - np.exp(-d), "abs": np.sign(d), "clamp": (d > 0).astype(float)}[estimator]
  loss = coef * aggregate(per_tok, m, aggregation, max_len)
  grad = coef * aggregate_weights(m, aggregation, max_len) * dkl
  return loss, {"loss": loss, "kl": _token_mean(per_tok, m)}, grad


def entropy_bonus(entropy, mask, aggregation="token_mean", max_len=None):
  return aggregate(entropy, mask, aggregation, max_len)


def ppo_loss(logp, old_logp, advantages, values, old_values, returns, mask, entropy=None,
             vf_coef=0.1, ent_coef=0.0, clip_eps=0.2, clip_eps_low=None, clip_eps_high=None,
             dual_clip=None, value_clip=0.2, aggregation="token_mean", max_len=None):
  pg, pm, _ = policy_loss(logp, old_logp, advantages, mask, clip_eps, clip_eps_low,
                          clip_eps_high, dual_clip, aggregation, max_len)
  vf, vm, _ = value_loss(values, old_values, returns, mask, value_clip, aggregation, max_len)
  ent = 0.0 if entropy is None else entropy_bonus(entropy, mask, aggregation, max_len)
  total = pg + vf_coef * vf - ent_coef * ent
  metrics = {
      "loss/policy": pg,
      "loss/value": vf,
      "loss/total": total,
      "policy/approxkl_masked": pm["approxkl"],
      "policy/clipfrac": pm["clipfrac"],
      "policy/dual_clipfrac": pm["dual_clipfrac"],
      "val/ratio_masked": pm["ratio"],
      "val/ratio_token_var": pm["ratio_var"],
      "val/clipfrac": vm["clipfrac"],
      "val/error": vm["error"],
      "val/values": vm["values"],
  }
  if entropy is not None:
    metrics["policy/entropy_masked"] = ent
  return total, metrics
