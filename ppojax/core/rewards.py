"""Per-token rewards from a sequence score and a KL penalty (Ziegler et al. 2019; trl's PPO)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from ppojax.core import kl as kl_lib
from ppojax.core import ops

Array = jax.Array


def adjust_scores(
    scores: Array,
    has_stop: Array | None = None,
    *,
    score_clip: float | None = None,
    missing_stop_penalty: float | None = None,
) -> Array:
  """Sequence scores after optional clipping to [−c, c], then the missing-stop penalty.

    s ← clip(s, −c, c);   s ← s − penalty   for responses without a stop token (cut off by the
  length limit), as trl's ``missing_eos_penalty``.
  """
  chex.assert_rank(scores, 1)
  scores = scores.astype(jnp.float32)
  if score_clip is not None:
    scores = jnp.clip(scores, -score_clip, score_clip)
  if missing_stop_penalty is not None:
    if has_stop is None:
      raise ValueError("missing_stop_penalty needs has_stop (see ops.has_stop_token)")
    chex.assert_equal_shape([scores, has_stop])
    scores = jnp.where(has_stop, scores, scores - missing_stop_penalty)
  return scores


def overlong_penalty(lengths: Array, max_len: int, buffer: int, factor: float = 1.0) -> Array:
  """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), added to the sequence score:

      R_len(L) = 0                                   L ≤ L_max − L_buf
               = −factor·(L − (L_max − L_buf))/L_buf  L_max − L_buf < L ≤ L_max

  a penalty growing linearly over the last L_buf tokens before the length limit L_max
  (``max_new_tokens``), −factor at the limit (a response is never longer). verl's
  ``overlong_buffer`` (len, penalty_factor) computes the same.

  Args:
    lengths: [B] response lengths L (the mask's token counts).
    max_len: L_max; buffer: L_buf, 0 < L_buf ≤ L_max; factor ≥ 0.
  """
  chex.assert_rank(lengths, 1)
  if not 0 < buffer <= max_len:
    raise ValueError(f"overlong buffer={buffer} must be in [1, max_new_tokens={max_len}]")
  excess = lengths.astype(jnp.float32) - (max_len - buffer)
  return -factor * jnp.clip(excess, 0.0, None) / buffer


def shape_rewards(
    scores: Array,
    logp: Array,
    ref_logp: Array,
    mask: Array,
    beta: float | Array,
    *,
    has_stop: Array | None = None,
    kl_estimator: str = "k1",
    score_clip: float | None = None,
    missing_stop_penalty: float | None = None,
    whiten: bool = False,
) -> tuple[Array, dict[str, Array]]:
  """Per-token rewards r_t = −β·KL_t, plus the sequence score on the last response token.

    r_t = −β·KL_t·m_t + 1[t = last(m)]·s

  where KL_t is the per-token estimator ``kl_estimator`` (see ``ppojax.core.kl``) and s the adjusted
  score (``adjust_scores``). The last response token is the first stop token, or the final
  position for a response cut off by the length limit; the episode ends there (see
  ``advantages.gae``). With ``whiten`` the rewards are whitened over the mask without shifting
  their mean (trl's ``whiten_rewards``). Padded positions get reward 0.

  Args:
    scores: [B] sequence scores (reward model or reward function).
    logp, ref_logp: [B, T] log-probs of the sampled tokens under policy and reference.
    mask: [B, T] response mask (``ops.response_mask``).
    beta: KL coefficient (``KLControllerState.beta``).

  Returns:
    rewards [B, T] float32 and scalar metrics (trl's names without the ``objective/`` prefix):
    ``kl`` mean over sequences of Σ_t KL_t; ``non_score_reward`` mean of Σ_t −β·KL_t;
    ``scores`` mean adjusted score; ``rlhf_reward`` = scores + non_score_reward;
    ``missing_stop_frac`` fraction of responses without a stop token (0 if ``has_stop`` is None).
  """
  chex.assert_rank([scores, logp, mask], [1, 2, 2])
  chex.assert_equal_shape([logp, ref_logp, mask])
  chex.assert_equal_shape_prefix([scores, logp], 1)
  mask = mask.astype(jnp.bool_)
  scores = adjust_scores(
      scores, has_stop, score_clip=score_clip, missing_stop_penalty=missing_stop_penalty)

  kl = kl_lib.per_token_kl(logp.astype(jnp.float32), ref_logp.astype(jnp.float32), kl_estimator)
  kl = jnp.where(mask, kl, 0.0)
  non_score = -beta * kl
  at_end = ops.last_token_mask(mask) & mask
  rewards = non_score + jnp.where(at_end, scores[:, None], 0.0)
  if whiten:
    rewards = ops.masked_whiten(rewards, mask, shift_mean=False)

  seq_non_score = jnp.sum(non_score, axis=1)
  missing = jnp.zeros(()) if has_stop is None else jnp.mean(1.0 - has_stop.astype(jnp.float32))
  metrics = {
      "kl": jnp.mean(jnp.sum(kl, axis=1)),
      "non_score_reward": jnp.mean(seq_non_score),
      "scores": jnp.mean(scores),
      "rlhf_reward": jnp.mean(scores + seq_non_score),
      "missing_stop_frac": missing,
  }
  return rewards, metrics
