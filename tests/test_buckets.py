"""Prompt lengths padded to a few buckets (``data.prompt_bucket``: ppojax/data/batch.py).

* ``bucket_length`` against a NumPy reference, and its properties: a multiple of the step or the
  maximum, never below the longest prompt that fits;
* ``repad`` keeps every row's real tokens where they were (at the end of the row);
* left padding plus masks: greedy tokens equal and log-probs close at two paddings;
* a run over prompts of varied lengths compiles one step program per bucket it uses, and its
  held-out evaluations ("before", the baselines, "after") one generate program in all.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from jax._src import monitoring

from ppojax.data import records as records_lib
from ppojax.data.batch import Prompts, bucket_length, real_width, repad, to_bucket
from ppojax.infra import sharding
from ppojax.models import CausalLM, LoadedModel, ModelConfig, init_params, save_model
from ppojax.models.passes import response_logprobs
from ppojax.rollout.sampling import SamplingConfig, generate
from ppojax.run import baselines, evaluation, held_out, runner
from ppojax.run import build as build_lib
from ppojax.run import checks as checks_lib
from ppojax.run import config as config_lib
from ppojax.run import models as run_models
from ppojax.tasks import sources

# ----------------------------------------------------------------------------- the rule


def _reference(longest, step, maximum):
  """bucket_length in NumPy, element-wise: ceil(longest / step)·step (at least one step),
  capped at the maximum; the maximum where step is 0."""
  longest, step, maximum = np.broadcast_arrays(longest, step, maximum)
  safe = np.where(step == 0, 1, step)
  up = np.maximum(np.ceil(longest / safe).astype(int), 1) * safe
  return np.where(step == 0, maximum, np.minimum(up, maximum))


def test_bucket_length_matches_a_numpy_reference_and_its_properties():
  longest, step, maximum = np.meshgrid(np.arange(0, 70), np.arange(0, 20), np.arange(1, 66),
                                       indexing="ij")
  got = np.vectorize(bucket_length)(longest, step, maximum)
  np.testing.assert_array_equal(got, _reference(longest, step, maximum))
  fits = longest <= maximum
  assert (got[fits] >= longest[fits]).all() and (got <= maximum).all()
  multiple = (step > 0) & (got % np.where(step == 0, 1, step) == 0)
  assert (multiple | (got == maximum)).all()
  smallest = (got - step < np.maximum(longest, 1)) | (got == maximum)  # no smaller bucket fits
  assert smallest[step > 0].all()
  assert [bucket_length(n, 64, 128) for n in (1, 63, 64, 65, 128, 300)] == [64] * 3 + [128] * 3
  assert bucket_length(5, 0, 128) == 128
  with pytest.raises(ValueError, match="step >= 0"):
    bucket_length(5, -1, 128)


# ----------------------------------------------------------------------------- re-padding


def _left_padded(lengths, width, pad=0, seed=0):
  mask = np.arange(width)[None] >= (width - np.asarray(lengths))[:, None]
  tokens = np.random.default_rng(seed).integers(3, 30, (len(lengths), width))
  return np.where(mask, tokens, pad).astype(np.int32), mask


def test_repad_keeps_every_rows_real_tokens_at_its_end():
  tokens, mask = _left_padded([1, 5, 3, 7], 12, pad=0)
  assert real_width(mask) == 7 and real_width(np.zeros((2, 4), bool)) == 0
  for length in (7, 9, 12, 20):
    t, m = repad(tokens, mask, length, pad_id=2)
    assert t.shape == m.shape == (4, length)
    for i in range(4):
      np.testing.assert_array_equal(t[i][m[i]], tokens[i][mask[i]])  # the same real tokens
      assert m[i, length - mask[i].sum():].all() and not m[i, :length - mask[i].sum()].any()
    if length > 12:
      assert (t[:, :length - 12] == 2).all()  # added columns hold the pad id
    back = repad(t, m, 12)
    np.testing.assert_array_equal(back[0], tokens)
    np.testing.assert_array_equal(back[1], mask)
  with pytest.raises(ValueError, match="would drop real tokens"):
    repad(tokens, mask, 6)


def test_to_bucket_cuts_only_padding_and_keeps_the_prefix():
  tokens, mask = _left_padded([2, 5, 4], 24)
  prefix = np.array([9], np.int32)
  out = to_bucket(Prompts(tokens, mask, prefix), 8, 24)
  assert out.tokens.shape == (3, 8) and out.prefix is prefix
  np.testing.assert_array_equal(out.tokens, tokens[:, 16:])
  assert to_bucket(Prompts(tokens, mask), 0, 24).tokens.shape == (3, 24)
  assert to_bucket(Prompts(tokens, mask), 16, 20).tokens.shape == (3, 16)
  assert to_bucket(Prompts(tokens, mask), 64, 24).tokens.shape == (3, 24)  # never wider


# ----------------------------------------------------------------------------- the numbers

TINY = ModelConfig(model_type="llama", vocab_size=32, hidden_size=32, intermediate_size=64,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                   max_position_embeddings=64, norm_eps=1e-5, tie_word_embeddings=False)


def test_greedy_tokens_and_logprobs_are_the_same_at_two_paddings():
  """The same prompts left-padded to 8 and to 24 columns: the same greedy tokens, and their
  log-probs (the sampler's and a full forward pass's) equal to float rounding."""
  module = CausalLM(TINY)
  params = init_params(module, jax.random.key(0))
  params = {**params, "lm_head": {"kernel": params["lm_head"]["kernel"] * 8.0}}
  tokens, mask = _left_padded([1, 8, 3, 6, 2, 5], 8, seed=1)
  config = SamplingConfig(8, stop_ids=(1,), pad_id=0, greedy=True)
  outs = []
  for width in (8, 24):
    t, m = map(jnp.asarray, repad(tokens, mask, width))
    gen = jax.device_get(generate(module, params, t, m, jax.random.key(0), config))
    logp = response_logprobs(module, params, t, m, jnp.asarray(gen.tokens),
                             jnp.asarray(gen.mask), 1.0)
    outs.append((gen, np.asarray(logp)))
  (a, logp_a), (b, logp_b) = outs
  assert len({tuple(row) for row in a.tokens}) > 1  # the prompts lead to different responses
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_array_equal(a.mask, b.mask)
  np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
  np.testing.assert_allclose(logp_a, logp_b, atol=1e-5)
  np.testing.assert_allclose(logp_a, a.logprobs, atol=1e-4)


# ----------------------------------------------------------------------------- a run

BASELINES = {"instructed": "Reply with just the number.", "terse": "Be brief."}


@pytest.fixture(scope="module")
def policy_dir(char_tokenizer, tmp_path_factory):
  cfg = run_models.tiny_model_config(ml_collections.ConfigDict({
      "vocab_size": len(char_tokenizer), "hidden_size": 32, "intermediate_size": 64,
      "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "max_position_embeddings": 64}))
  cfg = cfg.replace(bos_token_id=None, eos_token_id=1, pad_token_id=0)
  lm = LoadedModel(cfg, init_params(CausalLM(cfg), jax.random.key(3)), char_tokenizer, "lm")
  return save_model(tmp_path_factory.mktemp("tiny") / "policy", lm)


def _run_config(policy, tmp_path) -> ml_collections.ConfigDict:
  """A file task whose prompts render to 6 … 30 tokens ("u:TEXT\\na:"), at most 32, in buckets
  of 8; held-out prompts whose instructed forms are longer than 32."""
  train = [{"prompt": "x" * n, "answer": "1"} for n in (1, 2, 3, 12, 18, 25, 2, 4)]
  held = [{"prompt": f"count {i}", "answer": str(i)} for i in range(5)]
  c = config_lib.defaults()
  c.num_iterations, c.save_every, c.sample_every, c.seed = 4, 4, 0, 1
  c.model.policy = str(policy)
  c.data.update(task="file", path=str(tmp_path / "train.jsonl"),
                eval_path=str(tmp_path / "eval.jsonl"), max_prompt_len=32, prompt_bucket=8)
  records_lib.write_jsonl(train, c.data.path)
  records_lib.write_jsonl(held, c.data.eval_path)
  c.reward.update(kind="text", fn="text_reward_fn:reward")
  c.eval.update(batch_size=4)
  c.eval.metrics = ml_collections.ConfigDict({"length": "text_reward_fn:length"})
  c.eval.baselines = ml_collections.ConfigDict(BASELINES)
  c.sampling.update(max_new_tokens=4)
  c.rl.batch_size = 4
  return c


def test_the_option_is_checked(policy_dir, tmp_path):
  config = _run_config(policy_dir, tmp_path)
  config.data.prompt_bucket = -8
  with pytest.raises(checks_lib.ConfigError, match=r"data\.prompt_bucket=-8 must be an integer"):
    checks_lib.validate(config, num_devices=1)


def test_a_run_compiles_one_step_per_bucket_and_one_generate_program(policy_dir, tmp_path):
  """Batches of varied widths (buckets of 8) through the run's step: one rollout and one update
  program per width, nothing compiled for a width seen before; the held-out phases, the
  baselines' longer prompts included, share one padded length and one generate program."""
  r = build_lib.build(_run_config(policy_dir, tmp_path))
  batches = [r.source.batch(pos) for pos in range(4)]
  widths = [b.prompts.tokens.shape[1] for b in batches]
  assert len(set(widths)) > 1 and set(widths) <= {8, 16, 24, 32}, widths
  for b in batches:
    assert b.prompts.tokens.shape[1] == bucket_length(real_width(b.prompts.mask), 8, 32)
    np.testing.assert_array_equal(b.prompts.prefix, r.source.prefix)  # "u:" still shared
  compiles = []

  def on_event(name, *_, **__):
    if name == "/jax/core/compile/backend_compile_duration":
      compiles[-1] += 1

  state = r.state
  jax.monitoring.register_event_duration_secs_listener(on_event)
  try:
    for b in batches:
      compiles.append(0)
      prompts = sharding.place_prompts(b.prompts, r.mesh)
      state, metrics, _, _ = runner.iteration(r, state, prompts, b.records)
      assert np.isfinite(metrics["loss/policy_avg"])
  finally:
    monitoring.unregister_event_duration_listener(on_event)
  assert r.step.rollout._cache_size() == len(set(widths))  # pylint: disable=protected-access
  assert r.step.learn._cache_size() == len(set(widths))  # pylint: disable=protected-access
  seen = [w in widths[:i] for i, w in enumerate(widths)]
  assert [n for n, again in zip(compiles, seen) if again] == [0] * sum(seen), (widths, compiles)

  length = baselines.eval_length(r.config, r.policy.tokenizer, r.source.eval_records)
  assert length == len("u:count 4 Reply with just the number.\na:")  # the longest, > 32
  programs = evaluation._generate._cache_size()  # pylint: disable=protected-access
  phases = ["before", *(p for p, _ in baselines.phases(r.config)), "after"]
  for phase, instruction in zip(phases, [None, *BASELINES.values(), None]):
    summary = held_out.evaluate(r, state, phase, None, None, 0, say=lambda _: None,
                                instruction=instruction)
    assert 0 < summary["eval/length"] <= 4
  assert evaluation._generate._cache_size() == programs + 1  # pylint: disable=protected-access


def test_held_out_prompts_pad_to_their_bucket_without_baselines(policy_dir, char_tokenizer,
                                                                tmp_path):
  """Without baselines the held-out length is the bucket of the longest held-out prompt (as
  cut to data.max_prompt_len); a prompt longer than that is cut as in training."""
  config = _run_config(policy_dir, tmp_path)
  config.eval.baselines = ml_collections.ConfigDict()
  held = [{"prompt": "count"}, {"prompt": "count 22"}]  # 10 and 13 tokens ("u:…\na:")
  assert baselines.eval_length(config, char_tokenizer, held) == 16
  config.data.prompt_bucket = 0
  assert baselines.eval_length(config, char_tokenizer, held) == 32
  config.data.update(prompt_bucket=8, max_prompt_len=10)
  assert baselines.eval_length(config, char_tokenizer, held) == 10
  encode = sources.padded(sources.prompt_encoder(config, char_tokenizer), 10, 0)
  enc = encode(held)
  assert enc.tokens.shape == (2, 10) and enc.truncated.tolist() == [False, True]
