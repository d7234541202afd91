"""Multi-turn rollouts (ppojax/rollout/multiturn.py, ppojax/envs/): token in, token out; the
policy-token and seen masks; the learner's log-probs equal the sampler's on every turn; budgets
and episode ends; GAE across turns against a hand-written reference; the loss blind to the
environment's tokens; packing over the holes; the traced games; the whole run (one compiled
program, compile count flat, resume exact).
"""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppojax.core import advantages, algorithms
from ppojax.envs import count_turns, tokens as env_tokens
from ppojax.learner import experience as exp_lib
from ppojax.learner import loss as loss_lib
from ppojax.models import CausalLM, ModelConfig, positions_from_mask
from ppojax.models import packing
from ppojax.models.passes import response_logprobs, sequence
from ppojax.rollout.multiturn import EnvStep, generate_turns
from ppojax.rollout.sampling import SamplingConfig
from ppojax.run import build as build_lib
from ppojax.run import runner

TINY = ModelConfig(model_type="llama", vocab_size=32, hidden_size=32, intermediate_size=64,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                   max_position_embeddings=128, norm_eps=1e-5, tie_word_embeddings=False)
MODEL = CausalLM(TINY)
STOP, PAD, MARK = 1, 0, 7  # MARK in a turn ends the toy episode
_TOY_TURNS = pathlib.Path(__file__).parents[1] / "configs" / "toy_turns.py"


@dataclasses.dataclass(frozen=True)
class Echo:
  """A toy traced environment: the observation is 1–3 tokens 10 + turn + j (its length set by
  the turn's token sum), the reward the turn's policy-token count, the episode ends on MARK."""

  max_turns: int = 3
  obs_tokens: int = 4

  def reset(self, key, prompts, prompt_mask):
    del key, prompt_mask
    return jnp.zeros(prompts.shape[:1], jnp.int32)

  def step(self, state, action, action_mask, turn) -> EnvStep:
    total = jnp.sum(jnp.where(action_mask, action, 0), axis=1)
    n = 1 + total % 3
    cols = jnp.arange(self.obs_tokens)
    obs_mask = cols[None] >= self.obs_tokens - n[:, None]
    obs = jnp.broadcast_to(10 + cols[None] + turn, obs_mask.shape).astype(jnp.int32)
    done = jnp.any(action_mask & (action == MARK), axis=1)
    return EnvStep(state + 1, obs, obs_mask, jnp.sum(action_mask, 1).astype(jnp.float32), done,
                   {"invalid": total % 5 == 0})


@pytest.fixture(scope="module")
def params():
  tokens, mask = jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 4), bool)
  p = dict(MODEL.init(jax.random.key(0), tokens, positions_from_mask(mask), mask)["params"])
  p["lm_head"] = {"kernel": p["lm_head"]["kernel"] * 6.0}  # peaked: some turns stop early
  return p


def _prompts(b=4, p=5):
  rng = np.random.default_rng(0)
  tokens = rng.integers(2, 32, (b, p)).astype(np.int32)
  lengths = rng.integers(1, p + 1, b)
  mask = np.arange(p)[None] >= p - lengths[:, None]
  return jnp.asarray(tokens), jnp.asarray(mask)


def _generate(params, layers="scan", n=2, prefix=None, turns=3, length=6, key=1):
  prompts, mask = _prompts()
  config = SamplingConfig(length, stop_ids=(STOP,), pad_id=PAD, num_samples_per_prompt=n,
                          layers=layers)
  out = generate_turns(MODEL, params, prompts, mask, jax.random.key(key), config,
                       Echo(max_turns=turns), prefix=prefix)
  return out, jnp.repeat(prompts, n, 0), jnp.repeat(mask, n, 0)


@pytest.mark.parametrize("layers", ["scan", "unroll"])
def test_learner_log_probs_equal_the_samplers_on_every_turn(params, layers):
  """A forward pass over prompt + trajectory, attending to ``seen``, gives the log-probs the
  sampler drew each policy token with (float32 rounding, ≤ 1e-5): the sequence the learner
  sees is the one the sampler saw, turn after turn."""
  out, prompts, mask = _generate(params, layers)
  logp = response_logprobs(MODEL, params, prompts, mask, out.tokens, out.seen, 1.0)
  np.testing.assert_allclose(np.where(out.mask, logp, 0.0), out.logprobs, atol=1e-5)
  assert int(out.mask.sum()) > 3 * out.tokens.shape[0]  # several turns' tokens compared


def test_learner_log_probs_equal_the_samplers_with_a_shared_prefix(params):
  """The same with the first tokens of every row as a shared prefix (prefilled once)."""
  prompts, mask = _prompts()
  prefix = jnp.asarray([3, 4], jnp.int32)
  full = jnp.concatenate([jnp.broadcast_to(prefix, (4, 2)), prompts], axis=1)
  full_mask = jnp.concatenate([jnp.ones((4, 2), bool), mask], axis=1)
  config = SamplingConfig(6, stop_ids=(STOP,), pad_id=PAD, num_samples_per_prompt=2)
  out = generate_turns(MODEL, params, prompts, mask, jax.random.key(3), config, Echo(),
                       prefix=prefix)
  logp = response_logprobs(MODEL, params, jnp.repeat(full, 2, 0), jnp.repeat(full_mask, 2, 0),
                           out.tokens, out.seen, 1.0)
  np.testing.assert_allclose(np.where(out.mask, logp, 0.0), out.logprobs, atol=1e-5)


def test_trajectory_layout_token_in_token_out(params):
  """Turn k's policy tokens sit at k·(L+O) …, its observation right-aligned after them, the
  environment's ids verbatim; ``mask`` ⊆ ``seen``; holes hold pad_id and are in neither; a
  turn's reward sits on its last policy token; nothing follows an ended episode."""
  out, _, _ = _generate(params)
  length, obs, turns = 6, 4, 3
  tokens, mask, seen = (np.asarray(x) for x in (out.tokens, out.mask, out.seen))
  assert tokens.shape[1] == turns * (length + obs)
  assert not (mask & ~seen).any() and (tokens[~seen] == PAD).all()
  per_turn = lambda x: x.reshape(x.shape[0], turns, length + obs)  # noqa: E731
  pt, pm, ps, rw = per_turn(tokens), per_turn(mask), per_turn(seen), per_turn(
      np.asarray(out.turn_rewards))
  assert not pm[:, :, length:].any()  # no policy token in an observation's columns
  for b in range(tokens.shape[0]):
    ended = False
    for k in range(turns):
      policy, o_mask = pm[b, k, :length], ps[b, k, length:]
      if ended:
        assert not ps[b, k].any() and rw[b, k].sum() == 0
        continue
      n = int(policy.sum())
      assert policy[:n].all() and not policy[n:].any()  # a turn is a prefix of its columns
      assert rw[b, k, n - 1] == n and rw[b, k].sum() == n  # Echo's reward: the token count
      ended = bool(MARK in pt[b, k, :n]) or k == turns - 1
      if ended:
        assert not o_mask.any()  # an ended episode's answer is not shown
      else:
        total = int(np.sum(pt[b, k, :n]))
        want = 1 + total % 3
        assert o_mask.sum() == want and o_mask[obs - want:].all()  # right-aligned
        np.testing.assert_array_equal(pt[b, k, length + obs - want:],
                                      10 + k + np.arange(obs - want, obs))
  assert (np.asarray(out.episode["turns"]) >= 1).all()


def test_budgets_and_counts(params):
  """A turn that hits its L tokens without a stop is counted (``truncated_turns``); an episode
  out of turns is not ``done``; the environment's own counts are summed per episode."""
  out, _, _ = _generate(params, length=2, turns=2)
  e = {k: np.asarray(v) for k, v in out.episode.items()}
  mask = np.asarray(out.mask).reshape(out.mask.shape[0], 2, 6)[:, :, :2]
  tokens = np.asarray(out.tokens).reshape(out.mask.shape[0], 2, 6)[:, :, :2]
  stopped = (tokens == STOP) & mask
  cut = (mask.sum(-1) == 2) & ~stopped.any(-1)  # a live turn that used its 2 tokens, no stop
  np.testing.assert_array_equal(e["truncated_turns"], cut.sum(1))
  assert (e["turns"] <= 2).all() and e["truncated_turns"].sum() > 0
  np.testing.assert_array_equal(np.asarray(out.done), e["done"] > 0)


def _np_gae(r, v, m, gamma, lam):
  """GAE over each row's masked tokens as one sequence (the gaps removed), by hand."""
  adv = np.zeros_like(r)
  for b in range(r.shape[0]):
    idx = np.flatnonzero(m[b])
    a_next, v_next = 0.0, 0.0
    for t in idx[::-1]:
      delta = r[b, t] + gamma * v_next - v[b, t]
      a_next = delta + gamma * lam * a_next
      v_next, adv[b, t] = v[b, t], a_next
  return adv, np.where(m, adv + v, 0.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_across_turns_skips_the_observations(seed):
  """GAE over a mask with gaps bootstraps each turn's last token from the next turn's first
  policy token's value (one γ per policy token), as over the policy tokens alone."""
  rng = np.random.default_rng(seed)
  m = rng.random((5, 17)) < 0.6
  r, v = rng.normal(size=(2, 5, 17)).astype(np.float32)
  adv, ret = advantages.gae(jnp.asarray(r), jnp.asarray(v), jnp.asarray(m), 0.9, 0.8)
  want_adv, want_ret = _np_gae(r.astype(np.float64), v.astype(np.float64), m, 0.9, 0.8)
  np.testing.assert_allclose(adv, want_adv, atol=1e-5)
  np.testing.assert_allclose(ret, want_ret, atol=1e-5)
  compact = lambda x, b: np.concatenate([x[b][m[b]], np.zeros((~m[b]).sum())])  # noqa: E731
  a2, _ = advantages.gae(jnp.asarray(np.stack([compact(r, b) for b in range(5)])),
                         jnp.asarray(np.stack([compact(v, b) for b in range(5)])),
                         jnp.asarray(np.sort(m, axis=1)[:, ::-1]), 0.9, 0.8)
  np.testing.assert_allclose(np.stack([compact(np.asarray(adv), b) for b in range(5)]), a2,
                             atol=1e-6)


def _experience(algorithm_name: str, seed: int = 0, holes: bool = True):
  """A random multi-turn experience and the same with the holes removed (policy tokens first)."""
  rng = np.random.default_rng(seed)
  b, t = 8, 20
  mask = rng.random((b, t)) < 0.5
  mask[:, 0] = True
  seen = mask | (rng.random((b, t)) < 0.5)
  data = {k: rng.normal(size=(b, t)).astype(np.float32) * 0.1 for k in ("old", "ref", "val")}
  turn = np.where(mask & (rng.random((b, t)) < 0.2), 1.0, 0.0).astype(np.float32)
  order = np.argsort(~mask, axis=1, kind="stable") if not holes else np.tile(np.arange(t), (b, 1))
  take = lambda x: np.take_along_axis(x, order, axis=1)  # noqa: E731
  mk = lambda x: jnp.asarray(np.where(take(mask), take(x), 0))  # noqa: E731
  from ppojax.rollout.rollout import Rollout  # pylint: disable=import-outside-toplevel
  r = Rollout(prompts=jnp.ones((b, 3), jnp.int32), prompt_mask=jnp.ones((b, 3), bool),
              responses=jnp.ones((b, t), jnp.int32), mask=jnp.asarray(take(mask)),
              has_stop=jnp.asarray(rng.random(b) < 0.7), old_logp=mk(data["old"]),
              ref_logp=mk(data["ref"]), old_values=mk(data["val"]),
              seen=jnp.asarray(take(seen) if holes else take(mask)), turn_rewards=mk(turn),
              episode={"turns": jnp.ones((b,), jnp.int32)})
  config = algorithms.resolve(build_lib.load_config(_TOY_TURNS, algorithm=algorithm_name))
  scores = jnp.asarray(rng.normal(size=b).astype(np.float32)) + exp_lib.episode_return(r)
  algo = algorithms.from_config(config)
  exp, metrics = exp_lib.make_experience(r, scores, jnp.float32(0.05), algo, config.rl,
                                         group_size=config.sampling.num_samples_per_prompt)
  logp = exp.rollout.old_logp + 0.05 * jnp.asarray(take(rng.normal(size=(b, t))), jnp.float32)
  values = None if exp.returns is None else exp.rollout.old_values
  loss, _ = loss_lib.clipped_loss(logp, jnp.zeros_like(logp), values, exp, algo, config.rl)
  return exp, metrics, loss


@pytest.mark.parametrize("algorithm_name", ["ppo", "grpo", "reinforce_pp", "gspo"])
def test_the_environments_tokens_carry_no_loss(algorithm_name):
  """The experience and loss of a trajectory with holes equal those of its policy tokens moved
  together (the observations removed): the environment's tokens take no part in advantages,
  KL, the loss or its token totals."""
  exp, metrics, loss = _experience(algorithm_name, holes=True)
  exp2, metrics2, loss2 = _experience(algorithm_name, holes=False)
  np.testing.assert_allclose(float(loss), float(loss2), rtol=1e-5, atol=1e-7)
  m = np.asarray(exp.rollout.mask)
  for a, b in ((exp.advantages, exp2.advantages), (exp.returns, exp2.returns)):
    if a is not None:
      np.testing.assert_allclose(np.sort(np.asarray(a)[m]), np.sort(np.asarray(b)[
          np.asarray(exp2.rollout.mask)]), atol=1e-5)
  for k in ("objective/kl", "objective/scores", "reward", "objective/entropy_masked"):
    assert metrics[k] == pytest.approx(float(metrics2[k]), rel=1e-5, abs=1e-6), k
  assert 0 < metrics["episode/obs_share"] and metrics2["episode/obs_share"] == 0


def test_packing_skips_the_holes(params):
  """Packed rows hold each sequence's seen tokens in order; the packed forward's log-probs at
  the policy tokens equal the padded forward's."""
  out, prompts, mask = _generate(params)
  tokens, seq_mask, positions = sequence(prompts, mask, out.tokens, out.seen)
  rows = 5
  packed = packing.pack(tokens, seq_mask, positions, out.tokens.shape[1], rows)
  assert bool(packed.fits)
  hidden, _ = MODEL.apply({"params": params}, packed.tokens, packed.positions, packed.segments,
                          method="hidden")
  from ppojax.models.passes import head_logprobs  # pylint: disable=import-outside-toplevel
  logp, _ = head_logprobs(MODEL, params, hidden, packed.targets, 1.0)
  got = packing.unpack(logp, packed, out.seen)
  np.testing.assert_allclose(np.where(out.mask, got, 0.0), out.logprobs, atol=1e-5)


def test_first_number_reads_digit_tokens():
  """The first run of digit tokens, multi-digit tokens and a spaced digit ending a run."""
  table = env_tokens.DigitTable(
      value=(-1, 1, 2, 3, 12, 7, -1), length=(0, 1, 1, 1, 2, 1, 0),
      spaced=(False, False, False, False, False, True, False))
  rows = jnp.asarray([[0, 1, 2, 6, 3], [6, 4, 3, 5, 1], [0, 6, 0, 0, 0], [5, 1, 2, 0, 3]])
  mask = jnp.ones(rows.shape, bool).at[0, 1].set(False)
  value, found = env_tokens.first_number(table, rows, mask)
  np.testing.assert_array_equal(value, [2, 123, 0, 712])
  np.testing.assert_array_equal(found, [True, True, False, True])


def test_count_turns_rewards_each_turn():
  """The toy game: a right turn scores 1 + the stop bonus, the answer is BOS and the next
  digit, the episode ends on the last turn."""
  env = count_turns.CountTurns(max_turns=2, obs_tokens=3)
  state = env.reset(None, jnp.asarray([[1, 2 + 7]]), None)  # the run ends on 7
  action = jnp.asarray([[2 + 8, 2 + 9, 0, 0]])
  answer = env.step(state, action, jnp.asarray([[True, True, True, False]]), jnp.int32(0))
  assert float(answer.reward[0]) == pytest.approx(1.25)
  np.testing.assert_array_equal(answer.obs[0, 1:], [1, 2 + 0])
  assert not bool(answer.done[0]) and int(answer.state[0]) == 0
  assert bool(env.step(answer.state, action, action > 0, jnp.int32(1)).done[0])


def test_the_multi_turn_run_is_one_program_and_resumes_exactly(tmp_path):
  """configs/toy_turns.py through the run loop: the fused step (one compiled program for the
  whole multi-turn iteration), ``compile/count`` flat after the first iteration, the episode
  metrics, and a run stopped after its second iteration and resumed equal to one that was
  not."""
  config = build_lib.load_config(_TOY_TURNS, num_iterations=3, save_every=1, sample_every=0,
                                 log_every=1, rl__batch_size=16)
  run = build_lib.build(config)
  assert run.step.fused is not None
  whole, split = tmp_path / "whole", tmp_path / "split"
  runner.run(config, str(whole))
  runner.run(config, str(split), stop_after=2)
  runner.run(config, str(split))
  import json  # pylint: disable=import-outside-toplevel
  rows_a = [json.loads(x) for x in (whole / "metrics.jsonl").read_text().splitlines()]
  rows_b = [json.loads(x) for x in (split / "metrics.jsonl").read_text().splitlines()]
  counts = [r["compile/count"] for r in rows_a if "compile/count" in r]
  assert len(counts) == 3 and counts[1:] == [counts[0]] * 2
  for name in ("episode/turns", "episode/obs_share", "episode/truncated_turns", "reward"):
    assert name in rows_a[-1], name
  assert rows_a[-1]["episode/turns"] == pytest.approx(3.0)
  volatile = ("time/", "eps", "memory/", "compile/")
  drop = lambda rows: [{k: v for k, v in r.items() if not k.startswith(volatile)}  # noqa
                       for r in rows if "reward" in r]
  assert drop(rows_a) == drop(rows_b)


def test_sliding_window_models_are_refused(params):
  """A model with sliding-window layers: one error naming the windows and what to use."""
  windowed = CausalLM(TINY.replace(layer_windows=(0, 4)))
  prompts, mask = _prompts()
  config = SamplingConfig(6, stop_ids=(STOP,), pad_id=PAD)
  with pytest.raises(ValueError, match=r"sliding-window layers yet .*\[4\].*full attention"):
    generate_turns(windowed, params, prompts, mask, jax.random.key(0), config, Echo())


def _verl_style_gae(r, v, m, gamma, lam):
  """verl's multi-turn convention, transcribed to NumPy: a reverse loop over every column where
  an unmasked column (an observation) keeps the next value and the running advantage as they
  were ("skip values and TD-error on observation tokens")."""
  adv = np.zeros_like(r)
  next_v, running = np.zeros(r.shape[0]), np.zeros(r.shape[0])
  for t in reversed(range(r.shape[1])):
    delta = r[:, t] + gamma * next_v - v[:, t]
    candidate = delta + gamma * lam * running
    next_v = np.where(m[:, t], v[:, t], next_v)
    running = np.where(m[:, t], candidate, running)
    adv[:, t] = running
  return np.where(m, adv, 0.0)


@pytest.mark.parametrize("seed", [0, 1])
def test_gae_across_turns_agrees_with_verls_convention(seed):
  """verl's agent loop masks observation tokens out of ``response_mask`` and its GAE carries
  the next value and advantage across them: the same advantages as ppojax's."""
  rng = np.random.default_rng(seed + 10)
  m = rng.random((4, 23)) < 0.5
  r, v = rng.normal(size=(2, 4, 23))
  adv, _ = advantages.gae(jnp.asarray(r, jnp.float32), jnp.asarray(v, jnp.float32),
                          jnp.asarray(m), 0.95, 0.9)
  np.testing.assert_allclose(adv, _verl_style_gae(r, v, m, 0.95, 0.9), atol=1e-5)


def test_guess_number_answers_each_guess():
  """Higher, lower, right (reward 1 less the turns spent, the episode ends) and not a number (the
  request for one); the format reward for each guess in range."""
  from ppojax.envs import guess_number  # pylint: disable=import-outside-toplevel
  # token ids: 0 pad, 1 stop, 2 + d the digit d; answers: HIGHER, LOWER, CORRECT, INVALID
  table = env_tokens.DigitTable(value=(-1, -1) + tuple(range(10)), length=(0, 0) + (1,) * 10,
                                spaced=(False,) * 12)
  answers = ((0, 0, 30), (0, 0, 31), (0, 0, 32), (0, 33, 34))
  env = guess_number.GuessNumber(4, 3, 1, 10, table, answers, (1, 1, 1, 2), 0.1, 0.05)
  secret = jnp.asarray([7, 7, 7, 7])
  action = jnp.asarray([[2 + 3, 1], [2 + 9, 1], [2 + 7, 1], [1, 0]])  # 3, 9, 7, none
  out = env.step(secret, action, action > 0, jnp.int32(2))
  np.testing.assert_array_equal(out.obs[:, -1], [30, 31, 32, 34])
  np.testing.assert_array_equal(out.obs_mask.sum(1), [1, 1, 1, 2])
  np.testing.assert_array_equal(out.done, [False, False, True, False])
  np.testing.assert_allclose(out.reward, [0.05, 0.05, 1.0 - 0.2 + 0.05, 0.0], atol=1e-6)
  np.testing.assert_array_equal(out.info["invalid"], [False, False, False, True])
  secrets = env.reset(jax.random.key(0), jnp.zeros((64, 3), jnp.int32), None)
  assert 1 <= int(secrets.min()) and int(secrets.max()) <= 10


def test_digit_table_of_a_real_tokenizer(smollm2_path):
  """SmolLM2's tokenizer: single digits are tokens, a number is read across them."""
  from ppojax.models import load_model  # pylint: disable=import-outside-toplevel
  tok = load_model(smollm2_path).tokenizer
  table = env_tokens.digit_table(tok)
  ids = jnp.asarray([tok("I guess 137, then 5")["input_ids"]])
  value, found = env_tokens.first_number(table, ids, jnp.ones(ids.shape, bool))
  assert int(value[0]) == 137 and bool(found[0])
  assert sum(v >= 0 for v in table.value) >= 10


def test_multi_turn_works_with_lora_dynamic_sampling_and_packing(tmp_path):
  """The traced game with GRPO groups, dynamic sampling, packed updates and LoRA adapters in one
  run: finite metrics, the episodes' among them, the adapters saved."""
  config = build_lib.load_config(
      _TOY_TURNS, num_iterations=2, sample_every=0, log_every=1, algorithm="grpo",
      sampling__num_samples_per_prompt=4, rl__batch_size=4, rl__oversample=2.0,
      rl__dynamic_sampling=True, rl__pack_fractions=(0.5, 0.75), lora__rank=4)
  runner.run(config, str(tmp_path))
  import json  # pylint: disable=import-outside-toplevel
  rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  last = [r for r in rows if "reward" in r][-1]
  for name in ("reward", "loss/policy_avg", "episode/turns", "episode/obs_share",
               "rollout/rows_in_loss", "update/packed_avg"):
    assert name in last and np.isfinite(last[name]), name
  assert (tmp_path / "adapters").is_dir()
