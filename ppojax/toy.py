"""A toy task with a tabular policy: PPO end to end in seconds on a CPU.

The policy is a table of logits indexed by (position, previous token); the critic a table of
values. The task: spell a target sequence and stop. The score is the fraction of the target
(including its final stop token) reproduced at the right positions, counting only tokens inside
the response mask: the stop id is also the pad id here, so a response that stops early must not
earn credit for the padding that follows. Small enough to train in seconds, real enough that a
sign error anywhere in the PPO math shows up as a reward that does not rise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ppojax import step as step_lib

Array = jax.Array


def init_params(key: Array, vocab_size: int, response_length: int, scale: float = 0.01):
  """Actor: logits [R, V + 1 (previous token, incl. BOS), V]; critic: values [R, V + 1]."""
  actor = {"logits": scale * jax.random.normal(key, (response_length, vocab_size + 1, vocab_size))}
  critic = {"values": jnp.zeros((response_length, vocab_size + 1))}
  return actor, critic


def _previous_tokens(tokens: Array, bos_id: int) -> Array:
  bos = jnp.full(tokens.shape[:1] + (1,), bos_id, tokens.dtype)
  return jnp.concatenate([bos, tokens[:, :-1]], axis=1)


def make_models(target: list[int], stop_id: int, vocab_size: int, response_length: int):
  """The four model functions of ``step.Models`` for the spelling task."""
  bos_id = vocab_size
  goal = jnp.asarray(list(target) + [stop_id], jnp.int32)
  if goal.shape[0] > response_length:
    raise ValueError(
        f"target of {len(target)} tokens plus a stop token does not fit in "
        f"response_length={response_length}")
  positions = jnp.arange(response_length)

  def sample(actor, key, batch, temperature):
    def body(prev, key_t):
      t, k = key_t
      logits = actor["logits"][t, prev]
      tok = jax.random.categorical(k, logits / temperature).astype(jnp.int32)
      return tok, tok

    prev0 = jnp.full((batch,), bos_id, jnp.int32)
    keys = jax.random.split(key, response_length)
    _, tokens = jax.lax.scan(body, prev0, (positions, keys))
    return tokens.T

  def logits(actor, tokens):
    return actor["logits"][positions[None, :], _previous_tokens(tokens, bos_id)]

  def value(critic, tokens):
    return critic["values"][positions[None, :], _previous_tokens(tokens, bos_id)]

  def score(tokens, mask):
    n = goal.shape[0]
    hits = (tokens[:, :n] == goal[None, :]) & mask[:, :n]
    return jnp.mean(hits.astype(jnp.float32), axis=1)

  return step_lib.Models(sample=sample, logits=logits, value=value, score=score)
