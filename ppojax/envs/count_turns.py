"""A toy multi-turn environment on the count task's tokens (``tasks.count``), for tests and the
toy config: the policy and the environment take turns continuing a run of digits.

    prompt  BOS 7 8 9
    turn 0  policy: 0 1 <stop>       environment: BOS 2      (the run goes on after the policy's
    turn 1  policy: 3 4 <stop>       environment: BOS 5       ``COUNT_TURN`` digits)

Each turn's reward is the fraction of its ``COUNT_TURN`` digits that continue the run, plus
``tasks.count.COUNT_STOP_BONUS`` when the stop token follows them; the run's expected digits do
not depend on what the policy wrote, so every turn is scored on its own. The episode ends after
``max_turns`` turns (``done`` on the last).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from ppojax.rollout.multiturn import EnvStep
from ppojax.tasks.count import BOS, COUNT_STOP_BONUS, DIGIT0, STOP

COUNT_TURN = 2  # digits the policy owes each turn


@dataclasses.dataclass(frozen=True)
class CountTurns:
  """The environment (hashable: a static argument of the compiled step)."""

  max_turns: int = 3
  obs_tokens: int = 2

  def reset(self, key, prompts, prompt_mask):
    """The state: the run's last digit [B] (the prompt's last token, left-padded prompts)."""
    del key, prompt_mask
    return prompts[:, -1].astype(jnp.int32) - DIGIT0

  def step(self, state, action, action_mask, turn) -> EnvStep:
    """Score the turn's first ``COUNT_TURN`` tokens against the run, answer with the next
    digit."""
    want = DIGIT0 + (state[:, None] + 1 + jnp.arange(COUNT_TURN)[None]) % 10
    head = action[:, :COUNT_TURN]
    right = jnp.sum((head == want) & action_mask[:, :COUNT_TURN], axis=1) / COUNT_TURN
    stops = (action[:, COUNT_TURN] == STOP) & action_mask[:, COUNT_TURN]
    bonus = stops & jnp.all(head != STOP, axis=1)
    reward = right.astype(jnp.float32) + jnp.float32(COUNT_STOP_BONUS) * bonus
    following = (state + COUNT_TURN + 1) % 10
    obs = jnp.zeros((action.shape[0], self.obs_tokens), jnp.int32)
    obs = obs.at[:, -2].set(BOS).at[:, -1].set(DIGIT0 + following)
    obs_mask = jnp.arange(self.obs_tokens)[None] >= self.obs_tokens - 2
    obs_mask = jnp.broadcast_to(obs_mask, obs.shape)
    done = jnp.broadcast_to(turn == self.max_turns - 1, reward.shape)
    return EnvStep(following, obs, obs_mask, reward, done,
                   {"invalid": ~jnp.any(head != STOP, axis=1)})


def make(config, tokenizer=None, sampling=None) -> CountTurns:
  """``env.name = "count_turns"``: its budgets from ``config.env``."""
  del tokenizer, sampling
  if config.env.obs_tokens < 2:
    raise ValueError(f"count_turns answers with 2 tokens: env.obs_tokens must be >= 2, got "
                     f"{config.env.obs_tokens}")
  if config.sampling.max_new_tokens <= COUNT_TURN:
    raise ValueError(f"count_turns needs sampling.max_new_tokens > {COUNT_TURN} (the turn's "
                     f"digits and its stop token), got {config.sampling.max_new_tokens}")
  return CountTurns(config.env.max_turns, config.env.obs_tokens)

