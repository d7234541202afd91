"""Honest baselines (ppojax/run/baselines.py, ``eval.baselines``): the untrained policy evaluated
with an instruction appended to each held-out prompt, before training, once (also across a
resume that cut it short), beside "before" in eval.json and as its own metric names; on a
tiny random model and the character tokenizer."""

from __future__ import annotations

import json

import jax
import ml_collections
import pytest

from ppojax.data import encoding
from ppojax.data import records as records_lib
from ppojax.models import CausalLM, LoadedModel, init_params, save_model
from ppojax.run import baselines, held_out, reporting, runner
from ppojax.run import build as build_lib
from ppojax.run import checks as checks_lib
from ppojax.run import config as config_lib
from ppojax.run import models as run_models
from ppojax.tasks import arith

BASELINES = {"instructed": "Reply with just the number.", "terse": "Be brief."}


def test_instruct_appends_to_a_string_or_the_last_user_message():
  records = [{"prompt": "What is 2 + 3?", "answer": "5"},
             {"prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"},
                         {"role": "assistant", "content": "A"}, {"role": "user", "content": "Q2"}]}]
  out = baselines.instruct(records, "Reply with just the number.")
  assert out[0] == {"prompt": "What is 2 + 3? Reply with just the number.", "answer": "5"}
  assert [m["content"] for m in out[1]["prompt"]] == ["S", "Q1", "A",
                                                      "Q2 Reply with just the number."]
  assert records[1]["prompt"][3]["content"] == "Q2"  # the records themselves are unchanged
  with pytest.raises(records_lib.DataError, match="record 0: a baseline instruction goes into the last "
                     "user message"):
    baselines.instruct([{"prompt": [{"role": "system", "content": "S"}]}], "x")


def test_instructed_prompts_are_never_cut(char_tokenizer):
  config = config_lib.defaults()
  config.data.max_prompt_len = 20  # "u:What is 2 + 3?\na:" is 19 characters
  records = arith.eval_problems(2)
  instructed, encode = baselines.instructed(config, char_tokenizer, records, "Be brief.")
  enc = encode(instructed)
  assert not enc.truncated.any()
  longest = max(len(encoding.prompt_ids(char_tokenizer, r["prompt"])) for r in instructed)
  assert enc.tokens.shape == (4, longest) and longest > 20


def test_phases_and_metric_names():
  config = config_lib.defaults()
  config.eval.baselines = ml_collections.ConfigDict(BASELINES)
  assert baselines.phases(config) == [("before_instructed", BASELINES["instructed"]),
                                      ("before_terse", "Be brief.")]
  assert [baselines.metric_prefix(p) for p in ("before", "after", "iteration_5",
                                               "before_instructed", "before_a_b")] == [
      "eval/", "eval/", "eval/", "eval_instructed/", "eval_a_b/"]


@pytest.mark.parametrize("name, text, message", [
    ("with space", "x", r"eval\.baselines\.with space: .* use letters, digits and _"),
    ("empty", "  ", r"eval\.baselines\.empty='  ' must be a non-empty instruction text"),
])
def test_bad_baselines_fail_validation(name, text, message):
  config = build_lib.load_config("configs/toy.py")
  config.eval.baselines = ml_collections.ConfigDict({name: text})
  with pytest.raises(checks_lib.ConfigError, match=message):
    checks_lib.validate(config, num_devices=1)


def test_only_the_cut_short_phases_rows_are_dropped(tmp_path):
  path = tmp_path / "metrics.jsonl"
  rows = [{"step": 0, "eval/score": 0.1}, {"step": 0, "eval_instructed/score": 0.3},
          {"step": 0, "eval_terse/score": 0.2}, {"step": 1, "objective/kl": 0.0}]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  held_out.drop_eval_rows(path, [0], "eval_terse/")
  assert reporting.read_metrics(str(path)) == rows[:2] + rows[3:]
  held_out.drop_eval_rows(path, [0])
  assert reporting.read_metrics(str(path)) == rows[1:2] + rows[3:]


@pytest.fixture(scope="module")
def policy_dir(char_tokenizer, tmp_path_factory):
  cfg = run_models.tiny_model_config(ml_collections.ConfigDict(dict(
      vocab_size=len(char_tokenizer), hidden_size=32, intermediate_size=64, num_layers=2,
      num_heads=2, num_kv_heads=1, max_position_embeddings=64)))
  cfg = cfg.replace(bos_token_id=None, eos_token_id=1, pad_token_id=0)
  lm = LoadedModel(cfg, init_params(CausalLM(cfg), jax.random.key(3)), char_tokenizer, "lm")
  return save_model(tmp_path_factory.mktemp("tiny") / "policy", lm)


def _config(policy, iterations: int) -> ml_collections.ConfigDict:
  c = config_lib.defaults()
  c.num_iterations, c.save_every, c.sample_every = iterations, 1, 0
  c.model.policy = str(policy)
  c.data.update(task="arith", eval_per_digits=2, max_prompt_len=24)  # 4 held-out problems
  c.eval.update(batch_size=4, group_by="digits")
  c.eval.metrics = ml_collections.ConfigDict({"accuracy": "ppojax.tasks.arith:accuracy",
                                              "length": "text_reward_fn:length"})
  c.eval.baselines = ml_collections.ConfigDict(BASELINES)
  c.sampling.update(max_new_tokens=4)
  c.rl.batch_size = 4
  return c


def test_baselines_are_evaluated_before_training_beside_before(policy_dir, tmp_path):
  work = tmp_path / "run"
  result = runner.run(_config(policy_dir, 1), str(work))
  assert list(result.evals) == ["before", "before_instructed", "before_terse", "after"]
  assert json.loads((work / "eval.json").read_text()) == result.evals
  assert set(result.evals["before_terse"]) == set(result.evals["before"])  # the same eval/ keys
  for name, text in BASELINES.items():
    samples = [json.loads(line) for line in open(work / f"eval_samples_before_{name}.jsonl")]
    assert [s["prompt"] for s in samples] == [f"{p['prompt']} {text}"
                                              for p in arith.eval_problems(2)]
  step0 = [r for r in reporting.read_metrics(str(work / "metrics.jsonl")) if r["step"] == 0]
  assert [sorted(r)[0] for r in step0] == ["eval/accuracy", "eval_instructed/accuracy",
                                           "eval_terse/accuracy"]
  assert step0[1] == {"step": 0, **{k.replace("eval/", "eval_instructed/"): v
                                    for k, v in result.evals["before_instructed"].items()}}


def test_evaluation_only_and_a_cut_short_baseline_is_redone_once(policy_dir, tmp_path):
  """``num_iterations=0``: "before" and the baselines, no "after", no export. A run killed
  after a baseline's metrics row but before eval.json took it evaluates that one again (its
  stale row dropped first), and only that one."""
  work = tmp_path / "run"
  config = _config(policy_dir, 0)
  first = runner.run(config, str(work))
  assert list(first.evals) == ["before", "before_instructed", "before_terse"]
  assert not first.history and not (work / "policy").exists()
  evals = json.loads((work / "eval.json").read_text())
  del evals["before_terse"]  # as if killed between its metrics row and eval.json
  (work / "eval.json").write_text(json.dumps(evals))
  before_samples = (work / "eval_samples_before.jsonl").stat().st_mtime_ns
  again = runner.run(config, str(work))
  assert again.evals == first.evals
  assert (work / "eval_samples_before.jsonl").stat().st_mtime_ns == before_samples
  rows = reporting.read_metrics(str(work / "metrics.jsonl"))
  assert [sorted(r)[0] for r in rows] == ["eval/accuracy", "eval_instructed/accuracy",
                                          "eval_terse/accuracy"]
