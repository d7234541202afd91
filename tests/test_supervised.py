"""SFT and reward-model training: the two losses against NumPy, learning on small synthetic sets
with a tiny random model and a character-level tokenizer built here, exports that reload equal,
an evaluation that counts every held-out row once, and both command lines end to end."""

from __future__ import annotations

import functools
import json
import pathlib
import string
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppojax.core import losses, ops
from ppojax.data import records as records_lib
from ppojax.models import CausalLM, load_model, positions_from_mask
from ppojax.models.passes import model_scores
from ppojax.run import build as build_lib
from ppojax.run import reporting
from ppojax.supervised import common, sft, train_rm

ROOT = pathlib.Path(__file__).parents[1]
TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}a:{% endif %}")
TINY = dict(model__init="tiny", model__tiny__hidden_size=32, model__tiny__intermediate_size=64,
            model__tiny__num_heads=2, model__tiny__num_kv_heads=1, optim__lr=3e-3,
            optim__warmup_steps=0, optim__decay="constant", train__eval_batch_size=16)


# ---------------------------------------------------------------------------------------------
# Fixtures: a character-level tokenizer with a chat template, synthetic data
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> pathlib.Path:
  """A Hugging Face tokenizer directory: one token per printable ASCII character, plus
  <pad> (id 0), </s> (eos, id 1) and <unk>; a one-line-per-message chat template."""
  from tokenizers import Tokenizer, models  # pylint: disable=import-outside-toplevel
  from transformers import PreTrainedTokenizerFast  # pylint: disable=import-outside-toplevel
  chars = sorted(set(string.printable) - set("\t\n\r\x0b\x0c")) + ["\n"]
  vocab = {t: i for i, t in enumerate(["<pad>", "</s>", "<unk>"] + chars)}
  tok = PreTrainedTokenizerFast(
      tokenizer_object=Tokenizer(models.BPE(vocab, [], unk_token="<unk>")), eos_token="</s>",
      pad_token="<pad>", unk_token="<unk>", chat_template=TEMPLATE)
  path = tmp_path_factory.mktemp("tokenizer")
  tok.save_pretrained(str(path))
  return path


def _word(rng, k=4) -> str:
  return "".join(rng.choice(list("abcdefgh"), size=k))


def preference_records(seed: int, n: int) -> list[dict]:
  """Learnable pairs: the chosen response is a random word over "acegikmo", the rejected one
  over "bdfhjlnp"."""
  rng = np.random.default_rng(seed)
  word = lambda letters: "".join(rng.choice(list(letters), size=3))  # noqa: E731
  return [{"prompt": f"rate {_word(rng)}", "chosen": word("acegikmo"),
           "rejected": word("bdfhjlnp")} for _ in range(n)]


def sft_records(seed: int, n: int) -> list[dict]:
  """Learnable examples: the response is "it is <the prompt's word>"."""
  rng = np.random.default_rng(seed)
  return [{"prompt": f"say {w}", "response": f"it is {w}"}
          for w in (_word(rng) for _ in range(n))]


DEFAULTS = """from ppojax.run.config import supervised_defaults
def get_config():
  c = supervised_defaults()
{extra}  return c
"""


def _config(name: str | None, tokenizer_dir, tmp_path, records, n_train=64, n_eval=21,
            extra: str = "", **overrides):
  """A config file of configs/ (``name``), or with ``name`` None a file of ``supervised_defaults()``
  plus the lines ``extra``, on ``records`` written to tmp_path, with the tiny model."""
  train, held_out = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
  records_lib.write_jsonl(records(0, n_train), train)
  records_lib.write_jsonl(records(1, n_eval), held_out)
  path = ROOT / "configs" / name if name else tmp_path / "defaults.py"
  if not name:
    path.write_text(DEFAULTS.format(extra=extra))
  return build_lib.load_config(
      path, model__tokenizer=str(tokenizer_dir), data__train=str(train),
      data__eval=str(held_out), **{**TINY, **overrides})


# ---------------------------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------------------------


def test_bradley_terry_loss_matches_numpy():
  rng = np.random.default_rng(0)
  chosen = rng.normal(size=16).astype(np.float32) * 3
  rejected = rng.normal(size=16).astype(np.float32) * 3
  chosen[:2], rejected[:2] = [200.0, -200.0], [-200.0, 200.0]  # saturated margins stay finite
  margin = chosen.astype(np.float64) - rejected
  loss, metrics = jax.jit(losses.bradley_terry_loss)(chosen, rejected)
  np.testing.assert_allclose(loss, np.mean(np.logaddexp(0.0, -margin)), rtol=1e-5)
  np.testing.assert_allclose(metrics["accuracy"], np.mean(margin > 0))
  np.testing.assert_allclose(metrics["margin"], np.mean(margin), rtol=1e-5)
  grad = jax.grad(lambda c: losses.bradley_terry_loss(c, rejected)[0])(chosen)
  np.testing.assert_allclose(grad, -1 / (1 + np.exp(margin)) / 16, rtol=1e-4, atol=1e-8)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.floats(-50, 50, width=32), st.floats(-50, 50, width=32)),
                min_size=1, max_size=8), st.floats(-100, 100, width=32))
def test_bradley_terry_loss_depends_only_on_the_difference(pairs, shift):
  chosen, rejected = (np.asarray(x, np.float32) for x in zip(*pairs))
  loss = float(losses.bradley_terry_loss(chosen, rejected)[0])
  shifted = float(losses.bradley_terry_loss(chosen + np.float32(shift),
                                            rejected + np.float32(shift))[0])
  assert loss >= 0.0
  assert shifted == pytest.approx(loss, rel=1e-3, abs=1e-3)  # up to rounding of the shift
  tie = float(losses.bradley_terry_loss(chosen, chosen)[0])
  assert tie == pytest.approx(np.log(2.0), rel=1e-6)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_sft_loss_matches_numpy(aggregation):
  rng = np.random.default_rng(1)
  logp = np.log(rng.uniform(0.05, 1.0, size=(4, 6))).astype(np.float32)
  mask = np.arange(6)[None, :] < np.array([[6], [3], [0], [1]])  # an empty row too
  logp_nan = np.where(mask, logp, np.nan)  # padding is never read
  loss = losses.sft_loss(jnp.asarray(logp_nan), jnp.asarray(mask), aggregation)
  if aggregation == "token_mean":
    want = -logp[mask].mean()
  else:
    want = -np.mean([logp[b][mask[b]].mean() for b in range(4) if mask[b].any()])
  np.testing.assert_allclose(loss, want, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# Pieces of the loop
# ---------------------------------------------------------------------------------------------


def test_evaluation_counts_every_held_out_row_exactly_once():
  """7 rows in batches of 3: the last batch is filled with a weight-0 copy, so Σ 2^i = 127."""
  arrays = {"x": 2.0 ** np.arange(7, dtype=np.float32), "y": np.arange(7, dtype=np.float32)}
  eval_fn = lambda params, b: {"x": (b["x"], jnp.ones_like(b["x"])),  # noqa: E731
                               "y": (b["y"], jnp.ones_like(b["y"]))}
  stats = common.evaluate(eval_fn, None, arrays, batch_size=3)
  assert stats == {"x": pytest.approx(127 / 7, rel=1e-6), "y": 3.0, "rows": 7.0}
  assert [list(i) for i, _ in common.eval_batches(7, 3)] == [[0, 1, 2], [3, 4, 5], [6, 0, 0]]


def test_gradient_accumulation_equals_the_full_batch():
  """Bradley–Terry on a linear scorer: two micro-batches of 4 pairs give the 8-pair step."""
  rng = np.random.default_rng(2)
  batch = {"c": rng.normal(size=(8, 3)).astype(np.float32),
           "r": rng.normal(size=(8, 3)).astype(np.float32)}
  loss_fn = lambda w, b: losses.bradley_terry_loss(b["c"] @ w, b["r"] @ w)  # noqa: E731
  tx, _ = common.optimizer(build_lib.load_config(ROOT / "configs" / "rm_arith.py").optim, 10)
  outs = []
  for k in (1, 2):
    w = jnp.asarray([0.5, -0.2, 0.1])
    outs.append(common.make_train_step(loss_fn, tx, k)(w, tx.init(w), batch))
  np.testing.assert_allclose(outs[0][0], outs[1][0], rtol=1e-6)
  for name in ("loss", "accuracy", "margin", "grad_norm"):
    np.testing.assert_allclose(outs[0][2][name], outs[1][2][name], rtol=1e-5)


def _sft_batch(module, params, train, lengths):
  """8 training rows whose response masks hold ``lengths`` tokens (a prefix of each row)."""
  batch = common.take(train, np.arange(8))
  width = batch["response"].shape[1]
  batch["response_mask"] = np.arange(width)[None] < np.minimum(lengths, width)[:, None]
  return batch


def test_sft_gradient_accumulation_is_exact_with_unequal_token_counts(tokenizer_dir, tmp_path):
  """4 micro-batches with very different token counts (one row empty) sum to the gradient and
  the loss of the whole batch (jax.grad of sft_loss, a plain-JAX reference), read off one SGD
  step of rate 1, for every aggregation; micro-batches weighted equally, as before, are off."""
  config = _config(None, tokenizer_dir, tmp_path, sft_records, model__tiny__num_layers=1)
  model = common.build_model(config)
  train, _, _ = sft.load_examples(config, model.tokenizer)
  module, params = model.module, model.params
  batch = common.take(train, np.arange(8))  # micro-batches of rows [0, 1], [2, 3], ...
  lengths = np.array([99, 99, 99, 7, 1, 0, 2, 1])  # tokens: 2R, R + 7, 1, 3
  batch["response_mask"] = np.arange(batch["response"].shape[1])[None] < lengths[:, None]
  tx = optax.sgd(1.0)

  def step(loss_fn, units):  # (the gradient, metrics) of one accumulated step
    own = jax.tree.map(jnp.array, params)  # the step donates its inputs
    new, _, metrics = common.make_train_step(loss_fn, tx, 4, units)(own, tx.init(own), batch)
    return jax.tree.map(lambda a, b: a - b, params, new), metrics

  for aggregation in ops.AGGREGATIONS[:3]:  # seq_mean is seq_mean_token_mean's alias
    loss_fn = functools.partial(sft.sft_loss, module, aggregation)
    (loss, _), want = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params, batch)
    got, metrics = step(loss_fn, functools.partial(sft.sft_units, aggregation))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6), got, want)
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-6)
    if aggregation == "token_mean":  # the old equal weights: not the gradient
      equal, _ = step(loss_fn, common.rows_units)
      gap = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
                for a, b in zip(jax.tree.leaves(equal), jax.tree.leaves(want)))
      assert gap > 0.05, gap


def test_sft_runs_from_the_supervised_defaults(tokenizer_dir, tmp_path):
  """A config of ``supervised_defaults()`` alone trains (token_mean: its loss is the token mean
  of the response NLL); a misspelt aggregation is refused before any model loads."""
  config = _config(None, tokenizer_dir, tmp_path, sft_records, n_train=16, n_eval=5,
                   train__batch_size=8)
  assert sft.aggregation(config) == "token_mean"
  result = sft.run(config)
  assert result.finished and [row["step"] for row in result.history] == [0, 1, 2]
  bad = _config(None, tokenizer_dir, tmp_path, sft_records, n_train=16, n_eval=5,
                extra='  c.train.aggregation = "token-mean"\n')
  with pytest.raises(ValueError, match=r"train\.aggregation='token-mean' is not an aggregation; "
                     "choose one of token_mean, "):
    sft.run(bad)


def test_head_learning_rate_factor_scales_only_the_score_head():
  optim = build_lib.load_config(ROOT / "configs" / "rm_arith.py", optim__head_lr_factor=30.0).optim
  params = {"model": {"w": jnp.ones(3)}, "score": {"kernel": jnp.ones((3, 1))}}
  grads = jax.tree.map(lambda x: -jnp.ones_like(x), params)
  tx, _ = common.optimizer(optim, 10)
  updates, _ = tx.update(grads, tx.init(params), params)
  np.testing.assert_allclose(updates["model"]["w"], optim.lr, rtol=1e-3)  # Adam: ±lr per entry
  np.testing.assert_allclose(updates["score"]["kernel"], 30 * optim.lr, rtol=1e-3)


def test_sft_loss_counts_response_tokens_only(tokenizer_dir, tmp_path):
  """The SFT loss and its gradient equal the usual full-sequence next-token loss whose labels at
  prompt positions are ignored (-100 in transformers), whatever those labels are."""
  config = _config("sft_arith.py", tokenizer_dir, tmp_path, sft_records)
  model = common.build_model(config)
  train, _, _ = sft.load_examples(config, model.tokenizer)
  batch = common.take(train, np.arange(4))
  module, params = model.module, model.params

  def reference(params, prompt_labels, prompt_weight):
    tokens = np.concatenate([batch["prompt"], batch["response"]], 1)
    mask = np.concatenate([batch["prompt_mask"], batch["response_mask"]], 1)
    logits, _ = module.apply({"params": params}, tokens, positions_from_mask(mask), mask)
    labels = jnp.concatenate([prompt_labels, batch["response"]], 1)[:, 1:]
    weight = jnp.concatenate([batch["prompt_mask"] * prompt_weight, batch["response_mask"]], 1)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), labels[..., None], -1)[..., 0]
    return -jnp.sum(weight[:, 1:] * logp) / jnp.sum(weight[:, 1:])

  loss, grads = jax.jit(jax.value_and_grad(
      lambda q: sft.sft_loss(module, "token_mean", q, batch)[0]))(params)
  reference = jax.jit(jax.value_and_grad(reference))
  rng = np.random.default_rng(3)
  for _ in range(2):  # two random draws of labels at prompt positions: neither matters
    labels = rng.integers(0, len(model.tokenizer), size=batch["prompt"].shape)
    ref_loss, ref_grads = reference(params, labels, 0.0)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-6),
                 grads, ref_grads)
  all_tokens_loss = reference(params, batch["prompt"], 1.0)[0]
  assert abs(float(all_tokens_loss) - float(loss)) > 1e-3  # prompt labels would count: not vacuous


# ---------------------------------------------------------------------------------------------
# Learning, exports
# ---------------------------------------------------------------------------------------------


def test_reward_model_learns_preferences_and_reloads(tokenizer_dir, tmp_path):
  """Held-out pairwise accuracy goes from 0.5 (the untrained head scores 0: every pair a tie,
  counted half) to > 0.9 in 16 steps (measured 1.0); the exported reward model gives the
  trained scores. (Trained with 2 micro-batches per step.)"""
  config = _config("rm_arith.py", tokenizer_dir, tmp_path, preference_records,
                   train__num_epochs=4.0, train__grad_accum=2)
  result = train_rm.run(config, tmp_path / "run")
  before, after = result.before["eval/accuracy"], result.after["eval/accuracy"]
  assert before == 0.5 and after > 0.9, (before, after)
  assert result.before["eval/loss"] == pytest.approx(np.log(2)) and result.after["eval/loss"] < 0.2
  assert result.after["eval/rows"] == 21
  rows = reporting.read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
  assert rows[0]["step"] == 0 and rows[0]["eval/accuracy"] == before
  assert rows[0]["data/truncated_prompts"] == 0 and rows[0]["data/truncated_responses"] == 0
  assert rows[-1]["step"] == 16 and rows[-1]["eval/accuracy"] == after
  assert "train/loss" in rows[-1] and "lr" in rows[-1]
  assert rows[-1]["compile/count"] > 0 and rows[-1]["time/compile/train"] > 0

  reloaded = load_model(tmp_path / "run" / "reward_model", head="value")
  assert reloaded.head == "value" and len(reloaded.tokenizer) == len(result.model.tokenizer)
  _, held_out, _ = train_rm.load_pairs(config, reloaded.tokenizer)
  args = (held_out["prompt"], held_out["prompt_mask"], held_out["chosen"],
          held_out["chosen_mask"])
  scores = jax.jit(model_scores, static_argnums=0)
  np.testing.assert_allclose(scores(reloaded.module, reloaded.params, *args),
                             scores(result.model.module, result.model.params, *args),
                             rtol=1e-5, atol=1e-5)


def test_sft_lowers_held_out_nll_and_the_policy_reloads(tokenizer_dir, tmp_path):
  """Held-out response NLL per token falls from ~log(99) ≈ 4.6 (random init) below half of it."""
  config = _config("sft_arith.py", tokenizer_dir, tmp_path, sft_records, train__num_epochs=6.0,
                   optim__lr=1e-2)
  result = sft.run(config, tmp_path / "run")
  before, after = result.before["eval/nll"], result.after["eval/nll"]
  assert before > 3.5 and after < 0.5 * before, (before, after)
  assert result.after["eval/token_accuracy"] > result.before["eval/token_accuracy"] + 0.3
  assert result.after["eval/rows"] == 21
  reloaded = load_model(tmp_path / "run" / "policy")
  assert reloaded.head == "lm" and isinstance(reloaded.module, CausalLM)
  jax.tree.map(np.testing.assert_array_equal, reloaded.params, result.model.params)


# ---------------------------------------------------------------------------------------------
# Command lines
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command,config,output,summary", [
    ("ppojax.supervised.train_rm", "rm_arith.py", "reward_model", "held-out pairwise accuracy:"),
    ("ppojax.supervised.sft", "sft_arith.py", "policy", "held-out response NLL:"),
])
def test_cli_runs_on_generated_arith_data(command, config, output, summary, tokenizer_dir,
                                          tmp_path):
  flags = [f"--config.{k.replace('__', '.')}={v}" for k, v in TINY.items()]
  flags += [f"--config.model.tokenizer={tokenizer_dir}", "--config.data.train_size=16",
            "--config.data.eval_size=10", "--config.train.batch_size=8"]
  result = subprocess.run(
      [sys.executable, "-m", command, "--config", str(ROOT / "configs" / config),
       "--workdir", str(tmp_path), *flags],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert summary in result.stdout and "held-out (10 rows) before training" in result.stdout
  assert (tmp_path / output / "config.json").exists()
  assert (tmp_path / output / "model.safetensors").exists()
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert rows[0]["step"] == 0 and rows[-1]["step"] == 2 and rows[0]["data/truncated_prompts"] == 0
