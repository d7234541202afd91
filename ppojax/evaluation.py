"""Held-out evaluation: greedy completions of held-out prompts, scored by text metrics.

    summary, rows = evaluate(module, params, records, encode, sampling, tokenizer,
                             {"accuracy": arith.accuracy}, batch_size=64, group_by="digits")
    summary == {"eval/accuracy": 0.41, "eval/accuracy/digits=1": 0.7, ...}

A metric is a trl-style function ``fn(prompts, completions, **columns) -> list[float]`` (the same
signature as a text reward, so a reward function is also a metric). Every record is scored
exactly once: the last batch is filled up with copies whose results are dropped.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Mapping, Sequence

import jax
import numpy as np

from ppojax import data, sharding
from ppojax.sampling import SamplingConfig, generate
from ppojax.sources import call_text_fn, decode_text


def greedy(sampling: SamplingConfig, max_new_tokens: int | None = None) -> SamplingConfig:
  """The same stop tokens and length limit, decoded greedily, one completion per prompt."""
  return dataclasses.replace(sampling, greedy=True, top_k=0, top_p=1.0, min_p=0.0, num_samples=1,
                             max_new_tokens=max_new_tokens or sampling.max_new_tokens)


@functools.partial(jax.jit, static_argnums=(0, 5))
def _generate(module, params, tokens, mask, key, sampling):
  """``generate`` compiled once per (module, shapes, sampling) — before and after training."""
  return generate(module, params, tokens, mask, key, sampling)


def completions(module, params, records: Sequence[dict],
                encode: Callable[[list[dict]], data.Encoded], sampling: SamplingConfig,
                tokenizer, batch_size: int, key: jax.Array | None = None) -> list[str]:
  """Completions of every record's prompt, ``batch_size`` prompts per compiled call:
  ``sampling.num_samples`` per prompt, record i's at ``i·n … i·n + n − 1``. Greedy decoding
  needs no ``key``; sampled decoding draws batch j's tokens with ``fold_in(key, j)``."""
  if key is None:
    if not sampling.greedy:
      raise ValueError("completions: sampled decoding (sampling.greedy=False) needs a key")
    key = jax.random.key(0)
  n = sampling.num_samples
  out = []
  for j, start in enumerate(range(0, len(records), batch_size)):
    chunk = list(records[start:start + batch_size])
    real = len(chunk)
    chunk += [chunk[0]] * (batch_size - real)  # same shape for every call; extras dropped
    enc = encode(chunk)
    gen = sharding.to_host(_generate(module, params, enc.tokens, enc.mask,
                                     jax.random.fold_in(key, j), sampling))
    out += [decode_text(tokenizer, gen.tokens[i], gen.mask[i]) for i in range(real * n)]
  return out


def evaluate(module, params, records: Sequence[dict], encode, sampling: SamplingConfig,
             tokenizer, metrics: Mapping[str, Callable], batch_size: int,
             group_by: str | None = None, field: str = "prompt"
             ) -> tuple[dict[str, float], list[dict]]:
  """Mean of each metric over the records (and per value of ``group_by``), and one row per
  record: its prompt, completion and metric values."""
  if not records:
    raise ValueError("evaluate: no held-out records")
  texts = completions(module, params, records, encode, sampling, tokenizer, batch_size)
  values = {name: call_text_fn(fn, records, texts, field) for name, fn in metrics.items()}
  summary = {f"eval/{name}": float(v.mean()) for name, v in values.items()}
  if group_by:
    keys = np.asarray([r[group_by] for r in records])
    for k in sorted(set(keys.tolist())):
      for name, v in values.items():
        summary[f"eval/{name}/{group_by}={k}"] = float(v[keys == k].mean())
  rows = [{"prompt": p, "completion": c, **{n: float(v[i]) for n, v in values.items()}}
          for i, (p, c) in enumerate(zip((r[field] for r in records), texts))]
  return summary, rows
