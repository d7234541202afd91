"""The decode's stop condition checked every N steps (``SamplingConfig.stop_check_every``, issue
62 item 3): N decode steps run as one fixed-trip loop between checks, and whatever N is the
tokens, log-probs, masks and lengths are those of a check after every step — single turn
(greedy and sampled, rows stopping at different steps, N dividing the response length or not,
several samples per prompt) and multi-turn (a later turn reuses the cache the steps past a
turn's end wrote into)."""

import dataclasses

import jax
import numpy as np
import pytest

from ppojax.rollout import sampling
from ppojax.rollout.multiturn import generate_turns
from ppojax.rollout.sampling import SamplingConfig, generate

from test_decode_layers import STOP, TINY, _params, _prompts
from test_multiturn import MODEL, Echo
from test_multiturn import _prompts as _turn_prompts
from test_multiturn import params as turn_params  # noqa: F401  (a fixture)
from ppojax.models import CausalLM

STOPS = tuple(range(STOP, STOP + 12))  # a quarter of the vocabulary: rows stop early
FIELDS = ("tokens", "logprobs", "sampling_logprobs", "mask", "lengths")


def _generations(config: SamplingConfig, everies, key: int = 3):
  tokens, mask = _prompts()
  params = _params()
  return {every: jax.device_get(generate(
      CausalLM(TINY), params, tokens, mask, jax.random.key(key),
      dataclasses.replace(config, stop_check_every=every))) for every in everies}


@pytest.mark.parametrize("greedy", [False, True])
@pytest.mark.parametrize("new", [10, 12])  # N = 3 and 4 divide one and not the other's 9, 11
def test_a_stop_check_every_n_steps_gives_the_same_generation(greedy, new):
  config = SamplingConfig(new, stop_ids=STOPS, pad_id=0, greedy=greedy, top_p=0.9,
                          num_samples_per_prompt=2)
  out = _generations(config, (1, 3, 4, 32))
  lengths = out[1].lengths
  assert len(set(lengths.tolist())) > 1 and lengths.min() < new  # rows stop at different steps
  for every in (3, 4, 32):
    for field in FIELDS:
      np.testing.assert_array_equal(getattr(out[every], field), getattr(out[1], field),
                                    err_msg=f"{field}, N = {every}")


def test_rows_that_never_stop_keep_their_last_token():
  """No stop token is reachable: every row runs to R, and the steps past R (N = 4, R − 1 = 9
  decode steps) leave the last column as it was."""
  config = SamplingConfig(10, stop_ids=(TINY.vocab_size + 5,), pad_id=0)
  out = _generations(config, (1, 4))
  assert (out[1].lengths == 10).all()
  for field in FIELDS:
    np.testing.assert_array_equal(getattr(out[4], field), getattr(out[1], field), err_msg=field)


def test_multi_turn_generations_are_the_same(turn_params):  # noqa: F811
  prompts, mask = _turn_prompts()
  out = {}
  for every in (1, 4):
    config = SamplingConfig(6, stop_ids=(1,), pad_id=0, num_samples_per_prompt=2,
                            stop_check_every=every)
    out[every] = jax.device_get(generate_turns(MODEL, turn_params, prompts, mask,
                                               jax.random.key(1), config, Echo(obs_tokens=2)))
  for a, b in zip(jax.tree.leaves(out[4]), jax.tree.leaves(out[1])):
    np.testing.assert_array_equal(a, b)


def test_n_is_automatic_per_platform_and_checked(monkeypatch):
  assert sampling.stop_check_steps(0) == 1  # this CPU
  assert sampling.stop_check_steps(5) == 5
  monkeypatch.setattr(sampling, "compile_platform", lambda x=None: "gpu")
  assert sampling.stop_check_steps(0) == sampling.STOP_CHECK_GPU
  with pytest.raises(ValueError, match="stop_check_every must be an int >= 0"):
    SamplingConfig(4, stop_ids=(1,), pad_id=0, stop_check_every=-1)


def test_the_config_option_reaches_the_sampling_config():
  from ppojax.models import LoadedModel  # pylint: disable=import-outside-toplevel
  from ppojax.run import build as build_lib  # pylint: disable=import-outside-toplevel
  from ppojax.run import checks  # pylint: disable=import-outside-toplevel
  from ppojax.run.config import defaults  # pylint: disable=import-outside-toplevel
  config = defaults()
  policy = LoadedModel(TINY.replace(eos_token_id=STOP), None, None, "lm")
  assert build_lib.sampling_config(config, policy).stop_check_every == 0
  config.sampling.stop_check_every = 4
  assert build_lib.sampling_config(config, policy).stop_check_every == 4
  config.sampling.stop_check_every = -2
  with pytest.raises(checks.ConfigError, match="sampling.stop_check_every"):
    checks.check_ranges(config)
