"""Where a held-out evaluation's time goes: lowering, compiling and running the greedy decode
(``evaluation._generate``) of a SmolLM2-135M-shaped model with random weights (compile time does
not depend on the values), 56 prompts of 40 tokens, 24 new tokens.

    python benchmarks/decode_compile.py [--small] [--runs 3]

Prints one JSON line: seconds to lower, to compile, and each run after; the device and the CPU.
``--small``: a 2-layer, width-64 model (a quick check that the script works). Measured on an
H200 and this CPU in docs/performance.md#gpu; ``XLA_FLAGS=--xla_gpu_autotune_level=0`` in the
environment compiles without the GPU's autotuning.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from ppojax.models import CausalLM, init_params
from ppojax.models.config import ModelConfig
from ppojax.rollout.sampling import SamplingConfig
from ppojax.run import evaluation

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from algorithms import machine  # noqa: E402

SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
               num_kv_heads=3, head_dim=64)
SMALL = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1,
             head_dim=32)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--small", action="store_true")
  parser.add_argument("--runs", type=int, default=3)
  args = parser.parse_args(argv)
  cfg = ModelConfig(model_type="llama", vocab_size=49152, max_position_embeddings=2048,
                    norm_eps=1e-5, tie_word_embeddings=True, rope_theta=1e5, eos_token_id=2,
                    pad_token_id=2, **(SMALL if args.small else SMOLLM2))
  module = CausalLM(cfg)
  params = init_params(module, jax.random.key(0))
  sampling = SamplingConfig(max_new_tokens=24, stop_ids=(2,), pad_id=2, greedy=True)
  tokens = jnp.asarray(np.random.default_rng(0).integers(3, 1000, (56, 40)), jnp.int32)
  mask = jnp.ones_like(tokens, dtype=bool)
  key = jax.random.key(0)
  t = time.perf_counter()
  generate = evaluation._generate  # pylint: disable=protected-access
  lowered = generate.lower(module, params, tokens, mask, key, sampling)
  lower_s = time.perf_counter() - t
  t = time.perf_counter()
  compiled = lowered.compile()
  compile_s = time.perf_counter() - t
  runs = []
  for _ in range(args.runs):
    t = time.perf_counter()
    jax.block_until_ready(compiled(params, tokens, mask, key))
    runs.append(time.perf_counter() - t)
  print(json.dumps({"model": "small" if args.small else "smollm2-135m", "lower_s": lower_s,
                    "compile_s": compile_s, "run_s": runs, "machine": machine()}))


if __name__ == "__main__":
  main()
