"""Text tasks: ppojax.tasks.sources (where prompts come from, trl-style text rewards), ppojax.run.evaluation
(greedy held-out evaluation) and a text task run end to end by ppojax.run.runner.

A character-level tokenizer (conftest ``char_tokenizer``) and a tiny random transformer keep it
fast: batches must be pure functions of the data position (resume safety), file batches must
cover the records, truncated prompts are counted, every held-out record is scored exactly once.
"""

from __future__ import annotations

import json

import chex
import jax
import ml_collections
import numpy as np
import pytest
import text_reward_fn

from ppojax.data import encoding
from ppojax.data import records as records_lib
from ppojax.data.encoding import template_prefix
from ppojax.data.records import DataError
from ppojax.models import CausalLM, LoadedModel, init_params, save_model
from ppojax.rollout.sampling import SamplingConfig
from ppojax.run import build as build_lib
from ppojax.run import evaluation, reporting, runner
from ppojax.run import models as run_models
from ppojax.run.config import defaults
from ppojax.tasks import arith, sources

TINY = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
            max_position_embeddings=64)
STOP, PAD = 1, 0  # the character tokenizer's </s> and <pad>


def _config(**changes) -> ml_collections.ConfigDict:
  """``defaults()`` with ``section__field=value`` changes."""
  c = defaults()
  c.rl.batch_size = 4
  for name, value in changes.items():
    *sections, field = name.split("__")
    node = c
    for s in sections:
      node = node[s]
    assert field in node, name
    node[field] = value
  return c


def _write(path, records):
  records_lib.write_jsonl(records, path)
  return str(path)


def _same(a: sources.Batch, b: sources.Batch) -> bool:
  return (np.array_equal(a.prompts.tokens, b.prompts.tokens)
          and np.array_equal(a.prompts.mask, b.prompts.mask) and a.records == b.records
          and a.truncated == b.truncated)


def _text(tok, batch: sources.Batch, i: int) -> str:
  return sources.decode_text(tok, batch.prompts.tokens[i], batch.prompts.mask[i])


# ----------------------------------------------------------------------------- make_source


def test_count_batches_are_a_pure_function_of_the_position():
  config = _config(data__task="count", data__prompt_len=6)
  source, again = sources.make_source(config, None), sources.make_source(config, None)
  b3 = source.batch(3)
  assert b3.records is None and b3.truncated == 0 and b3.prompts.tokens.shape == (4, 6)
  assert _same(b3, again.batch(3)) and _same(b3, source.batch(3))
  assert not _same(b3, source.batch(4))
  assert source.eval_records is None and source.encode is None


def test_arith_batches_are_pure_and_rendered_through_the_chat_template(char_tokenizer):
  config = _config(data__task="arith", data__max_prompt_len=24, data__eval_per_digits=3)
  source = sources.make_source(config, char_tokenizer)
  b = source.batch(5)
  assert _same(b, sources.make_source(config, char_tokenizer).batch(5))  # as after a resume
  assert not _same(b, source.batch(6))
  assert b.records == arith.problems((config.seed, 5), 4, "train")
  assert [_text(char_tokenizer, b, i) for i in range(4)] == [
      f"u:{r['prompt']}\na:" for r in b.records]
  assert b.prompts.tokens.shape == (4, 24) and b.truncated == 0
  assert source.eval_records == arith.eval_problems(3)
  no_eval = sources.make_source(_config(data__task="arith", data__eval_per_digits=0),
                                char_tokenizer)
  assert no_eval.eval_records is None


def test_file_batches_cover_the_records_and_are_pure(char_tokenizer, tmp_path):
  records = [{"question": f"q{i}", "answer": str(i)} for i in range(8)]
  evals = [{"question": "e0", "answer": "0"}]
  config = _config(data__task="file", data__path=_write(tmp_path / "train.jsonl", records),
                   data__eval_path=_write(tmp_path / "eval.jsonl", evals),
                   data__field="question", data__chat_template=False, data__max_prompt_len=5)
  source = sources.make_source(config, char_tokenizer)
  epoch = [r for pos in (0, 1) for r in source.batch(pos).records]  # 8 records, batches of 4
  assert sorted(epoch, key=lambda r: int(r["answer"])) == records  # each exactly once
  for pos in (0, 1, 2, 7):
    b = source.batch(pos)
    assert _same(b, sources.make_source(config, char_tokenizer).batch(pos))
    assert [_text(char_tokenizer, b, i) for i in range(4)] == [r["question"] for r in b.records]
  assert source.eval_records == evals
  enc = source.encode(evals)
  assert sources.decode_text(char_tokenizer, enc.tokens[0], enc.mask[0]) == "e0"


def test_too_long_prompts_are_cut_from_the_left_and_counted(char_tokenizer, tmp_path):
  records = [{"prompt": "ab"}, {"prompt": "abcdefgh"}, {"prompt": "x"}, {"prompt": "0123456"}]
  path = _write(tmp_path / "p.jsonl", records)
  config = _config(data__task="file", data__path=path, data__chat_template=False,
                   data__max_prompt_len=5)
  b = sources.make_source(config, char_tokenizer).batch(0)  # batch 4 = all four records
  assert b.truncated == 2
  assert sorted(_text(char_tokenizer, b, i) for i in range(4)) == ["23456", "ab", "defgh", "x"]
  config.data.truncate = "error"
  with pytest.raises(DataError, match="more than the limit of 5"):
    sources.make_source(config, char_tokenizer).batch(0)


def test_prompts_carry_the_chat_templates_header_as_shared_prefix(char_tokenizer, tmp_path):
  """data.shared_prefix: the tokens every rendered prompt begins with (``template_prefix``) ride
  along as Prompts.prefix; a batch whose rows do not all begin with them (a prompt cut from the
  left) runs whole, and data.shared_prefix=False turns it off."""
  ids = lambda text: char_tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
  assert template_prefix(char_tokenizer) == ids("u:")
  assert template_prefix(char_tokenizer, system="Be brief.") == ids("s:Be brief.\nu:")
  assert template_prefix(char_tokenizer, chat_template=False) == []  # no BOS, no header
  config = _config(data__task="arith", data__max_prompt_len=40, data__system="Be brief.")
  source = sources.make_source(config, char_tokenizer)
  b = source.batch(0)
  assert source.prefix == ids("s:Be brief.\nu:")
  np.testing.assert_array_equal(b.prompts.prefix, source.prefix)
  config.data.shared_prefix = False
  off = sources.make_source(config, char_tokenizer)
  assert off.prefix is None and off.batch(0).prompts.prefix is None and _same(b, off.batch(0))
  records = [{"prompt": "ab"}, {"prompt": "abcdefgh"}, {"prompt": "x"}, {"prompt": "012"}]
  config = _config(data__task="file", data__path=_write(tmp_path / "p.jsonl", records),
                   data__max_prompt_len=8)
  cut = sources.make_source(config, char_tokenizer).batch(0)
  assert cut.truncated == 1 and cut.prompts.prefix is None  # "u:abcdefgh\na:" lost its "u:"


def test_a_file_without_the_prompt_field_names_it(char_tokenizer, tmp_path):
  path = _write(tmp_path / "p.jsonl", [{"text": "hello"}])
  config = _config(data__task="file", data__path=path)
  with pytest.raises(DataError, match=r"p\.jsonl:1: record has no field 'prompt' "
                                      r"\(fields: 'text'\)"):
    sources.make_source(config, char_tokenizer)
  config.data.eval_path = _write(tmp_path / "e.jsonl", [{"question": "x"}])
  config.data.field = "text"
  with pytest.raises(DataError, match=r"e\.jsonl:1: record has no field 'text'"):
    sources.make_source(config, char_tokenizer)


def test_unknown_task_and_missing_tokenizer():
  with pytest.raises(ValueError, match="data.task='nope' is not known"):
    sources.make_source(_config(data__task="nope"), None)
  with pytest.raises(ValueError, match="needs a tokenizer"):
    sources.make_source(_config(data__task="arith", model__policy="tiny"), None)


# ----------------------------------------------------------------------------- text_reward


def _responses(tok, texts: list[str], length: int = 8):
  """Right-padded response tokens ending in the stop token, and their mask."""
  enc = encoding.right_pad([encoding.response_ids(tok, t, STOP) for t in texts], length, PAD)
  return enc.tokens, enc.mask


def test_text_reward_passes_prompts_completions_and_columns(char_tokenizer):
  seen = {}

  def fn(prompts, completions, **columns):
    seen.update(prompts=prompts, completions=completions, columns=columns)
    return [float(c == a) for c, a in zip(completions, columns["answer"])]

  records = [{"q": "What is 1 + 1?", "answer": "2", "digits": 1},
             {"q": "What is 2 + 2?", "answer": "5", "digits": 1}]
  tokens, mask = _responses(char_tokenizer, ["2", "4"])
  scores = sources.text_reward(fn, char_tokenizer, field="q")(tokens, mask, records)
  assert scores.dtype == np.float32 and scores.tolist() == [1.0, 0.0]
  assert seen == {"prompts": ["What is 1 + 1?", "What is 2 + 2?"], "completions": ["2", "4"],
                  "columns": {"answer": ["2", "5"], "digits": [1, 1]}}
  arith_scores = sources.text_reward(arith.reward, char_tokenizer, "q")(tokens, mask, records)
  assert arith_scores.tolist() == pytest.approx([1 + arith.FORMAT_BONUS, arith.FORMAT_BONUS])


@pytest.mark.parametrize("returned", [[1.0], [1.0, 2.0, 3.0], 1.0, [[1.0, 2.0]]])
def test_text_reward_with_the_wrong_number_of_scores_says_so(char_tokenizer, returned):
  def bad_reward(prompts, completions, **_):
    return returned

  tokens, mask = _responses(char_tokenizer, ["1", "2"])
  score = sources.text_reward(bad_reward, char_tokenizer)
  with pytest.raises(ValueError, match=r"bad_reward returned shape .* for 2 completions; "
                                       r"return one float"):
    score(tokens, mask, [{"prompt": "a"}, {"prompt": "b"}])


# ----------------------------------------------------------------------------- evaluation


@pytest.fixture(scope="module")
def tiny_lm(char_tokenizer):
  cfg = run_models.tiny_model_config(ml_collections.ConfigDict(
      dict(TINY, vocab_size=len(char_tokenizer))))
  cfg = cfg.replace(bos_token_id=None, eos_token_id=STOP, pad_token_id=PAD)
  return LoadedModel(cfg, init_params(CausalLM(cfg), jax.random.key(3)),
                     char_tokenizer, "lm")


def _eval_records(n: int) -> list[dict]:
  return [{"prompt": f"count from {i}", "idx": i, "group": "ab"[i % 2]} for i in range(n)]


def _encode(tok):
  # raw text: the prompts end on different characters, so a random model's greedy completions
  # differ (through the chat template they would all end on "a:")
  return lambda records: encoding.encode_prompts(tok, records, 16, chat_template=False)


SAMPLING = SamplingConfig(max_new_tokens=5, stop_ids=(STOP,), pad_id=PAD, temperature=0.7,
                          top_k=5, top_p=0.9, min_p=0.05)


def test_greedy_keeps_stops_and_lengths_and_drops_truncation():
  g = evaluation.greedy(SAMPLING)
  assert g.greedy and (g.top_k, g.top_p, g.min_p) == (0, 1.0, 0.0) and not g.truncates
  assert (g.stop_ids, g.pad_id, g.max_new_tokens, g.temperature) == ((STOP,), PAD, 5, 0.7)
  assert evaluation.greedy(SAMPLING, 3).max_new_tokens == 3


@pytest.fixture(scope="module")
def evaluated(tiny_lm):
  """``evaluate`` of 5 records in batches of 2 (the last one filled up with a copy), with a
  metric that records what it was given: (summary, rows, the metric's calls)."""
  calls = []

  def idx(prompts, completions, **columns):
    calls.append((list(prompts), list(completions), columns))
    return [float(i) for i in columns["idx"]]

  tok = tiny_lm.tokenizer
  summary, rows = evaluation.evaluate(
      tiny_lm.module, tiny_lm.params, _eval_records(5), _encode(tok),
      evaluation.greedy(SAMPLING), tok, {"idx": idx, "len": text_reward_fn.length},
      batch_size=2, group_by="group")
  return summary, rows, calls


def test_every_record_is_evaluated_once_and_grouped(evaluated, tiny_lm):
  summary, rows, calls = evaluated
  records = _eval_records(5)
  assert len(calls) == 1
  prompts, texts, columns = calls[0]
  assert prompts == [r["prompt"] for r in records] and len(texts) == 5
  assert columns == {"idx": [0, 1, 2, 3, 4], "group": ["a", "b", "a", "b", "a"]}
  lengths = [len(t) for t in texts]
  assert summary == pytest.approx({
      "eval/idx": 2.0, "eval/len": np.mean(lengths),
      "eval/idx/group=a": 2.0, "eval/len/group=a": np.mean(lengths[0::2]),
      "eval/idx/group=b": 2.0, "eval/len/group=b": np.mean(lengths[1::2])})
  assert rows == [{"prompt": r["prompt"], "completion": t, "idx": float(r["idx"]),
                   "len": float(len(t))} for r, t in zip(records, texts)]
  with pytest.raises(ValueError, match="no held-out records"):
    evaluation.evaluate(tiny_lm.module, tiny_lm.params, [], _encode(tiny_lm.tokenizer),
                        SAMPLING, tiny_lm.tokenizer, {}, 2)


def test_greedy_completions_are_deterministic(evaluated, tiny_lm):
  texts = [row["completion"] for row in evaluated[1]]
  assert len(set(texts)) > 1 and all(len(t) <= 5 for t in texts)
  run = lambda sampling, batch: evaluation.completions(  # noqa: E731
      tiny_lm.module, tiny_lm.params, _eval_records(5), _encode(tiny_lm.tokenizer), sampling,
      tiny_lm.tokenizer, batch)
  hot = evaluation.greedy(SamplingConfig(5, (STOP,), PAD, temperature=1.7, top_k=2))
  # again, in one batch of 5 instead of 2 + 2 + 1, at another temperature: the same argmax
  assert run(hot, 5) == texts


def test_a_remat_model_samples_like_the_plain_one(evaluated, tiny_lm):
  texts = evaluation.completions(
      CausalLM(tiny_lm.cfg.replace(remat=True)), tiny_lm.params, _eval_records(5),
      _encode(tiny_lm.tokenizer), evaluation.greedy(SAMPLING), tiny_lm.tokenizer, 5)
  assert texts == [row["completion"] for row in evaluated[1]]


# ----------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def policy_dir(tiny_lm, tmp_path_factory):
  """The tiny model and the character tokenizer as a Hugging Face directory."""
  return save_model(tmp_path_factory.mktemp("tiny") / "policy", tiny_lm)


def _text_task_config(policy, tmp_path) -> ml_collections.ConfigDict:
  train = arith.problems(0, 6, digits=(1,)) + arith.problems(1, 2, digits=(2,))
  return _config(
      num_iterations=2, save_every=2, sample_every=0, model__policy=str(policy),
      data__task="file", data__path=_write(tmp_path / "train.jsonl", train),
      data__eval_path=_write(tmp_path / "eval.jsonl", arith.eval_problems(2)),  # 4 records
      data__max_prompt_len=20,  # "u:What is 2 + 3?\na:" is 19 characters: 2-digit ones are cut
      reward__kind="text", reward__fn="text_reward_fn:reward",
      eval__metrics=ml_collections.ConfigDict(
          {"accuracy": "ppojax.tasks.arith:accuracy", "length": "text_reward_fn:length"}),
      eval__batch_size=3, eval__group_by="digits",  # 4 held-out records: batches of 3 + 1
      sampling__max_new_tokens=4, sampling__stop_ids=[STOP], sampling__pad_id=PAD,
      optim__actor__lr=1e-3, optim__critic__lr=1e-3)


def test_a_text_task_runs_end_to_end(policy_dir, char_tokenizer, tmp_path, capsys):
  config = _text_task_config(policy_dir, tmp_path)
  build_lib.validate(config)
  text_reward_fn.CALLS.clear()
  result = runner.run(config, str(tmp_path / "run"))
  assert set(result.evals) == {"before", "after"}
  names = {"eval/accuracy", "eval/length", "eval/accuracy/digits=1", "eval/accuracy/digits=2",
           "eval/length/digits=1", "eval/length/digits=2"}
  assert set(result.evals["before"]) == set(result.evals["after"]) == names
  work = tmp_path / "run"
  assert json.loads((work / "eval.json").read_text()) == result.evals
  for phase in ("before", "after"):
    rows = [json.loads(line) for line in open(work / f"eval_samples_{phase}.jsonl")]
    assert [r["prompt"] for r in rows] == [p["prompt"] for p in arith.eval_problems(2)]
  source = sources.make_source(config, char_tokenizer)
  expected = [source.batch(pos).truncated for pos in (0, 1)]
  assert sum(expected) > 0
  logged = reporting.read_metrics(str(work / "metrics.jsonl"))
  assert [r["data/truncated_prompts"] for r in logged if "data/truncated_prompts" in r] == expected
  assert [r["data/truncated_prompts"] for r in result.history] == expected
  assert len(text_reward_fn.CALLS) == 2  # one reward call per iteration, with its columns
  for pos, call in enumerate(text_reward_fn.CALLS):
    batch = source.batch(pos).records
    assert call["prompts"] == [r["prompt"] for r in batch]
    assert call["answer"] == [r["answer"] for r in batch]
    assert call["columns"] == ["a", "b", "digits", "op"] and len(call["completions"]) == 4
  assert (work / "policy" / "tokenizer.json").exists()
  assert "held-out eval after (4 prompts" in capsys.readouterr().out


def test_eval_every_evaluates_between_iterations_across_a_resume(policy_dir, tmp_path):
  """``eval.every = 2`` of 4 iterations: held-out rows at 0, 2 and 4, each once, in eval.json
  as "before", "iteration_2", "after"; a run stopped at 2 and resumed gives the same ones, and
  ``time/train_s`` (the iterations' seconds) goes on from the checkpoint."""
  config = _text_task_config(policy_dir, tmp_path)
  config.num_iterations, config.eval.every = 4, 2
  whole = runner.run(config, str(tmp_path / "whole"))
  assert list(whole.evals) == ["before", "iteration_2", "after"]
  runner.run(config, str(tmp_path / "parts"), stop_after=2)
  resumed = runner.run(config, str(tmp_path / "parts"))
  for name in ("whole", "parts"):
    rows = reporting.read_metrics(str(tmp_path / name / "metrics.jsonl"))
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 2, 4], name
    train_s = [r["time/train_s"] for r in rows if "time/train_s" in r]
    assert len(train_s) == 4 and all(b > a > 0 for a, b in zip(train_s, train_s[1:])), train_s
    assert all(r["memory/peak_rss_mb"] > 0 for r in rows if "time/train_s" in r)
  evals = json.loads((tmp_path / "parts" / "eval.json").read_text())
  assert evals == {**resumed.evals, "before": evals["before"]}
  for phase in ("before", "iteration_2", "after"):
    assert evals[phase] == pytest.approx(whole.evals[phase], abs=1e-6), phase
  assert (tmp_path / "parts" / "eval_samples_iteration_2.jsonl").exists()


def test_a_finished_run_extended_evaluates_after_again(policy_dir, tmp_path):
  """2 iterations, then ``num_iterations = 3`` in the same workdir: the held-out "after" is
  taken again at 3 (eval.json's and the printed one), not left at the first run's 2."""
  config = _text_task_config(policy_dir, tmp_path)
  config.num_iterations = 2
  first = runner.run(config, str(tmp_path / "run"))
  config.num_iterations = 3
  extended = runner.run(config, str(tmp_path / "run"))
  rows = reporting.read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
  evaluated = {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}
  assert sorted(evaluated) == [0, 2, 3]
  assert first.evals["after"]["eval/accuracy"] == pytest.approx(evaluated[2])
  assert extended.evals["after"]["eval/accuracy"] == pytest.approx(evaluated[3])
  evals = json.loads((tmp_path / "run" / "eval.json").read_text())
  assert evals["after"] == pytest.approx(extended.evals["after"])
  finished = runner.run(config, str(tmp_path / "run"))  # nothing left to train: no new eval
  rows = reporting.read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
  assert sorted(r["step"] for r in rows if "eval/accuracy" in r) == [0, 2, 3]
  assert finished.evals["after"] == extended.evals["after"]


def test_tiny_policy_takes_a_tokenizer_for_text_tasks(policy_dir, char_tokenizer, tmp_path):
  config = _text_task_config(policy_dir, tmp_path)
  config.model.policy = "tiny"
  config.model.tiny.update(TINY)
  config.model.tokenizer = str(policy_dir)  # a new field, as in configs/sft_arith.py
  policy = run_models.load_policy(config, jax.random.key(0))
  assert policy.tokenizer is not None
  assert policy.cfg.vocab_size == len(char_tokenizer)
  assert policy.cfg.eos_token_id == char_tokenizer.eos_token_id


def test_a_reward_model_loads_without_the_tokenizer_the_run_never_uses(policy_dir):
  """``load_model(with_tokenizer=False)`` (the run's reward model): the same weights, no
  tokenizer read (transformers' AutoTokenizer would import PyTorch where it is installed)."""
  from ppojax.models import load_model  # pylint: disable=import-outside-toplevel
  full = load_model(policy_dir, head="value")
  bare = load_model(policy_dir, head="value", with_tokenizer=False)
  assert full.tokenizer is not None and bare.tokenizer is None
  chex.assert_trees_all_equal(full.params, bare.params)
