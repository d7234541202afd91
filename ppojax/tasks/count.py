"""Toy tasks with verifiable rewards, for tests and the default config (no tokenizer needed).

The *count* task: a prompt is BOS followed by a run of consecutive digits (mod 10); the policy
should continue the run for ``COUNT_ANSWER`` more digits and then emit the stop token:

    prompt   BOS 7 8 9            response   0 1 2 <stop>

Tokens: 0 is both pad and stop (pad == eos, like many real tokenizers), 1 is BOS, digit d is
token d + 2. The score is the fraction of the ``COUNT_ANSWER`` digits that are right, plus
``COUNT_STOP_BONUS`` when the stop token follows immediately. The rule exists twice — in jnp
(``count_reward``, traced into the compiled step) and in NumPy (``count_reward_numpy``, the
host-side "Python reward" path) — and both give identical scores.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ppojax.data.batch import Prompts

STOP, BOS, DIGIT0 = 0, 1, 2
COUNT_ANSWER = 3
COUNT_STOP_BONUS = 0.25


def count_prompts(seed: int, position: int, batch: int, prompt_len: int) -> Prompts:
  """Batch number ``position`` of count prompts, left-padded to ``prompt_len`` (a pure function
  of (seed, position): resuming at a position reproduces the data exactly)."""
  if prompt_len < 3:
    raise ValueError(f"count prompts need prompt_len >= 3 (BOS and 2 digits), got {prompt_len}")
  rng = np.random.default_rng([seed, position])
  lengths = rng.integers(2, prompt_len, size=batch)  # digits per prompt (BOS adds one)
  starts = rng.integers(0, 10, size=batch)
  tokens = np.full((batch, prompt_len), STOP, np.int32)
  mask = np.zeros((batch, prompt_len), bool)
  for i, (n, s) in enumerate(zip(lengths, starts)):
    row = [BOS] + [DIGIT0 + (s + j) % 10 for j in range(n)]
    tokens[i, prompt_len - len(row):] = row
    mask[i, prompt_len - len(row):] = True
  return Prompts(tokens, mask)


def _expected_digits(prompts, xp):
  last = prompts[:, -1] - DIGIT0  # left-padded: the last column is the last prompt digit
  return DIGIT0 + (last[:, None] + 1 + xp.arange(COUNT_ANSWER)[None]) % 10


def count_reward(prompts, prompt_mask, responses, response_mask) -> jax.Array:
  """The count score [B] in jnp (see the module docstring)."""
  del prompt_mask, response_mask  # the responses are padded with STOP after their stop token
  want = _expected_digits(prompts, jnp)
  right = jnp.sum(responses[:, :COUNT_ANSWER] == want, axis=1).astype(jnp.float32) / COUNT_ANSWER
  stops = responses[:, COUNT_ANSWER] == STOP if responses.shape[1] > COUNT_ANSWER else False
  bonus = stops & jnp.all(responses[:, :COUNT_ANSWER] != STOP, axis=1)
  return right + jnp.float32(COUNT_STOP_BONUS) * bonus


def count_reward_numpy(rollout) -> np.ndarray:
  """The same score on host arrays (a ``Rollout`` of NumPy arrays): the Python-reward path."""
  prompts, responses = np.asarray(rollout.prompts), np.asarray(rollout.responses)
  want = _expected_digits(prompts, np)
  right = np.sum(responses[:, :COUNT_ANSWER] == want, axis=1).astype(np.float32)
  right = right / np.float32(COUNT_ANSWER)  # float32 throughout, as the jnp rule
  stops = (responses[:, COUNT_ANSWER] == STOP if responses.shape[1] > COUNT_ANSWER
           else np.zeros(len(responses), bool))
  bonus = stops & np.all(responses[:, :COUNT_ANSWER] != STOP, axis=1)
  return right + np.float32(COUNT_STOP_BONUS) * bonus


def decode_count(tokens, mask) -> str:
  """Human-readable tokens for sample tables: digits, ``<s>`` for BOS, ``</s>`` for stop."""
  names = {STOP: "</s>", BOS: "<s>"}
  return " ".join(names.get(int(t), str(int(t) - DIGIT0)) for t, m in zip(tokens, mask) if m)
