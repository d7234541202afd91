"""New tokens per second of generation: ppojax's compiled sampler vs transformers' ``generate``.

Table: docs/performance/decode.md, "Sampling vs transformers: `benchmarks/sampling.py`".

SmolLM2-135M-Instruct with identical weights in both, ~40-token chat prompts (left-padded), 64
new tokens sampled at temperature 1 with stop tokens suppressed until the 64th (min_new_tokens),
so both produce exactly batch × 64 tokens. Run side by side in one process:

    python benchmarks/sampling.py --batches 16 64 [--new-tokens 64] [--dtype float32]

Prints both figures, their ratio and ppojax's compile time per batch size; the last line is a
JSON object (figures of the largest batch, plus all rows). ``--dtype`` applies to both sides.

ppojax runs twice per batch: on the prompts as given (``ppojax_tokens_per_s``, the like-for-like
figure), and with the chat template's system header that every prompt begins with split off by
``split_shared_prefix`` and passed as ``generate(..., prefix=...)``: prefilled once for the
batch and attended with one matmul over all rows (``ppojax_shared_prefix_tokens_per_s``).
transformers' ``generate`` has no such option; it always runs the prompts as given. Both ppojax
runs use params converted once by ``decode_layout`` (as transformers' module is built once).
Like the CLI, the script restarts itself once with glibc's huge-page tunable (both libraries
then run on it; ``PPOJAX_HUGE_PAGES=0``: off).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from ppojax.infra import hostmem
from ppojax.models import hf, load_model
from ppojax.rollout.sampling import SamplingConfig, decode_layout, generate, split_shared_prefix

QUESTIONS = [
    "What is 17 + 25? Explain your steps briefly.",
    "Give me three tips for writing clear Python code and say why.",
    "Describe the water cycle in a few sentences for a child.",
    "Why is the sky blue? Keep the answer short but precise.",
]


def make_prompts(tokenizer, batch: int):
  texts = [tokenizer.apply_chat_template(
      [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}], tokenize=False,
      add_generation_prompt=True) for i in range(batch)]
  rows = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
  width = max(map(len, rows))
  tokens = np.full((batch, width), tokenizer.pad_token_id, np.int32)
  mask = np.zeros((batch, width), bool)
  for i, row in enumerate(rows):
    tokens[i, width - len(row):], mask[i, width - len(row):] = row, True
  return tokens, mask


def bench_ppojax(model, tokens, mask, new_tokens, repeats, prefix=None):
  """(median seconds per ``generate``, compile seconds); ``prefix``: shared by every row. The
  params are put in ``decode_layout`` once, as transformers' module is built once: otherwise
  every call copies every weight first (stacked → unrolled layers, fused projections)."""
  module, params = decode_layout(model.module, model.params)
  config = SamplingConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          stop_ids=(model.tokenizer.eos_token_id,),
                          pad_id=model.tokenizer.pad_token_id)
  prompts, prompt_mask = jnp.asarray(tokens), jnp.asarray(mask)
  prefix = None if prefix is None else jnp.asarray(prefix)
  run = lambda seed: jax.block_until_ready(generate(  # noqa: E731
      module, params, prompts, prompt_mask, jax.random.key(seed), config, prefix=prefix))
  t0 = time.perf_counter()
  out = run(0)
  first = time.perf_counter() - t0
  assert int(out.lengths.min()) == new_tokens, out.lengths
  times = []
  for seed in range(1, repeats + 1):
    t0 = time.perf_counter()
    run(seed)
    times.append(time.perf_counter() - t0)
  best = statistics.median(times)
  return best, first - best


def bench_transformers(model, tokens, mask, new_tokens, repeats, dtype):
  import torch  # pylint: disable=import-outside-toplevel

  torch.set_num_threads(os.cpu_count())
  net = hf.to_transformers(model.cfg, model.params).to(getattr(torch, dtype))
  ids, attn = torch.from_numpy(tokens).long(), torch.from_numpy(mask).long()

  def run(seed):
    torch.manual_seed(seed)
    with torch.no_grad():
      return net.generate(input_ids=ids, attention_mask=attn, do_sample=True, temperature=1.0,
                          top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, pad_token_id=model.tokenizer.pad_token_id,
                          eos_token_id=model.tokenizer.eos_token_id)

  out = run(0)  # warm-up
  assert out.shape[1] - tokens.shape[1] == new_tokens, out.shape
  times = []
  for seed in range(1, repeats + 1):
    t0 = time.perf_counter()
    run(seed)
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def main():
  hostmem.reexec_with_huge_pages()  # as the CLI does (PPOJAX_HUGE_PAGES=0: off)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batches", type=int, nargs="+", default=[16, 64])
  parser.add_argument("--new-tokens", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  parser.add_argument("--model", default="smollm2")
  args = parser.parse_args()

  model = load_model(args.model, dtype=args.dtype)
  print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), {os.cpu_count()} "
        f"CPUs; {args.model}, {args.new_tokens} new tokens, {args.dtype}; "
        f"huge_pages={hostmem.huge_pages_active()}")
  print(f"{'batch':>6}{'prompt':>8}{'shared':>8}{'ppojax tok/s':>14}{'(shared prefix)':>17}"
        f"{'transformers tok/s':>20}{'ratio':>8}{'(shared)':>10}{'compile s':>11}")
  rows = []
  for batch in args.batches:
    tokens, mask = make_prompts(model.tokenizer, batch)
    prefix, rest, rest_mask = split_shared_prefix(tokens, mask)
    n = batch * args.new_tokens
    ours, compile_s = bench_ppojax(model, tokens, mask, args.new_tokens, args.repeats)
    shared, _ = bench_ppojax(model, rest, rest_mask, args.new_tokens, args.repeats, prefix)
    theirs = bench_transformers(model, tokens, mask, args.new_tokens, args.repeats, args.dtype)
    row = {"batch": batch, "prompt_len": int(tokens.shape[1]), "shared_prefix_len": prefix.size,
           "ppojax_tokens_per_s": n / ours, "ppojax_shared_prefix_tokens_per_s": n / shared,
           "transformers_tokens_per_s": n / theirs, "ratio": theirs / ours,
           "ratio_shared_prefix": theirs / shared, "ppojax_compile_s": compile_s}
    rows.append(row)
    print(f"{batch:>6}{tokens.shape[1]:>8}{prefix.size:>8}{n / ours:>14.0f}{n / shared:>17.0f}"
          f"{n / theirs:>20.0f}{theirs / ours:>8.2f}{theirs / shared:>10.2f}{compile_s:>11.1f}",
          flush=True)
  largest = max(rows, key=lambda r: r["batch"])
  print(json.dumps({**largest, "new_tokens": args.new_tokens, "dtype": args.dtype,
                    "huge_pages": hostmem.huge_pages_active(),
                    "device": jax.devices()[0].device_kind, "rows": rows}))


if __name__ == "__main__":
  main()
