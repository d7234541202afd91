"""Multi-turn rollouts with the environment on the host (ppojax/rollout/host_turns.py,
ppojax/envs/tools.py, ppojax/envs/calculator.py): the same trajectory as the traced path, one
host round trip per turn for the batch, the run loop with a host environment equal to the same
environment traced, bad tool calls kept in the batch, and a calculator that refuses hostile
input.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppojax.envs import calculator, count_turns
from ppojax.envs.tools import ToolEnv, system_prompt
from ppojax.rollout.host_turns import HostAnswer, answers_to_arrays, host_turns
from ppojax.rollout.multiturn import generate_turns
from ppojax.rollout.sampling import SamplingConfig
from ppojax.run import build as build_lib
from ppojax.run import runner
from ppojax.tasks.count import BOS, COUNT_STOP_BONUS, DIGIT0, STOP
from test_multiturn import MARK, MODEL, PAD, Echo, _prompts  # pylint: disable=wrong-import-order
from test_multiturn import STOP as ECHO_STOP  # pylint: disable=wrong-import-order

_TOY_TURNS = pathlib.Path(__file__).parents[1] / "configs" / "toy_turns.py"


class HostEcho:
  """``test_multiturn.Echo`` on the host."""

  max_turns, obs_tokens, on_host = 3, 4, True

  def reset(self, records, prompts, seed):
    self.rows = len(prompts)

  def step(self, turn, actions, live):
    out = []
    for a in actions:
      n = 1 + sum(a) % 3
      out.append(HostAnswer([10 + turn + c for c in range(4 - n, 4)], float(len(a)), MARK in a,
                            {"invalid": int(sum(a) % 5 == 0)}))
    return out


@pytest.fixture(scope="module")
def params():
  from ppojax.models import positions_from_mask  # pylint: disable=import-outside-toplevel
  tokens, mask = jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 4), bool)
  p = dict(MODEL.init(jax.random.key(0), tokens, positions_from_mask(mask), mask)["params"])
  p["lm_head"] = {"kernel": p["lm_head"]["kernel"] * 6.0}
  return p


@pytest.mark.parametrize("layers", ["scan", "unroll"])
def test_the_host_path_gives_the_traced_paths_trajectory(params, layers):
  """The same environment on the host and traced: the same tokens, masks, log-probs, rewards
  and counts, in one round trip per turn played."""
  prompts, mask = _prompts()
  config = SamplingConfig(6, stop_ids=(ECHO_STOP,), pad_id=PAD, num_samples_per_prompt=2,
                          layers=layers)
  traced = generate_turns(MODEL, params, prompts, mask, jax.random.key(1), config, Echo())
  host, trips = host_turns(MODEL, params, prompts, mask, jax.random.key(1), config, HostEcho())
  for name in ("tokens", "mask", "seen", "turn_rewards", "done"):
    np.testing.assert_array_equal(getattr(traced, name), getattr(host, name), err_msg=name)
  for name in ("logprobs", "sampling_logprobs"):
    np.testing.assert_allclose(getattr(traced, name), getattr(host, name), atol=1e-6)
  for name, v in traced.episode.items():
    np.testing.assert_array_equal(v, host.episode[name], err_msg=name)
  assert trips == int(np.max(traced.episode["turns"]))


def test_the_host_loop_stops_when_every_episode_has_ended(params):
  """An environment that ends every episode after the first turn: one round trip, and the
  trajectory still has all T turns' columns (empty)."""

  class OneTurn(HostEcho):
    def step(self, turn, actions, live):
      return [HostAnswer([], 1.0, True) for _ in actions]

  prompts, mask = _prompts()
  config = SamplingConfig(6, stop_ids=(ECHO_STOP,), pad_id=PAD)
  out, trips = host_turns(MODEL, params, prompts, mask, jax.random.key(1), config, OneTurn())
  assert trips == 1 and out.tokens.shape[1] == 3 * 10
  assert not np.asarray(out.seen)[:, 6:].any() and np.asarray(out.done).all()


def test_an_observation_over_its_budget_is_cut_and_counted():
  answers = [HostAnswer(list(range(7))), HostAnswer([5]), HostAnswer([9, 9])]
  a = answers_to_arrays(answers, np.array([True, True, False]), 4, pad_id=0)
  np.testing.assert_array_equal(a["obs"], [[0, 1, 2, 3], [0, 0, 0, 5], [0, 0, 0, 0]])
  np.testing.assert_array_equal(a["info"]["obs_truncated"], [1, 0, 0])
  np.testing.assert_array_equal(a["obs_mask"][1], [False, False, False, True])


# ---------------------------------------------------------------------------------------------
# A host environment through the run loop: the toy game on the host equals it traced
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class HostCountTurns:
  """``envs.count_turns.CountTurns`` on the host, in Python."""

  max_turns: int
  obs_tokens: int
  on_host = True

  def reset(self, records, prompts, seed):
    assert records is None  # a token task has none
    self.last = [p[-1] - DIGIT0 for p in prompts]

  def step(self, turn, actions, live):
    out = []
    for i, (a, on) in enumerate(zip(actions, live)):
      if not on:
        out.append(HostAnswer([]))
        continue
      want = [DIGIT0 + (self.last[i] + 1 + j) % 10 for j in range(count_turns.COUNT_TURN)]
      head = a[:count_turns.COUNT_TURN]
      right = sum(x == w for x, w in zip(head, want)) / count_turns.COUNT_TURN
      stops = len(a) > count_turns.COUNT_TURN and a[count_turns.COUNT_TURN] == STOP
      bonus = stops and len(head) == count_turns.COUNT_TURN and STOP not in head
      self.last[i] = (self.last[i] + count_turns.COUNT_TURN + 1) % 10
      out.append(HostAnswer([BOS, DIGIT0 + self.last[i]],
                            np.float32(right) + np.float32(COUNT_STOP_BONUS) * bonus,
                            turn == self.max_turns - 1,
                            {"invalid": int(all(x == STOP for x in head))}))
    return out


def host_count(config, tokenizer, sampling):
  del tokenizer, sampling
  return HostCountTurns(config.env.max_turns, config.env.obs_tokens)


def _rows(path):
  return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.mark.parametrize("outcome", ["env", "plus_outcome"])
def test_a_host_environment_runs_as_the_traced_one(tmp_path, outcome):
  """configs/toy_turns.py with its game on the host ("module:factory"): the runner hands the
  rollout its records, the step is three programs (no fused one), the round trips are one per
  turn, and every metric equals the traced game's run from the same seed — with the game's
  rewards alone, and with an outcome score beside them (the count reward: traced in one run, on
  the host in the other)."""
  common = dict(num_iterations=2, sample_every=0, log_every=1, rl__batch_size=16)
  traced_reward = host_reward = {}
  if outcome == "plus_outcome":
    traced_reward = dict(reward__kind="jax", reward__fn="ppojax.tasks.count:count_reward")
    host_reward = dict(reward__kind="python",
                       reward__fn="ppojax.tasks.count:count_reward_numpy")
  traced = build_lib.load_config(_TOY_TURNS, **common, **traced_reward)
  host = build_lib.load_config(_TOY_TURNS, env__name="test_multiturn_host:host_count", **common,
                               **host_reward)
  run = build_lib.build(host)
  assert run.step.fused is None and run.step.host_turns and run.env.on_host
  runner.run(traced, str(tmp_path / "traced"))
  runner.run(host, str(tmp_path / "host"))
  a, b = _rows(tmp_path / "traced" / "metrics.jsonl"), _rows(tmp_path / "host" / "metrics.jsonl")
  assert b[-1]["episode/host_round_trips"] == 3.0
  for ra, rb in zip(a, b):
    for k, v in ra.items():
      if not k.startswith(("time/", "memory/", "compile/", "eps")):
        assert rb[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k


# ---------------------------------------------------------------------------------------------
# Tools: bad calls keep the batch
# ---------------------------------------------------------------------------------------------


class _CharTokenizer:
  """Characters as token ids (ord), enough for ToolEnv without a chat template."""

  def decode(self, ids, skip_special_tokens=False):
    del skip_special_tokens
    return "".join(chr(i) for i in ids)

  def __call__(self, text, add_special_tokens=False):
    del add_special_tokens
    return {"input_ids": [ord(c) for c in text]}


def _slow(seconds: float) -> str:
  """Sleeps.

  Args:
      seconds: how long.
  """
  time.sleep(seconds)
  return "late"


def _boom() -> str:
  """Raises."""
  raise RuntimeError("kaput")


def _tool_env(**kw):
  tools = {"calculate": calculator.calculate, "slow": _slow, "boom": _boom}
  return ToolEnv(tools, _CharTokenizer(), max_turns=3, obs_tokens=64, chat_template=False,
                 timeout_s=0.5, **kw)


def _ids(text):
  return [ord(c) for c in text]


def test_tool_calls_bad_and_good_each_answer_and_are_counted():
  """A good call answers with the result; a malformed call, an unknown tool, wrong arguments, a
  tool that raises and one past its time limit each answer with an error text (counted), and
  the episode goes on; a turn without a call ends it."""
  env = _tool_env()
  env.reset(None, [[1]] * 7, 0)
  call = lambda body: _ids(f"<tool_call>{body}</tool_call>")  # noqa: E731
  actions = [call('{"name": "calculate", "arguments": {"expression": "347 * 28"}}'),
             call('{"name": "calculate", "arguments": {"expression": '),
             call('{"name": "nope", "arguments": {}}'),
             call('{"name": "calculate", "arguments": {"x": 1}}'),
             call('{"name": "boom", "arguments": {}}'),
             call('{"name": "slow", "arguments": {"seconds": 5}}'),
             _ids("The answer is 9716.")]
  t0 = time.perf_counter()
  answers = env.step(0, actions, [True] * 7)
  assert time.perf_counter() - t0 < 3  # the slow tool was not waited for
  texts = [_CharTokenizer().decode(a.ids) for a in answers]
  assert texts[0] == "\n9716\n"
  assert answers[0].info == {"tool_calls": 1, "tool_errors": 0, "results_cut": 0}
  for i, why in ((1, "could not be read"), (2, "no tool named 'nope'"), (3, "bad arguments"),
                 (4, "boom failed: RuntimeError: kaput"), (5, "took longer than 0.5 s")):
    assert why in texts[i] and texts[i].strip().startswith("error:"), (i, texts[i])
    assert answers[i].info["tool_errors"] == 1 and not answers[i].done
  assert answers[6].done and answers[6].ids == []  # no call: every key, so the metrics exist
  assert answers[6].info == {"tool_calls": 0, "tool_errors": 0, "results_cut": 0}
  assert env.step(1, [_ids("x")], [False])[0] == HostAnswer([])  # an ended row: nothing


def test_the_system_prompt_offers_the_tools_schema():
  text = system_prompt([calculator.calculate])
  assert "calculate(expression: string): Evaluate" in text and '<tool_call>{"name"' in text
  with pytest.raises(ValueError, match="gemma3 calls differently"):
    system_prompt([calculator.calculate], "gemma3")


# ---------------------------------------------------------------------------------------------
# The calculator: the model's text is never executed
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("expression, want", [
    ("347 * 28", "9716"), ("(12 + 3) * -2", "-30"), ("10 / 4", "2.5"), ("7 // 2", "3"),
    ("2 ** 10", "1024"), ("1e3 + 1", "1001"), ("3 × 4", "12"), ("2^5", "32"),
    ("123456789 * 987654321", "121932631112635269")])
def test_the_calculator_computes(expression, want):
  assert calculator.calculate(expression) == want


@pytest.mark.parametrize("hostile", [
    "__import__('os').system('echo hi')", "open('/etc/passwd').read()", "exec('1')",
    "eval('1+1')", "(1).__class__", "[x for x in range(10**9)]", "lambda: 0", "x", "'a' * 10",
    "2 ** 100000", "9 ** 9 ** 9", "10 ** 64 * 10 ** 64", "1 / 0", "(-8) ** 0.5",
    "1 +" * 100 + "1", "(" * 120 + "1" + ")" * 120, "1e400", "sum([1, 2])", "", "1; 2"])
def test_the_calculator_refuses_hostile_input_quickly(hostile):
  """Code, names, attributes, huge powers and products, long or deep expressions: each an error
  text, at once (a bounded parse, no evaluation of anything but numbers and operators)."""
  t0 = time.perf_counter()
  out = calculator.calculate(hostile)
  assert out.startswith("error:"), out
  assert time.perf_counter() - t0 < 0.5


def test_a_long_tool_result_is_cut_inside_its_frame():
  """A result longer than the observation budget keeps its start, marked "…", and the frame's
  end (the next turn's prompt), counted in ``results_cut``."""

  def long_text() -> str:
    """Returns a long text."""
    return "x" * 500

  env = ToolEnv({"long_text": long_text}, _CharTokenizer(), max_turns=2, obs_tokens=40,
                chat_template=False)
  answer = env.step(0, [_ids('<tool_call>{"name": "long_text", "arguments": {}}</tool_call>')],
                    [True])[0]
  text = _CharTokenizer().decode(answer.ids)
  assert len(answer.ids) <= 40 and text.startswith("\nxxx") and text.endswith("…\n")
  assert answer.info["results_cut"] == 1 and answer.info["tool_errors"] == 0
