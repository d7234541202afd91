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

from ppojax.data import encoding
from ppojax.infra import sharding
from ppojax.models.passes import model_scores
from ppojax.rollout.sampling import SamplingConfig, generate
from ppojax.rollout.host_turns import host_turns, on_host
from ppojax.rollout.multiturn import generate_turns
from ppojax.tasks.sources import call_text_fn, decode_text, turns_text


def greedy(sampling: SamplingConfig, max_new_tokens: int | None = None) -> SamplingConfig:
  """The same stop tokens and length limit, decoded greedily, one completion per prompt."""
  return dataclasses.replace(sampling, greedy=True, top_k=0, top_p=1.0, min_p=0.0,
                             num_samples_per_prompt=1,
                             max_new_tokens=max_new_tokens or sampling.max_new_tokens)


@functools.partial(jax.jit, static_argnums=(0, 5))
def _generate(module, params, tokens, mask, key, sampling):
  """``generate`` compiled once per (module, shapes, sampling) — before and after training."""
  return generate(module, params, tokens, mask, key, sampling)


def _episodes(module, params, tokens, mask, key, sampling, env, records):
  """Whole episodes with ``env`` (multi-turn): traced, or on the host."""
  if on_host(env):
    return host_turns(module, params, tokens, mask, key, sampling, env, records=records)[0]
  return generate_turns(module, params, tokens, mask, key, sampling, env)


# (prompts, prompt mask, responses, response mask) → a score per response [B]
Scorer = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


@functools.partial(jax.jit, static_argnums=0)
def _model_scores(module, params, prompts, prompt_mask, responses, response_mask):
  return model_scores(module, params, prompts, prompt_mask, responses, response_mask)


def reward_model_scorer(module, params) -> Scorer:
  """A reward model's score r(x, y) [B] of each response (``experience.model_scores``: its
  output at the last response token), compiled once per (module, shapes). In RLHF, the
  held-out greedy completions then carry the proxy reward beside the true one (``evaluate``'s
  ``scorer``)."""
  return functools.partial(_model_scores, module, params)


def completions(module, params, records: Sequence[dict],
                encode: Callable[[list[dict]], encoding.Encoded], sampling: SamplingConfig,
                tokenizer, batch_size: int, key: jax.Array | None = None,
                scorer: Scorer | None = None, env=None, shown: list | None = None
                ) -> list[str] | tuple[list[str], np.ndarray]:
  """Completions of every record's prompt, ``batch_size`` prompts per compiled call:
  ``sampling.num_samples_per_prompt`` per prompt, record i's at ``i·n … i·n + n − 1``. Greedy
  decoding needs no ``key``; sampled decoding draws batch j's tokens with ``fold_in(key, j)``.

  ``scorer`` (``reward_model_scorer``): also each completion's score, float64 [N·n], from the
  generated tokens themselves, as the rollout scores them; then (texts, scores). ``env``: whole
  episodes (multi-turn), each text the policy's turns together; ``shown`` (a list) gets each
  episode with its observations (``sources.turns_text``)."""
  if key is None:
    if not sampling.greedy:
      raise ValueError("completions: sampled decoding (sampling.greedy=False) needs a key")
    key = jax.random.key(0)
  n = sampling.num_samples_per_prompt
  out, scores = [], []
  for j, start in enumerate(range(0, len(records), batch_size)):
    chunk = list(records[start:start + batch_size])
    real = len(chunk)
    chunk += [chunk[0]] * (batch_size - real)  # same shape for every call; extras dropped
    enc = encode(chunk)
    if env is None:
      gen = _generate(module, params, enc.tokens, enc.mask, jax.random.fold_in(key, j),
                      sampling)
    else:
      gen = _episodes(module, params, enc.tokens, enc.mask, jax.random.fold_in(key, j),
                      sampling, env, [r for r in chunk for _ in range(n)])
      if shown is not None:
        host = sharding.to_host(gen)
        shown += [turns_text(functools.partial(decode_text, tokenizer), host.tokens[i],
                             host.mask[i], host.seen[i]) for i in range(real * n)]
    if scorer is not None:
      prompts = enc.tokens.repeat(n, 0), enc.mask.repeat(n, 0)  # row i·n + s: prompt i
      scores.append(np.asarray(sharding.to_host(scorer(*prompts, gen.tokens, gen.mask)),
                               np.float64)[:real * n])
    gen = sharding.to_host(gen)
    out += [decode_text(tokenizer, gen.tokens[i], gen.mask[i]) for i in range(real * n)]
  return out if scorer is None else (out, np.concatenate(scores))


def evaluate(module, params, records: Sequence[dict], encode, sampling: SamplingConfig,
             tokenizer, metrics: Mapping[str, Callable], batch_size: int,
             group_by: str | None = None, field: str = "prompt",
             scorer: Scorer | None = None, env=None) -> tuple[dict[str, float], list[dict]]:
  """Mean of each metric over the records (and per value of ``group_by``), and one row per
  record: its prompt, completion and metric values. ``scorer`` (``reward_model_scorer``): one
  more metric, "reward_model", the reward model's score of the generated tokens. ``env``: whole
  episodes, scored on the policy's text; each row also shows the episode ("episode")."""
  if not records:
    raise ValueError("evaluate: no held-out records")
  shown = [] if env is not None else None
  texts = completions(module, params, records, encode, sampling, tokenizer, batch_size,
                      scorer=scorer, env=env, shown=shown)
  values = {}
  if scorer is not None:
    texts, values["reward_model"] = texts
  values.update({name: call_text_fn(fn, records, texts, field) for name, fn in metrics.items()})
  summary = {f"eval/{name}": float(v.mean()) for name, v in values.items()}
  if group_by:
    keys = np.asarray([r[group_by] for r in records])
    for k in sorted(set(keys.tolist())):
      for name, v in values.items():
        summary[f"eval/{name}/{group_by}={k}"] = float(v[keys == k].mean())
  rows = [{"prompt": p, "completion": c, **{n: float(v[i]) for n, v in values.items()}}
          for i, (p, c) in enumerate(zip((r[field] for r in records), texts))]
  for row, episode in zip(rows, shown or ()):
    row["episode"] = episode
  return summary, rows
