"""Milliseconds per draw of one token per row (``rollout.draw.sample_token``, every decode step's
sampling) against the sort-based draw it replaced, side by side in one process.

Table: docs/performance/decode.md, "The draw: `benchmarks/draw.py`".

    python benchmarks/draw.py [--shapes 64x49152 256x151936] [--scale 12] [--repeats 7]

The sort-based draw: ``draw.truncate_logits`` (top-p by a sort of the whole vocabulary, min-p by
a second softmax), the two normalisers, the same inverse CDF. Logits: standard normal × ``--scale``
(12: peaked rows, whose top-p cut lies among the 256 candidates, as a trained LM's mostly do;
3: flat rows, where ``sample_token`` falls back to the sort). Settings: temperature 1; with the
first 3 tokens banned (``min_new_tokens``); top-p 0.9; top-k 50 with top-p 0.95. Prints one
JSON line: {shape/setting: {"sorted_ms", "ms", "ratio"}} (median of ``--repeats``, compiled
before timing).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

from ppojax.rollout import draw
from ppojax.rollout.sampling import SamplingConfig

SETTINGS = {"t1": ({}, False), "t1_banned": ({}, True), "top_p0.9": (dict(top_p=0.9), False),
            "top_k50_top_p0.95": (dict(top_k=50, top_p=0.95), False)}


def sorted_draw(logits, key, config, banned=None):
  """The draw before the threshold search: sort-based truncation, two normalisers."""
  z = logits.astype(jnp.float32) / config.temperature
  zt = z if banned is None else jnp.where(banned, jnp.finfo(z.dtype).min, z)
  zt = draw.truncate_logits(zt, config) if config.truncates else zt
  lse = jax.nn.logsumexp(z, -1, keepdims=True)
  zt_max = jnp.max(zt, -1, keepdims=True)
  weights = jnp.exp(zt - zt_max)
  lse_t = zt_max + jnp.log(jnp.sum(weights, -1, keepdims=True))
  tokens = draw._inverse_cdf_sample(key, weights)  # pylint: disable=protected-access
  pick = lambda x: jnp.take_along_axis(x, tokens[:, None], -1)[:, 0]  # noqa: E731
  return tokens, pick(z - lse), pick(zt - lse_t)


def median_ms(fn, z, repeats: int) -> float:
  jax.block_until_ready(fn(z, jax.random.key(0)))
  times = []
  for r in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(z, jax.random.key(r)))
    times.append(time.perf_counter() - start)
  return 1e3 * sorted(times)[len(times) // 2]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", nargs="+", default=["64x49152", "256x151936"])
  parser.add_argument("--scale", type=float, default=12.0)
  parser.add_argument("--repeats", type=int, default=7)
  args = parser.parse_args()
  out = {}
  for shape in args.shapes:
    rows, vocab = (int(x) for x in shape.split("x"))
    z = jax.random.normal(jax.random.key(0), (rows, vocab)) * args.scale
    for name, (options, ban) in SETTINGS.items():
      config = SamplingConfig(64, stop_ids=(1,), pad_id=0, **options)
      banned = jnp.arange(vocab) < 3 if ban else None
      ms = {label: median_ms(jax.jit(lambda z, k, f=f: f(z, k, config, banned)), z, args.repeats)
            for label, f in (("sorted_ms", sorted_draw), ("ms", draw.sample_token))}
      out[f"{shape}/{name}"] = {**{k: round(v, 2) for k, v in ms.items()},
                                "ratio": round(ms["sorted_ms"] / ms["ms"], 2)}
  print(json.dumps({"scale": args.scale, "draws": out, "device": jax.devices()[0].device_kind}))


if __name__ == "__main__":
  main()
