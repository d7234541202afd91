"""Preference pairs from a policy's own mistakes (ppojax.supervised.preferences) and the reward model's
held-out accuracy per source and per epoch (ppojax.supervised.train_rm, ppojax.supervised.common)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppojax.data import records as records_lib
from ppojax.run import build as build_lib
from ppojax.run import held_out, reporting
from ppojax.run import models as run_models
from ppojax.supervised import preferences, train_rm
from ppojax.tasks import arith
from tests.test_supervised import _config, preference_records, tokenizer_dir  # noqa: F401

ROOT = pathlib.Path(__file__).parents[1]


def test_with_answer_replaces_the_last_number_only():
  assert preferences.with_answer("23 + 45 = 67", "68") == "23 + 45 = 68"
  assert preferences.with_answer("The answer is 67.", "68") == "The answer is 68."
  assert preferences.with_answer("7 - 3 is 5, I think", "4") == "7 - 3 is 4, I think"
  assert preferences.with_answer("about 1,234 apples", "9") == "about 9 apples"
  assert preferences.with_answer("I cannot tell.", "4") is None


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(arith.RESPONSES), st.integers(0, 99), st.integers(0, 99),
       st.sampled_from("+-"), st.integers(0, 198), st.integers(0, 198))
def test_with_answer_makes_a_wrong_response_right_and_changes_nothing_else(
    template, a, b, op, wrong, right):
  text = template.format(a=a, op=op, b=b, c=wrong)
  fixed = preferences.with_answer(text, str(right))
  assert arith.final_number(fixed) == right
  assert fixed.removesuffix(".").rsplit(str(right), 1)[0] == \
      text.removesuffix(".").rsplit(str(wrong), 1)[0]


def test_pairs_come_from_distinct_wrong_samples_and_differ_only_in_the_answer():
  records = [{"prompt": "What is 2 + 3?", "answer": "5"},
             {"prompt": "What is 4 + 4?", "answer": "8"},
             {"prompt": "What is 9 - 1?", "answer": "8"}]
  samples = [["2 + 3 = 6", "The answer is 5.", "2 + 3 = 6", "I do not know", "2 + 3 = 1"],
             ["8", "4 + 4 = 8"],  # all right: no pair
             ["no idea"]]  # wrong without a number and nothing right to pair it with: dropped
  pairs = preferences.pairs_from_samples(records, samples, preferences.arith_correct)
  assert [(p["chosen"], p["rejected"]) for p in pairs] == [
      ("2 + 3 = 5", "2 + 3 = 6"), ("The answer is 5.", "I do not know"), ("2 + 3 = 5", "2 + 3 = 1")]
  assert all(p["source"] == "policy" and p["prompt"] == records[0]["prompt"] for p in pairs)
  with pytest.raises(ValueError, match="3 records but 2 lists"):
    preferences.pairs_from_samples(records, samples[:2], preferences.arith_correct)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.one_of(st.integers(0, 30).map(str),
                                   st.integers(0, 30).map("x = {}".format),
                                   st.just("hmm")), max_size=5), min_size=1, max_size=6))
def test_every_pair_ranks_a_right_response_above_a_wrong_one(samples):
  records = [{"prompt": f"p{i}", "answer": str(i)} for i in range(len(samples))]
  pairs = preferences.pairs_from_samples(records, samples, preferences.arith_correct)
  for p in pairs:
    assert preferences.arith_correct(p["chosen"], p["answer"])
    assert not preferences.arith_correct(p["rejected"], p["answer"])
  wrong = {(r["prompt"], s) for r, group in zip(records, samples) for s in group
           if not preferences.arith_correct(s, r["answer"])}
  assert len(pairs) == len({(p["prompt"], p["rejected"]) for p in pairs}) <= len(wrong)


def _with_sources(seed: int, n: int) -> list[dict]:
  return [dict(r, source=("synthetic", "policy")[i % 2])
          for i, r in enumerate(preference_records(seed, n))]


def test_reward_model_reports_held_out_accuracy_per_source_and_every_epoch(
    tokenizer_dir, tmp_path, capsys):  # noqa: F811
  config = _config("rm_arith.py", tokenizer_dir, tmp_path, _with_sources, n_train=32,
                   train__num_epochs=2.0, train__eval_every=-1)
  result = train_rm.run(config, tmp_path / "run")
  printed = capsys.readouterr().out
  assert "held-out (21 rows) at step 2 (epoch 1.00): accuracy" in printed
  assert "accuracy/policy" in printed and "after training" in printed
  rows = [r for r in reporting.read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
          if "eval/accuracy" in r]
  assert [r["step"] for r in rows] == [0, 2, 4]  # before, and after each epoch of 2 steps
  for r in rows:  # 21 held-out pairs: 11 synthetic, 10 policy
    mean = (11 * r["eval/accuracy/synthetic"] + 10 * r["eval/accuracy/policy"]) / 21
    assert r["eval/accuracy"] == pytest.approx(mean)
  assert result.after["eval/accuracy"] == rows[-1]["eval/accuracy"]


def test_only_the_sources_present_in_the_held_out_pairs_are_reported(
    tokenizer_dir, tmp_path):  # noqa: F811
  def policy_only(seed, n):
    return [dict(r, source="policy") for r in preference_records(seed, n)]
  config = _config("rm_arith.py", tokenizer_dir, tmp_path, policy_only, n_train=16)
  result = train_rm.run(config)
  assert result.after["eval/accuracy/policy"] == result.after["eval/accuracy"]
  assert "eval/accuracy/synthetic" not in result.after


def test_unknown_pair_sources_and_eval_every_are_refused(tokenizer_dir, tmp_path):  # noqa: F811
  bad = lambda seed, n: [dict(r, source="human") for r in preference_records(seed, n)]  # noqa
  config = _config("rm_arith.py", tokenizer_dir, tmp_path, bad)
  with pytest.raises(records_lib.DataError, match=r"source \['human'\].*synthetic"):
    train_rm.run(config)
  config = _config("rm_arith.py", tokenizer_dir, tmp_path, preference_records,
                   train__eval_every=-2)
  with pytest.raises(ValueError, match="train.eval_every=-2"):
    train_rm.run(config)


def _tiny_policy_config(tokenizer_dir):  # noqa: F811
  return build_lib.load_config(ROOT / "configs" / "rlhf_arith.py", model__policy="tiny",
                            model__tokenizer=str(tokenizer_dir), sampling__max_new_tokens=6)


def test_make_pairs_samples_the_policy_and_mixes_in_synthetic_pairs(tokenizer_dir):  # noqa: F811
  config = _tiny_policy_config(tokenizer_dir)
  samples = preferences.sample_responses(config, arith.problems(0, 5), 3, 1.0, seed=0,
                                         batch_size=4)
  assert len(samples) == 5 and all(len(s) == 3 for s in samples)
  assert len({s for group in samples for s in group}) > 5  # sampled, not greedy
  again = preferences.sample_responses(config, arith.problems(0, 5), 3, 1.0, seed=0, batch_size=4)
  assert again == samples  # a pure function of the seed
  pairs, stats = preferences.make_pairs(config, 8, "train", 2, 1.0, synthetic=6, seed=0)
  assert stats["samples"] == 16 and stats["synthetic_pairs"] == 6
  assert len(pairs) == stats["policy_pairs"] + 6
  assert sorted({p["source"] for p in pairs}) <= ["policy", "synthetic"]
  for p in pairs:
    assert preferences.arith_correct(p["chosen"], p["answer"])
    assert not preferences.arith_correct(p["rejected"], p["answer"])


def test_cli_writes_pairs_that_train_rm_reads(tokenizer_dir, tmp_path):  # noqa: F811
  out = tmp_path / "pairs.jsonl"
  subprocess.run([sys.executable, "-m", "ppojax.preferences", "--config",
                  str(ROOT / "configs" / "rlhf_arith.py"), "--config.model.policy=tiny",
                  f"--config.model.tokenizer={tokenizer_dir}",
                  "--config.sampling.max_new_tokens=4", f"--out={out}", "--n=4", "--samples=2",
                  "--synthetic=5"], cwd=ROOT, check=True, capture_output=True, text=True)
  records = records_lib.read_records(str(out), required=train_rm.FIELDS)
  assert len(records) >= 5 and {"answer", "source"} <= set(records[0])
  assert train_rm.source_ids(records).dtype == np.int32
  assert json.loads(out.read_text().splitlines()[0])["prompt"].startswith("What is")


def test_rlhf_held_out_evaluation_reports_the_reward_models_score(  # noqa: F811
    tokenizer_dir, tmp_path):
  """With a learned reward (reward.kind = "model") every held-out evaluation scores its greedy
  completions with the reward model too (eval/reward_model: the proxy beside the true
  accuracy), from the generated tokens as the rollout does; each score is the reward model's
  output at the last token of the unpadded prompt + completion, computed here row by row. A
  reward model whose vocabulary is smaller than the policy's is refused."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from ppojax.models import LoadedModel, ValueModel, positions_from_mask, save_model
  from ppojax.run import evaluation  # pylint: disable=import-outside-toplevel

  def config(reward_vocab: int):
    cfg = run_models.tiny_model_config(_tiny_policy_config(tokenizer_dir).model.tiny).replace(
        vocab_size=reward_vocab)
    tokens = jnp.zeros((1, 2), jnp.int32)
    params = ValueModel(cfg).init(jax.random.key(3), tokens, positions_from_mask(tokens >= 0),
                                  tokens >= 0)["params"]
    save_model(tmp_path / "rm", LoadedModel(cfg, jax.device_get(params), None, "value"))
    return build_lib.load_config(
        ROOT / "configs" / "rlhf_arith.py", model__policy="tiny",
        model__tokenizer=str(tokenizer_dir), model__reward=str(tmp_path / "rm"),
        sampling__max_new_tokens=6, data__eval_per_digits=2, eval__batch_size=3)

  vocab = len(run_models.load_tokenizer(str(tokenizer_dir)))
  with pytest.raises(ValueError, match=f"vocabulary of {vocab - 1} tokens.*same tokenizer"):
    build_lib.build(config(vocab - 1))  # a smaller vocabulary would read past its embedding
  r = build_lib.build(config(vocab))
  summary = held_out.evaluate(r, r.state, "before", tmp_path, None, 0, say=lambda *_: None)
  rows = [json.loads(line) for line in open(tmp_path / "eval_samples_before.jsonl")]
  assert len(rows) == 4  # two batches of 3, the last one filled up and its extras dropped
  assert summary["eval/reward_model"] == pytest.approx(np.mean([x["reward_model"] for x in rows]))
  assert {"eval/accuracy", "eval/score", "eval/reward_model/digits=2"} <= set(summary)

  seen = []  # the scorer's inputs and outputs, batch by batch
  scorer = evaluation.reward_model_scorer(r.models.reward, r.frozen.reward)
  spy = lambda *rows: seen.append((*rows, scorer(*rows))) or seen[-1][-1]  # noqa: E731
  texts, scores = evaluation.completions(
      *held_out.policy_model(r, r.state), r.source.eval_records, r.source.encode,
      evaluation.greedy(r.sampling), r.policy.tokenizer, 3, scorer=spy)
  assert texts == [x["completion"] for x in rows]
  # two compiled programs: each its own rounding
  np.testing.assert_allclose(scores, [x["reward_model"] for x in rows], rtol=1e-5, atol=1e-6)
  assert len(seen) == 2 and len(set(np.round(scores, 6))) > 1
  for prompts, prompt_mask, responses, response_mask, got in seen:
    for i in range(3):
      ids = np.concatenate([np.asarray(prompts[i])[np.asarray(prompt_mask[i], bool)],
                            np.asarray(responses[i])[np.asarray(response_mask[i], bool)]])
      t = jnp.asarray(ids[None], jnp.int32)
      m = jnp.ones_like(t, bool)
      out, _ = r.models.reward.apply({"params": r.frozen.reward}, t, positions_from_mask(m), m)
      assert float(got[i]) == pytest.approx(float(out[0, -1]), rel=1e-4, abs=1e-5)
