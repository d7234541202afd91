"""The matmul floor of generation on this CPU: the fastest ``generate`` could possibly be, against
transformers' measured ``generate``, side by side in one run.

Table: docs/performance/decode.md, "Decode floor: `benchmarks/decode_floor.py`".

    python benchmarks/decode_floor.py [--batches 16 64] [--new-tokens 64]

With the settings of ``benchmarks/sampling.py`` (SmolLM2-135M-Instruct, float32, its ~45-token
chat prompts, 64 new tokens), a generation does at least these matmuls:

    prefill  B·P token rows through every layer's projections (q/k/v, o, gate/up, down)
    decode   R − 1 steps, each B rows through every layer's projections and the LM head

This script times exactly those products, nothing else (no attention, norms, sampling or
cache writes), in JAX (XLA:CPU, float32, fused q/k/v and gate/up as ppojax decodes) in two
forms — every weight, the LM head's included, as x·W with W [in, out]; and as ppojax decodes,
``weight_matmul(x, W, 1)`` with W [out, in], which on CPU takes ``columns_matmul`` (W·xᵀ)ᵀ for
at most ``FEW_ROWS`` rows — and in PyTorch (``F.linear``, as transformers runs them), takes the
fastest per shape, and adds them up to a floor on the seconds per ``generate`` call. Then it
runs transformers' ``generate`` as ``sampling.py`` does and prints

    ceiling = (B·R / floor seconds) / transformers' tokens/s

the largest speed-up over transformers any implementation with these matmul kernels could
show. Where the ceiling is below a goal, no change outside the matmul kernels reaches it. The
last line is a JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from ppojax.infra import hostmem
from ppojax.models import load_model
from ppojax.models.kernels import weight_matmul

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import sampling as sampling_bench  # noqa: E402  pylint: disable=wrong-import-position


def median_seconds(fn, repeats: int) -> float:
  fn()  # warm-up (and compilation)
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def layer_shapes(cfg) -> list[tuple[int, int]]:
  """(in, out) of one layer's projections, q/k/v and gate/up each as one matmul."""
  d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
  return [(d, (cfg.num_heads + 2 * cfg.num_kv_heads) * hd), (cfg.num_heads * hd, d), (d, 2 * f),
          (f, d)]


def time_jax(rows: int, shapes: list[tuple[int, int]], copies: int, repeats: int,
             transposed: bool = False) -> float:
  """Seconds for ``rows`` × every (in, out) product, ``copies`` distinct weights of each (the
  layers: distinct weights stream from memory as in a real step). ``transposed``: weights
  [out, in], multiplied as ppojax's decode layout does (``weight_matmul(x, W, 1)``); else x·W."""
  rng = np.random.default_rng(0)
  xs = [jnp.asarray(rng.standard_normal((rows, k), np.float32)) for k, _ in shapes]
  ws = [[jnp.asarray(rng.standard_normal((n, k) if transposed else (k, n), np.float32))
         for _ in range(copies)] for k, n in shapes]
  product = (lambda x, w: weight_matmul(x, w, 1)) if transposed else jnp.matmul
  f = jax.jit(lambda xs, ws: [[product(x, w) for w in group] for x, group in zip(xs, ws)])
  return median_seconds(lambda: jax.block_until_ready(f(xs, ws)), repeats)


def time_torch(rows: int, shapes: list[tuple[int, int]], copies: int, repeats: int) -> float:
  import torch  # pylint: disable=import-outside-toplevel
  torch.set_num_threads(os.cpu_count())
  gen = torch.Generator().manual_seed(0)
  xs = [torch.randn(rows, k, generator=gen) for k, _ in shapes]
  ws = [[torch.randn(n, k, generator=gen) for _ in range(copies)] for k, n in shapes]

  def run():
    with torch.no_grad():
      return [[torch.nn.functional.linear(x, w) for w in group] for x, group in zip(xs, ws)]
  return median_seconds(run, repeats)


def main():
  hostmem.reexec_with_huge_pages()  # as sampling.py (both libraries run on it)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batches", type=int, nargs="+", default=[16, 64])
  parser.add_argument("--new-tokens", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()

  model = load_model("smollm2")
  cfg = model.cfg
  body, head = layer_shapes(cfg), [(cfg.hidden_size, cfg.vocab_size)]
  print(f"device: {jax.devices()[0].device_kind}, {os.cpu_count()} CPUs; SmolLM2-135M, "
        f"float32, {args.new_tokens} new tokens; huge_pages={hostmem.huge_pages_active()}")
  print(f"{'batch':>6}{'part':>9}{'rows':>7}{'jax x·W s':>11}{'jax ppojax s':>14}{'torch s':>9}"
        f"{'GFLOP/s':>9}")
  rows_out = []
  for batch in args.batches:
    tokens, mask = sampling_bench.make_prompts(model.tokenizer, batch)
    prompt_len = tokens.shape[1]
    parts = {  # name: (rows, shapes, copies, how many times per generate call)
        "prefill": (batch * prompt_len, body, cfg.num_layers, 1),
        "decode": (batch, body, cfg.num_layers, args.new_tokens - 1),
        "lm head": (batch, head, 1, args.new_tokens),  # the prefill's last slot + R − 1 steps
    }
    floor = 0.0
    for name, (rows, shapes, copies, times) in parts.items():
      t_jax = time_jax(rows, shapes, copies, args.repeats)
      t_ours = time_jax(rows, shapes, copies, args.repeats, transposed=True)
      t_torch = time_torch(rows, shapes, copies, args.repeats)
      flop = 2 * rows * copies * sum(k * n for k, n in shapes)
      best = min(t_jax, t_ours, t_torch)
      floor += times * best
      print(f"{batch:>6}{name:>9}{rows:>7}{t_jax:>11.4f}{t_ours:>14.4f}{t_torch:>9.4f}"
            f"{flop / best / 1e9:>9.0f}", flush=True)
    n = batch * args.new_tokens
    theirs = sampling_bench.bench_transformers(model, tokens, mask, args.new_tokens, args.repeats,
                                               "float32")
    row = {"batch": batch, "prompt_len": int(prompt_len), "floor_seconds": floor,
           "floor_tokens_per_s": n / floor, "transformers_tokens_per_s": n / theirs,
           "ceiling_ratio": theirs / floor}
    rows_out.append(row)
    print(f"batch {batch}: matmul floor {floor:.2f} s per generate = {n / floor:.0f} tokens/s at "
          f"most; transformers {n / theirs:.0f} tokens/s; ceiling {theirs / floor:.2f}x",
          flush=True)
  print(json.dumps({"rows": rows_out, "new_tokens": args.new_tokens,
                    "device": jax.devices()[0].device_kind, "cpus": os.cpu_count()}))


if __name__ == "__main__":
  main()
