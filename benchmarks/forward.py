"""Tokens/s of a batched forward and forward+backward pass: ppojax vs transformers (PyTorch).

Table: docs/performance/cpu.md, "Forward: `benchmarks/forward.py`".

Both run SmolLM2-135M-Instruct with identical weights (the GGUF dequantized once, handed to both)
on this machine, one after the other in the same process, so the ratio is comparable:

    python benchmarks/forward.py --batch 8 --seq-len 128 [--dtype float32|bfloat16]

Needs torch (``pip install torch==2.13.0``). The last line printed is a JSON object.
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

from ppojax.core import logprobs, ops
from ppojax.infra import hostmem
from ppojax.models import hf, load_model, positions_from_mask


def _time(fn, repeats: int) -> tuple[float, float]:
  """(first call incl. compilation, median of ``repeats`` further calls), in seconds."""
  t0 = time.perf_counter()
  fn()
  first = time.perf_counter() - t0
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return first, statistics.median(times)


def bench_ppojax(model, tokens, mask, repeats):
  module = model.module
  positions = positions_from_mask(mask)

  @jax.jit
  def forward(params, tokens):
    return module.apply({"params": params}, tokens, positions, mask)[0]

  def loss(params, tokens):
    logits = forward(params, tokens)
    logp = logprobs.selective_log_softmax(logits[:, :-1], tokens[:, 1:])
    return -ops.masked_mean(logp, mask[:, 1:])

  grad = jax.jit(jax.grad(loss))
  params = model.params
  fwd = _time(lambda: forward(params, tokens).block_until_ready(), repeats)
  bwd = _time(lambda: jax.block_until_ready(grad(params, tokens)), repeats)
  return fwd, bwd


def bench_torch(model, tokens, mask, repeats, dtype):
  import torch  # pylint: disable=import-outside-toplevel

  torch.set_num_threads(os.cpu_count())
  net = hf.to_transformers(model.cfg, model.params).to(getattr(torch, dtype))
  ids = torch.from_numpy(np.array(tokens)).long()
  attn = torch.from_numpy(np.array(mask)).long()

  def forward():
    with torch.no_grad():
      net(input_ids=ids, attention_mask=attn).logits

  def forward_backward():
    net.zero_grad(set_to_none=True)
    logits = net(input_ids=ids, attention_mask=attn).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    m = attn[:, 1:].float()
    (-(logp * m).sum() / m.sum()).backward()

  return _time(forward, repeats), _time(forward_backward, repeats)


def main():
  hostmem.reexec_with_huge_pages()  # as the CLI does (PPOJAX_HUGE_PAGES=0: off)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq-len", type=int, default=128)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  parser.add_argument("--model", default="smollm2")
  parser.add_argument("--remat", action="store_true", help="rematerialise each layer (ppojax)")
  args = parser.parse_args()

  model = load_model(args.model, dtype=args.dtype, remat=args.remat)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, model.cfg.vocab_size, (args.batch, args.seq_len)),
                       jnp.int32)
  mask = jnp.ones((args.batch, args.seq_len), bool)
  n_tokens = args.batch * args.seq_len
  print(f"device: {jax.devices()[0].device_kind}, {os.cpu_count()} CPUs; model {args.model}, "
        f"batch {args.batch} x {args.seq_len} tokens, {args.dtype}, remat={args.remat}; "
        f"huge_pages={hostmem.huge_pages_active()}")

  (jf_first, jf), (jb_first, jb) = bench_ppojax(model, tokens, mask, args.repeats)
  (tf_first, tf), (tb_first, tb) = bench_torch(model, tokens, mask, args.repeats, args.dtype)
  rows = [("forward", jf, tf, jf_first), ("forward+backward", jb, tb, jb_first)]
  print(f"{'pass':<18}{'ppojax tok/s':>14}{'torch tok/s':>14}{'ratio':>8}{'compile s':>11}")
  for name, j, t, first in rows:
    print(f"{name:<18}{n_tokens / j:>14.0f}{n_tokens / t:>14.0f}{t / j:>8.2f}"
          f"{first - j:>11.1f}")
  print(json.dumps({
      "batch": args.batch, "seq_len": args.seq_len, "dtype": args.dtype, "remat": args.remat,
      "huge_pages": hostmem.huge_pages_active(),
      "ppojax_forward_tokens_per_s": n_tokens / jf, "torch_forward_tokens_per_s": n_tokens / tf,
      "ppojax_fwd_bwd_tokens_per_s": n_tokens / jb, "torch_fwd_bwd_tokens_per_s": n_tokens / tb,
      "forward_ratio": tf / jf, "fwd_bwd_ratio": tb / jb,
      "ppojax_compile_s": {"forward": jf_first - jf, "fwd_bwd": jb_first - jb},
  }))


if __name__ == "__main__":
  main()
