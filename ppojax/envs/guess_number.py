"""Guess the number, a multi-turn game traced into the step: the environment holds a secret
number in [``low``, ``high``]; each turn the policy guesses, and the environment answers
"Higher." or "Lower." (or asks for a number), until the guess is right or the turns run out.

    user       I am thinking of a number from 1 to 20. ...   (``tasks.sources.guess_prompt``)
    assistant  10                          environment: Lower.
    assistant  5                           environment: Higher.
    assistant  7                           (right: reward 1, the episode ends)

Everything is on token ids (``TokenEnv``): the guess is the first run of digit tokens in the
turn (``tokens.DigitTable``), the answers are fixed token sequences, framed by the chat template
once on the host (``data.turns.observation_ids``) and picked per row. The secret is drawn per
prompt at reset, so a group of n samples plays the same game. Reward: 1 on the turn that finds
the secret (``env.reward_per_turn`` less for each turn spent before it: finding it sooner is
better), plus ``env.format_reward`` for each turn whose guess is a number in range.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ppojax.envs.tokens import DigitTable, digit_table, first_number
from ppojax.rollout.multiturn import EnvStep

ANSWERS = ("Higher.", "Lower.", "Correct!", "Please reply with just a number from {low} to "
           "{high}.")
HIGHER, LOWER, CORRECT, INVALID = range(4)


@dataclasses.dataclass(frozen=True)
class GuessNumber:
  """The game (hashable: token tables are tuples)."""

  max_turns: int
  obs_tokens: int
  low: int
  high: int
  digits: DigitTable
  answers: tuple[tuple[int, ...], ...]  # each answer's ids, right-aligned in obs_tokens
  answer_lengths: tuple[int, ...]
  reward_per_turn: float = 0.0
  format_reward: float = 0.0  # for each turn whose guess is a number in range

  def reset(self, key, prompts, prompt_mask):
    """A secret per prompt row, uniform in [low, high]."""
    del prompt_mask
    return jax.random.randint(key, (prompts.shape[0],), self.low, self.high + 1, jnp.int32)

  def step(self, state, action, action_mask, turn) -> EnvStep:
    guess, found = first_number(self.digits, action, action_mask)
    valid = found & (guess >= self.low) & (guess <= self.high)
    answer = jnp.where(~valid, INVALID, jnp.where(guess < state, HIGHER,
                                                  jnp.where(guess > state, LOWER, CORRECT)))
    right = answer == CORRECT
    table = jnp.asarray(np.asarray(self.answers, np.int32))
    lengths = jnp.asarray(self.answer_lengths, jnp.int32)[answer]
    obs = table[answer]
    obs_mask = jnp.arange(self.obs_tokens)[None] >= self.obs_tokens - lengths[:, None]
    reward = (jnp.where(right, 1.0 - self.reward_per_turn * turn, 0.0)
              + self.format_reward * valid).astype(jnp.float32)
    return EnvStep(state, obs, obs_mask, reward, right, {"invalid": ~valid, "solved": right})


def make(config, tokenizer, sampling) -> GuessNumber:
  """``env.name = "guess_number"``: the range from ``env.low`` / ``env.high``, the answers framed
  by the tokenizer's chat template after the policy's stop token."""
  from ppojax.data.turns import end_of_turn, observation_ids  # the host side: tokenizer, template
  if tokenizer is None:
    raise ValueError("env.name='guess_number' needs the policy's tokenizer (model.tokenizer)")
  e, d = config.env, config.data
  low, high = int(e.get("low", 1)), int(e.get("high", 20))
  if not 0 <= low < high:
    raise ValueError(f"guess_number needs 0 <= env.low < env.high, got {low}, {high}")
  end = end_of_turn(tokenizer, sampling.stop_ids)
  ids = [observation_ids(tokenizer, a.format(low=low, high=high), end_of_turn=end,
                         chat_template=d.chat_template,
                         chat_template_kwargs=d.get("chat_template_kwargs"))
         for a in ANSWERS]
  longest = max(len(x) for x in ids)
  if longest > e.obs_tokens:
    raise ValueError(f"guess_number's answers take up to {longest} tokens with this tokenizer's "
                     f"chat template; raise env.obs_tokens (now {e.obs_tokens}) to {longest}")
  pad = sampling.pad_id
  answers = tuple(tuple([pad] * (e.obs_tokens - len(x)) + list(x)) for x in ids)
  return GuessNumber(e.max_turns, e.obs_tokens, low, high, digit_table(tokenizer), answers,
                     tuple(len(x) for x in ids), float(e.get("reward_per_turn", 0.0)),
                     float(e.get("format_reward", 0.0)))

