"""Reward-model training::

    python -m ppojax.train_rm --config configs/rm_arith.py --workdir DIR

A reward model is a ``ValueModel`` (backbone + scalar head "score"); the score of a (prompt,
response) pair is its output at the last response token (``experience.model_scores``; responses
end with the EOS token). It learns from preference pairs by the Bradley–Terry loss

    L = mean_b −log σ(r(x, y_chosen) − r(x, y_rejected))

with chosen and rejected run as one batch of 2B sequences (one forward pass). Held-out pairwise
accuracy (ties count half) is printed and logged before and after training; DIR gets
metrics.jsonl, TensorBoard events, checkpoints/ (rerunning the command resumes from the latest
complete one, as ``ppojax.train`` does) and ``reward_model/`` in Hugging Face format, which PPO
uses with ``--config.reward.kind=model --config.model.reward=DIR/reward_model``. Override any
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
import numpy as np

from ppojax.core import losses
from ppojax.data import encoding
from ppojax.data import records as records_lib
from ppojax.models import save_model
from ppojax.models.passes import model_scores
from ppojax.supervised import common, loop
from ppojax.tasks import arith

FIELDS = ("prompt", "chosen", "rejected")
SOURCES = ("synthetic", "policy")  # where a pair came from (ppojax.supervised.preferences)


def pair_scores(module, params, batch: dict) -> tuple[jax.Array, jax.Array]:
  """(r_chosen [B], r_rejected [B]): chosen and rejected responses scored in one forward pass
  over 2B sequences (the prompt repeated)."""
  twice = lambda x: jnp.concatenate([x, x])  # noqa: E731
  responses = jnp.concatenate([batch["chosen"], batch["rejected"]])
  mask = jnp.concatenate([batch["chosen_mask"], batch["rejected_mask"]])
  scores = model_scores(module, params, twice(batch["prompt"]), twice(batch["prompt_mask"]),
                        responses, mask)
  b = batch["chosen"].shape[0]
  return scores[:b], scores[b:]


def rm_loss(module, params, batch: dict):
  """Bradley–Terry loss and its metrics (accuracy, margin) on a batch of pairs."""
  return losses.bradley_terry_loss(*pair_scores(module, params, batch))


def rm_eval(module, params, batch: dict, sources: tuple[str, ...] = ()) -> dict:
  """Per-pair statistics: accuracy (1 if r_c > r_r, ½ on a tie), loss and margin; for each of
  ``sources`` (names in ``SOURCES``; the batch's ``source`` column holds their ids) also
  ``accuracy/NAME`` over that source's pairs."""
  chosen, rejected = pair_scores(module, params, batch)
  margin = chosen - rejected
  correct = (margin > 0) + 0.5 * (margin == 0)
  one = jnp.ones_like(margin)
  stats = {"accuracy": (correct, one), "loss": (-jax.nn.log_sigmoid(margin), one),
           "margin": (margin, one)}
  for name in sources:
    mine = (batch["source"] == SOURCES.index(name)).astype(margin.dtype)
    stats[f"accuracy/{name}"] = (correct * mine, mine)
  return stats


def source_ids(records: list[dict]) -> np.ndarray | None:
  """Each record's "source" as an index into ``SOURCES`` (int32 [N]), or None when some record
  has none; an unknown source is an error naming it."""
  if not records or any("source" not in r for r in records):
    return None
  unknown = sorted({r["source"] for r in records} - set(SOURCES))
  if unknown:
    raise records_lib.DataError(f"preference pairs with source {unknown}: known sources are "
                         f"{list(SOURCES)} (ppojax.supervised.preferences writes them)")
  return np.asarray([SOURCES.index(r["source"]) for r in records], np.int32)


def load_pairs(config: ml_collections.ConfigDict, tokenizer) -> tuple[dict, dict, dict]:
  """(train, held-out) pair arrays and data statistics from the ``data`` config section."""
  d = config.data
  encode = functools.partial(
      encoding.encode_pairs, tokenizer, max_prompt_len=d.max_prompt_len,
      max_response_len=d.max_response_len, system=d.system or None,
      chat_template=d.chat_template, truncate=d.truncate,
      chat_template_kwargs=d.get("chat_template_kwargs"))
  records = [common.load_records(source, n, split, {"arith": arith.preference_pairs}, FIELDS,
                                     config.seed)
             for source, n, split in ((d.train, d.train_size, d.train_split),
                                      (d.eval, d.eval_size, d.eval_split))]
  sets = [encode(r) for r in records]
  prompts = common.fit_length([s.prompt for s in sets], left=True)
  responses = common.fit_length([r for s in sets for r in (s.chosen, s.rejected)], left=False)
  arrays = [{"prompt": p.tokens, "prompt_mask": p.mask, "chosen": c.tokens, "chosen_mask": c.mask,
             "rejected": r.tokens, "rejected_mask": r.mask}
            for p, c, r in zip(prompts, responses[0::2], responses[1::2])]
  source_ids(records[0])  # an unknown source in the training pairs is an error too
  held_out_sources = source_ids(records[1])
  if held_out_sources is not None:  # per-source held-out accuracy (rm_eval)
    arrays[1]["source"] = held_out_sources
  info = {
      "data/train_pairs": len(sets[0].prompt.tokens),
      "data/eval_pairs": len(sets[1].prompt.tokens),
      "data/prompt_len": prompts[0].tokens.shape[1],
      "data/response_len": responses[0].tokens.shape[1],
      "data/truncated_prompts": sum(int(s.prompt.truncated.sum()) for s in sets),
      "data/truncated_responses": sum(int(s.chosen.truncated.sum() + s.rejected.truncated.sum())
                                      for s in sets)}
  return arrays[0], arrays[1], info


def run(config: ml_collections.ConfigDict, workdir: str | pathlib.Path | None = None,
        stop_after: int | None = None) -> loop.Result:
  """Trains the reward model of ``config``; with a ``workdir``, checkpoints, resumes, writes
  metrics and at the end saves the model to ``workdir/reward_model`` (``loop.fit``;
  ``stop_after``: stop after that step, as an interrupted run would)."""
  model = common.build_model(config, head="value")
  train, held_out, info = load_pairs(config, model.tokenizer)
  print(", ".join(f"{k[5:]} {v}" for k, v in info.items()), flush=True)
  module = model.module
  present = np.unique(held_out["source"]) if "source" in held_out else []
  evaluate = functools.partial(rm_eval, module, sources=tuple(SOURCES[i] for i in present))
  result = loop.fit(config, workdir, model, functools.partial(rm_loss, module),
                    evaluate, train, held_out, info,
                    shown=("train/loss", "train/accuracy"), stop_after=stop_after)
  if workdir and result.finished:
    out = save_model(pathlib.Path(workdir) / "reward_model", result.model)
    print(f"wrote the reward model to {out}", flush=True)
  return result


if __name__ == "__main__":  # the command line is ppojax.train_rm (ppojax/train_rm.py)
  import runpy  # pylint: disable=import-outside-toplevel
  runpy.run_module("ppojax.train_rm", run_name="__main__", alter_sys=True)
