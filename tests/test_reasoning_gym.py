"""reasoning-gym as a task source (ppojax/tasks/reasoning.py, ``data.task="reasoning_gym"``): batches
are pure functions of (seed, position), held-out questions never reach training, the reward is
the dataset's own ``score_answer`` of the extracted answer, bad options fail validation with a
clear message, and configs/rg_*.py validate and run one iteration on a tiny model."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import jax
import ml_collections
import pytest
from conftest import skip_unless_found

from ppojax.models import CausalLM, LoadedModel, init_params, save_model
from ppojax.run import build as build_lib
from ppojax.run import checks as checks_lib
from ppojax.run import config as config_lib
from ppojax.run import models as run_models
from ppojax.run import runner
from ppojax.tasks import reasoning, sources

skip_unless_found("reasoning_gym", "pip install -e '.[reasoning]'")  # imported in _rg()


def _rg():
  import reasoning_gym  # pylint: disable=import-outside-toplevel
  return reasoning_gym


ROOT = pathlib.Path(__file__).parents[1]
ONE_DIGIT = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}  # 200 questions
RG_CONFIGS = ("rg_chain_sum", "rg_gsm_symbolic")


def _config(**rg_changes) -> ml_collections.ConfigDict:
  c = config_lib.defaults()
  c.data.task = "reasoning_gym"
  c.data.rg.update(dict(dataset="chain_sum", eval_size=100, **rg_changes))
  c.data.rg.options = ml_collections.ConfigDict(ONE_DIGIT)
  c.rl.batch_size = 16
  c.reward.fn = "ppojax.tasks.reasoning:reward"
  return c


def test_batches_are_a_pure_function_of_seed_and_position(char_tokenizer):
  config = _config()
  source, again = (sources.make_source(config, char_tokenizer) for _ in range(2))
  b = source.batch(3)
  assert b.records == again.batch(3).records  # as after a resume
  assert (b.prompts.tokens == again.batch(3).prompts.tokens).all()
  assert b.records != source.batch(4).records
  config.seed = 1
  assert sources.make_source(config, char_tokenizer).batch(3).records != b.records
  # the record: the question, the answer, the entry, the dataset and its options, metadata
  r = b.records[0]
  assert r["prompt"] == r["entry"]["question"] and r["answer"] == r["entry"]["answer"]
  assert (r["rg_dataset"], r["rg_options"], r["rg_extract"]) == ("chain_sum", ONE_DIGIT,
                                                                  "last_line")
  assert r["num_digits"] == 1 and r["num_terms"] == 2


def test_held_out_questions_are_distinct_and_never_trained_on():
  held = reasoning.held_out("chain_sum", ONE_DIGIT, 10_000, 100)
  generated = _rg().create_dataset("chain_sum", seed=10_000, size=100, **ONE_DIGIT)
  questions = [e["question"] for e in generated]
  assert [r["prompt"] for r in held] == list(dict.fromkeys(questions))  # order kept, repeats gone
  assert len(held) < 100  # 100 draws of 200 questions repeat some
  exclude = frozenset(r["prompt"] for r in held)
  trained = {r["prompt"] for pos in range(40)
             for r in reasoning.train_records("chain_sum", ONE_DIGIT, 0, pos, 16, exclude)}
  assert not trained & exclude
  assert len(trained) > 100  # most of the 200 - len(held) others do appear
  # without the exclusion the same draws would have hit held-out questions
  unfiltered = {r["prompt"] for pos in range(40)
                for r in reasoning.train_records("chain_sum", ONE_DIGIT, 0, pos, 16)}
  assert unfiltered & exclude


def test_a_held_out_set_that_covers_everything_is_refused():
  dataset = _rg().create_dataset("chain_sum", seed=5, size=3000, **ONE_DIGIT)
  exclude = frozenset(e["question"] for e in dataset)
  assert len(exclude) == 200
  with pytest.raises(ValueError, match="held-out set covers nearly every question.*lower "
                     r"data\.rg\.eval_size"):
    reasoning.train_records("chain_sum", ONE_DIGIT, 0, 0, 4, exclude)


def _columns(records):
  return {k: [r[k] for r in records]
          for k in ("entry", "rg_dataset", "rg_options", "rg_extract")}


@pytest.mark.parametrize("completion, extracted", [
    ("{a}", "{a}"),  # the bare answer
    ("<answer>{a}</answer>", "{a}"),  # reasoning-gym's format
    ("Let me think: <answer>0</answer> no, <answer> {a} </answer>", "{a}"),  # the last tag
    ("First line\n  {a}.  \n\n", "{a}."),  # the last non-empty line
    ("The answer is {a}.", "The answer is {a}."),  # partial credit from the dataset
    ("{wrong}", "{wrong}"),
    ("", None), ("  \n ", None),
])
def test_the_reward_is_the_datasets_score_of_the_extracted_answer(completion, extracted):
  records = reasoning.held_out("chain_sum", ONE_DIGIT, 3, 4)
  dataset = _rg().create_dataset("chain_sum", seed=0, size=1, **ONE_DIGIT)
  fill = lambda s, r: s and s.format(a=r["answer"], wrong=int(r["answer"]) + 1)  # noqa: E731
  texts = [fill(completion, r) for r in records]
  got = reasoning.reward([r["prompt"] for r in records], texts, **_columns(records))
  want = [dataset.score_answer(fill(extracted, r), r["entry"]) for r in records]
  assert got == want
  assert reasoning.accuracy(None, texts, **_columns(records)) == [float(w == 1) for w in want]
  if extracted == "{a}":
    assert got == [1.0] * len(records)
  if "The answer" in completion:
    assert all(0 < g < 1 for g in got)  # chain_sum's partial credit
  if extracted in (None, "{wrong}"):
    assert got == [0.0] * len(records)


@pytest.mark.parametrize("completion, last_line, last_number", [
    ("2 + 9 = 11", "2 + 9 = 11", "11"),
    ("Step 1: 3 + 4 = 7.\nSo it is 1,000.5 apples.\n", "So it is 1,000.5 apples.", "1000.5"),
    ("I think <answer> 12 </answer>, so 13", "12", "12"),  # a tag wins under both rules
    ("The result is -4", "The result is -4", "-4"),
    ("no number", "no number", None), ("", None, None),
])
def test_extraction_rules(completion, last_line, last_number):
  assert reasoning.extract(completion) == reasoning.extract(completion, "last_line") == last_line
  assert reasoning.extract(completion, "last_number") == last_number
  with pytest.raises(ValueError, match=r"data\.rg\.extract='first' is not one of last_line, "
                     "last_number"):
    reasoning.extract(completion, "first")


def test_last_number_scores_an_equation_by_its_result():
  records = reasoning.held_out("chain_sum", ONE_DIGIT, 3, 4, rule="last_number")
  texts = [f"{r['entry']['metadata']['expression']} = {r['answer']}" for r in records]
  assert reasoning.reward(None, texts, **_columns(records)) == [1.0] * len(records)
  as_lines = [dict(r, rg_extract="last_line") for r in records]  # the whole line: partial credit
  assert all(0 < s < 1 for s in reasoning.reward(None, texts, **_columns(as_lines)))


def test_gsm_symbolic_scores_with_its_own_rule():
  (record,) = reasoning.held_out("gsm_symbolic", {}, 0, 1, rule="last_number")
  a = record["answer"]
  texts = [f"Step one: 2 + 3 = 5.\nSo the answer is {a} apples.", "Step one.\nIt is 99999.",
           "No idea."]
  got = reasoning.reward(None, texts, **_columns([record] * 3))
  assert got == [1.0, 0.01, 0.0]  # gsm_symbolic: the extracted number right / wrong / none


def test_direct_instruction_is_reasoning_gyms():
  assert reasoning.DIRECT == _rg().utils.SYSTEM_PROMPTS["direct"]


@pytest.mark.parametrize("change, message", [
    (dict(dataset=""), r'needs data\.rg\.dataset, a reasoning-gym dataset name'),
    (dict(dataset="chain_sums"), r"data\.rg\.dataset='chain_sums' is not a reasoning-gym "
     "dataset; some are: "),
    (dict(options=ml_collections.ConfigDict({"max_digit": 2})),
     r"data\.rg\.options=\{'max_digit': 2\} do not make a 'chain_sum' dataset .*its options are: "
     "min_terms, max_terms, min_digits, max_digits, allow_negation"),
    (dict(options=ml_collections.ConfigDict({"min_digits": 3, "max_digits": 2})),
     r"AssertionError: max_digits must be >= min_digits"),
    (dict(eval_size=-1), r"data\.rg\.eval_size=-1 must be >= 0"),
    (dict(extract="first"), r"data\.rg\.extract='first' is not one of 'last_line', "
     r"'last_number': the answer is the last <answer> tag"),
])
def test_bad_options_fail_validation_naming_them(change, message):
  c = _config()
  for key, value in change.items():
    c.data.rg[key] = value  # the options replaced, not merged
  with pytest.raises(checks_lib.ConfigError, match=message):
    checks_lib.validate(c, num_devices=1)


def test_a_missing_package_names_the_extra(monkeypatch):
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "reasoning_gym" else real(name, *a))
  with pytest.raises(checks_lib.ConfigError, match=r'pip install -e "\.\[reasoning\]"'):
    checks_lib.validate(_config(), num_devices=1)


@pytest.mark.parametrize("name", RG_CONFIGS)
def test_the_configs_validate_and_build_their_source(name, char_tokenizer):
  c = build_lib.load_config(ROOT / "configs" / f"{name}.py")
  build_lib.validate(c)
  assert c.data.task == "reasoning_gym" and c.data.rg.dataset == name.removeprefix("rg_")
  assert c.reward.fn == "ppojax.tasks.reasoning:reward" and c.data.rg.extract == "last_number"
  assert set(c.eval.baselines) == {"instructed", "rg_direct"}
  source = sources.make_source(c, char_tokenizer)
  assert 0 < len(source.eval_records) <= c.data.rg.eval_size
  assert len(source.batch(0).records) == c.rl.batch_size


@pytest.fixture(scope="module")
def policy_dir(char_tokenizer, tmp_path_factory):
  """A tiny random model on the character tokenizer, as a Hugging Face directory (128
  positions: chain_sum's questions are about 75 characters)."""
  cfg = run_models.tiny_model_config(ml_collections.ConfigDict(dict(
      vocab_size=len(char_tokenizer), hidden_size=32, intermediate_size=64, num_layers=2,
      num_heads=2, num_kv_heads=1, max_position_embeddings=128)))
  cfg = cfg.replace(bos_token_id=None, eos_token_id=1, pad_token_id=0)
  lm = LoadedModel(cfg, init_params(CausalLM(cfg), jax.random.key(0)), char_tokenizer, "lm")
  return save_model(tmp_path_factory.mktemp("tiny") / "policy", lm)


def test_rg_chain_sum_runs_one_iteration_with_its_evaluations(policy_dir, tmp_path):
  config = build_lib.load_config(
      ROOT / "configs" / "rg_chain_sum.py", num_iterations=1, save_every=1, sample_every=1,
      model__policy=str(policy_dir), data__max_prompt_len=80, rl__batch_size=2,
      sampling__max_new_tokens=4, eval__batch_size=8, data__rg__eval_size=6)
  work = tmp_path / "run"
  result = runner.run(config, str(work))
  (row,) = result.history
  assert 0 <= row["objective/scores"] <= 1
  assert list(result.evals) == ["before", "before_instructed", "before_rg_direct", "after"]
  assert json.loads((work / "eval.json").read_text()) == result.evals
  for phase in result.evals:
    keys = set(result.evals[phase])
    assert {"eval/accuracy", "eval/score"} <= keys, phase
    assert any(k.startswith("eval/accuracy/num_digits=") for k in keys), phase  # eval.group_by
    rows = [json.loads(line) for line in open(work / f"eval_samples_{phase}.jsonl")]
    assert len(rows) == 6
