"""One decode step's attention, the fused kernel (``models.decode_kernel``) against the einsum
path (``attention.attend`` over keys [B, H_kv, D, S], the layout it reads) side by side in one
process: microseconds per layer and per row, the kernel's share of the bytes it must read (the
visible slots' keys and values) over its time, and the largest difference of their outputs.

Table: docs/performance/decode.md, "The decode loop's copies" (the fused decode attention's
item; its timings go there when first taken on a GPU).

    python benchmarks/decode_attention.py                 # on a GPU: Qwen2.5-0.5B's heads
    python benchmarks/decode_attention.py --small         # anywhere (Pallas's interpreter)

Rows fill a fraction ``--fill`` of the slots (the rest left padding), as a decode half-way
through its responses: the kernel reads only those, the einsum path all of them. bfloat16
(``--dtype``). Prints one JSON line per shape: {"shape", "fill", "kernel_us", "einsum_us",
"ratio" (einsum / kernel), "kernel_read_gbps", "max_abs_diff", "device"}.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from ppojax.models import decode_kernel
from ppojax.models.attention import attend

# (rows, query heads, KV heads, slots, head dim): Qwen2.5-0.5B (14/2, 64) and 1.5B (12/2, 128)
SHAPES = {"0.5b": (256, 14, 2, 640, 64), "1.5b": (256, 12, 2, 640, 128),
          "0.5b_b64": (64, 14, 2, 640, 64)}
SMALL = {"small": (4, 4, 2, 128, 16)}


def inputs(shape, fill: float, dtype):
  """q, keys [B, H_kv, S, D] (the kernel's) and their transpose (einsum's), values, visible."""
  b, h, hk, s, d = shape
  ks = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(ks[0], (b, h, d), dtype)
  k = jax.random.normal(ks[1], (b, hk, s, d), dtype)
  v = jax.random.normal(ks[2], (b, hk, s, d), dtype)
  first = np.random.default_rng(0).integers(0, int(s * (1 - fill)) + 1, b)
  visible = jnp.asarray(np.arange(s)[None] >= first[:, None])
  return q, k, jnp.swapaxes(k, -1, -2), v, visible


def median_us(fn, args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times)) * 1e6


def measure(name: str, shape, fill: float, dtype, repeats: int, interpret: bool) -> dict:
  q, k, k_t, v, visible = inputs(shape, fill, dtype)
  kernel = jax.jit(lambda q, k, v, m: decode_kernel.decode_attention(q, k, v, m,
                                                                     interpret=interpret))
  einsum = jax.jit(lambda q, k_t, v, m: attend(q[:, None], k_t, v, m[:, None], True)[:, 0])
  out_k, out_e = kernel(q, k, v, visible), einsum(q, k_t, v, visible)
  diff = float(jnp.max(jnp.abs(out_k.astype(jnp.float32) - out_e.astype(jnp.float32))))
  kernel_us = median_us(kernel, (q, k, v, visible), repeats)
  einsum_us = median_us(einsum, (q, k_t, v, visible), repeats)
  b, _, hk, _, d = shape
  read = 2 * int(visible.sum()) * hk * d * jnp.dtype(dtype).itemsize  # visible keys + values
  return {"shape": name, "rows_heads_kvheads_slots_dim": list(shape), "fill": fill,
          "dtype": jnp.dtype(dtype).name, "kernel_us": kernel_us, "einsum_us": einsum_us,
          "ratio": einsum_us / kernel_us, "kernel_read_gbps": read / kernel_us / 1e3,
          "max_abs_diff": diff, "interpret": interpret, "device": jax.devices()[0].device_kind}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--small", action="store_true", help="a tiny shape, Pallas's interpreter")
  parser.add_argument("--shapes", nargs="*", default=None, help=f"of {', '.join(SHAPES)}")
  parser.add_argument("--fill", type=float, default=0.6)
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--repeats", type=int, default=20)
  args = parser.parse_args(argv)
  interpret = args.small or jax.default_backend() != "gpu"
  shapes = SMALL if args.small else {n: SHAPES[n] for n in (args.shapes or SHAPES)}
  for name, shape in shapes.items():
    print(json.dumps(measure(name, shape, args.fill, jnp.dtype(args.dtype),
                             3 if interpret else args.repeats, interpret)), flush=True)


if __name__ == "__main__":
  main()
