"""Supervised fine-tuning::

    python -m ppojax.sft --config configs/sft_arith.py --workdir DIR

The policy learns (prompt, response) examples by the negative log-likelihood of the response
tokens only (the EOS token that ends each response included; prompt tokens are context, never
targets):

    L = −agg_{b,t} log π(y_t | x, y_<t)     (losses.sft_loss; agg: token or sequence mean)

Held-out response NLL (a token mean) and token accuracy (greedy next token = target) are printed
and logged before and after training; DIR gets metrics.jsonl, TensorBoard events, checkpoints/
(rerunning the command resumes from the latest complete one, as ``ppojax.train`` does) and
``policy/`` in Hugging Face format, the starting point of reward-model training and PPO
(``--config.model.init=DIR/policy`` / ``--config.model.policy=DIR/policy``). Override any
config field with ``--config.section.field=value``.
"""

from __future__ import annotations

import os

# transformers warns on import that PyTorch is missing; ppojax never needs it.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import functools
import pathlib

import jax
import jax.numpy as jnp
import ml_collections

from ppojax.core import logprobs, losses, ops
from ppojax.data import encoding
from ppojax.models import save_model
from ppojax.models.passes import response_logits, response_logprobs
from ppojax.supervised import common, loop
from ppojax.envs import calculator
from ppojax.tasks import arith

FIELDS = ("prompt", "response")
# data.train / data.eval names of generated examples: (seed, n, split) → records
GENERATED = {"arith": arith.sft_examples, "calc": calculator.sft_examples}
DEFAULT_AGGREGATION = "token_mean"


def _args(batch: dict) -> tuple:
  return batch["prompt"], batch["prompt_mask"], batch["response"], batch["response_mask"]


def aggregation(config: ml_collections.ConfigDict) -> str:
  """``train.aggregation`` (default "token_mean", for a config that lacks it), checked against
  ``ops.AGGREGATIONS``."""
  mode = config.train.get("aggregation", DEFAULT_AGGREGATION)
  if mode not in ops.AGGREGATIONS:
    raise ValueError(f"train.aggregation={mode!r} is not an aggregation; choose one of "
                     f"{', '.join(ops.AGGREGATIONS)}")
  return mode


def sft_loss(module, aggregation: str, params, batch: dict):
  """The response NLL (``losses.sft_loss``) of a batch, at temperature 1; the constant of
  "seq_mean_token_sum_norm" is the response length R (the data's longest, fixed for the run)."""
  logp = response_logprobs(module, params, *_args(batch), 1.0, chunk_size=None)
  mask = batch["response_mask"]
  return losses.sft_loss(logp, mask, aggregation, max_len=mask.shape[1]), {}


def sft_units(aggregation: str, batch: dict) -> jax.Array:
  """What ``sft_loss`` averages over (``ops.aggregation_count``): response tokens for
  "token_mean", non-empty rows for the sequence means; micro-batch gradients are weighted by
  it, so accumulation gives the whole batch's gradient (``common.make_train_step``)."""
  return ops.aggregation_count(batch["response_mask"], aggregation)


def sft_eval(module, params, batch: dict) -> dict:
  """Per-example statistics over the response tokens: NLL sum and greedy-correct tokens, each
  over the number of tokens (so the held-out means are token means)."""
  logits = response_logits(module, params, *_args(batch))
  tokens, mask = batch["response"], batch["response_mask"]
  logp = logprobs.selective_log_softmax(logits, tokens, 1.0)
  correct = jnp.argmax(logits, axis=-1) == tokens
  count = ops.masked_count(mask, axis=1)
  return {"nll": (ops.masked_sum(-logp, mask, axis=1), count),
          "token_accuracy": (ops.masked_sum(correct.astype(jnp.float32), mask, axis=1), count)}


def load_examples(config: ml_collections.ConfigDict, tokenizer) -> tuple[dict, dict, dict]:
  """(train, held-out) example arrays and data statistics from the ``data`` config section."""
  d = config.data
  encode = functools.partial(
      encoding.encode_sft, tokenizer, max_prompt_len=d.max_prompt_len,
      max_response_len=d.max_response_len, system=d.system or None,
      chat_template=d.chat_template, truncate=d.truncate,
      chat_template_kwargs=d.get("chat_template_kwargs"))
  sets = [encode(common.load_records(source, n, split, GENERATED, FIELDS,
                                         config.seed))
          for source, n, split in ((d.train, d.train_size, d.train_split),
                                   (d.eval, d.eval_size, d.eval_split))]
  prompts = common.fit_length([s.prompt for s in sets], left=True)
  responses = common.fit_length([s.response for s in sets], left=False)
  arrays = [{"prompt": p.tokens, "prompt_mask": p.mask, "response": r.tokens,
             "response_mask": r.mask} for p, r in zip(prompts, responses)]
  info = {
      "data/train_examples": len(sets[0].prompt.tokens),
      "data/eval_examples": len(sets[1].prompt.tokens),
      "data/prompt_len": prompts[0].tokens.shape[1],
      "data/response_len": responses[0].tokens.shape[1],
      "data/truncated_prompts": sum(int(s.prompt.truncated.sum()) for s in sets),
      "data/truncated_responses": sum(int(s.response.truncated.sum()) for s in sets)}
  return arrays[0], arrays[1], info


def run(config: ml_collections.ConfigDict, workdir: str | pathlib.Path | None = None,
        stop_after: int | None = None) -> loop.Result:
  """Fine-tunes the policy of ``config``; with a ``workdir``, checkpoints, resumes, writes
  metrics and at the end saves the policy to ``workdir/policy`` (``loop.fit``;
  ``stop_after``: stop after that step, as an interrupted run would)."""
  mode = aggregation(config)
  model = common.build_model(config, head="lm")
  train, held_out, info = load_examples(config, model.tokenizer)
  print(", ".join(f"{k[5:]} {v}" for k, v in info.items()), flush=True)
  module = model.module
  result = loop.fit(
      config, workdir, model, functools.partial(sft_loss, module, mode),
      functools.partial(sft_eval, module), train, held_out, info,
      shown=("train/loss", "eval/nll"), units=functools.partial(sft_units, mode),
      stop_after=stop_after)
  if workdir and result.finished:
    out = save_model(pathlib.Path(workdir) / "policy", result.model)
    print(f"wrote the policy to {out}", flush=True)
  return result


if __name__ == "__main__":  # the command line is ppojax.sft (ppojax/sft.py)
  import runpy  # pylint: disable=import-outside-toplevel
  runpy.run_module("ppojax.sft", run_name="__main__", alter_sys=True)
