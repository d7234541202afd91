"""Preference pairs from a policy's own mistakes: the near-miss wrong answers a reward model
must learn to rank below the right ones are the ones the policy it will judge produces.

    python -m ppojax.preferences --config configs/rlhf_arith.py --out prefs/train.jsonl \
        --config.model.policy=runs/sft_arith/policy [--n 2048] [--samples 4] \
        [--temperature 1.0] [--split train] [--synthetic 2048]

For each of ``n`` problems of ``split`` the policy samples ``samples`` responses. Every distinct
wrong response w becomes a pair whose rejected side is w and whose chosen side is w with its
final number replaced by the right answer (``with_answer``): the two differ in that number only,
so the pair carries correctness and nothing else (no style difference for the model to latch
on to: a response the policy writes is never paired with one a template writes). A wrong
response without a number is paired with a correct response the policy wrote for the same
problem, if it wrote one, else left out. ``--synthetic N`` adds ``arith.preference_pairs`` of the
same split (template wording; off by one or ten, the other operation, reversed digits). Each
record has "prompt", "chosen", "rejected", "answer" and "source" ("policy" or "synthetic"), and
``python -m ppojax.train_rm --config.data.train=FILE`` reads it; with "source" present
the held-out accuracy is also reported per source.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import dataclasses
import re
from typing import Callable, Sequence

import jax
import numpy as np

from ppojax.infra import hostmem
from ppojax.run import evaluation
from ppojax.tasks import arith

_LAST_NUMBER = re.compile(r"-?\d(?:[\d,]*\d)?(?:\.\d+)?(?!.*\d)", re.DOTALL)


def with_answer(text: str, answer: str) -> str | None:
  """``text`` with its last number replaced by ``answer`` ("23 + 45 = 67" → "23 + 45 = 68");
  None when ``text`` has no number."""
  match = _LAST_NUMBER.search(text)
  if match is None:
    return None
  return text[:match.start()] + str(answer) + text[match.end():]


def pairs_from_samples(records: Sequence[dict], samples: Sequence[Sequence[str]],
                       is_correct: Callable[[str, str], bool]) -> list[dict]:
  """Pairs from ``samples[i]`` (the policy's responses to ``records[i]``, which has "prompt"
  and "answer"): per distinct wrong response w, (chosen = ``with_answer(w)``, rejected = w);
  a wrong response with no number is paired with the record's first correct response, or
  dropped when there is none. Records whose responses are all right give no pair."""
  if len(records) != len(samples):
    raise ValueError(f"{len(records)} records but {len(samples)} lists of samples")
  out = []
  for record, responses in zip(records, samples):
    answer = str(record["answer"])
    right = [s for s in responses if is_correct(s, answer)]
    for wrong in dict.fromkeys(s for s in responses if not is_correct(s, answer)):
      chosen = with_answer(wrong, answer)
      if chosen is None or not is_correct(chosen, answer):
        chosen = right[0] if right else None
      if chosen is not None and chosen != wrong:
        out.append({"prompt": record["prompt"], "chosen": chosen, "rejected": wrong,
                    "answer": answer, "source": "policy"})
  return out


def arith_correct(text: str, answer: str) -> bool:
  """The arithmetic task's verifier: the last number of ``text`` equals ``answer``."""
  return arith.exact_match([text], [answer])[0] == 1.0


def sample_responses(config, records: Sequence[dict], samples_per_problem: int, temperature: float,
                     seed: int, batch_size: int = 64) -> list[list[str]]:
  """``samples_per_problem`` responses of the config's policy (``model.policy``) to each record,
  drawn at ``temperature`` with the config's other sampling settings."""
  from ppojax.run import build
  from ppojax.run import models as run_models
  from ppojax.tasks import sources
  policy = run_models.load_policy(config, jax.random.key(config.seed))
  hostmem.release()
  sampling = dataclasses.replace(build.sampling_config(config, policy), temperature=temperature,
                                 num_samples_per_prompt=samples_per_problem)
  encode = sources.prompt_encoder(config, policy.tokenizer)
  texts = evaluation.completions(policy.module, policy.params, records, encode, sampling,
                                 policy.tokenizer, batch_size, key=jax.random.key(seed))
  return [texts[i * samples_per_problem:(i + 1) * samples_per_problem] for i in range(len(records))]


def make_pairs(config, n: int, split: str, samples_per_problem: int, temperature: float,
               synthetic: int, seed: int) -> tuple[list[dict], dict]:
  """(pairs, statistics): the policy's near-miss pairs on ``n`` problems of ``split`` and
  ``synthetic`` template pairs, shuffled together."""
  records = arith.problems([seed, 1], n, split)
  samples = sample_responses(config, records, samples_per_problem, temperature, seed)
  pairs = pairs_from_samples(records, samples, arith_correct)
  stats = {"problems": n, "samples": n * samples_per_problem,
           "sample_accuracy": float(np.mean([arith_correct(s, r["answer"])
                                             for r, g in zip(records, samples) for s in g])),
           "policy_pairs": len(pairs), "synthetic_pairs": synthetic}
  pairs += [dict(p, source="synthetic") for p in arith.preference_pairs(seed, synthetic, split)]
  order = np.random.default_rng([seed, 23]).permutation(len(pairs))
  return [pairs[i] for i in order], stats


if __name__ == "__main__":  # the command line is ppojax.preferences (ppojax/preferences.py)
  import runpy  # pylint: disable=import-outside-toplevel
  runpy.run_module("ppojax.preferences", run_name="__main__", alter_sys=True)
