"""Where a generation's time goes: lowering, compiling and running the decode of a model with
random weights (compile time does not depend on the values), with its layers scanned (one layer
body) or unrolled (``SamplingConfig.layers``).

Tables: docs/performance/decode.md, "Scanned or unrolled layers on a GPU";
docs/performance/compiling.md, "Layers that differ by type: Gemma 3's decode"; the decode-alone
figures of docs/scale-memory.md, "Compile seconds, by program".

    python benchmarks/decode_compile.py [--layers scan|unroll|auto] [--model smollm2] [--runs 3]
        [--dtype bfloat16]
    python benchmarks/decode_compile.py --tpu v5e:1x1 --model qwen2.5-0.5b --layers scan
    python benchmarks/decode_compile.py --model gemma3-270m[-uniform] --layers scan|unroll

Here: the held-out evaluation's greedy decode (``evaluation._generate``) of a SmolLM2-135M-shaped
model, by default 56 prompts of 40 tokens and 24 new tokens, every row decoding all of them
(``min_new_tokens``), so ``run_s`` / ``new`` is the time per decode step. ``--tpu TOPOLOGY``:
``sampling.generate`` alone compiled deviceless for the topology's first chip (libtpu; weights
as ``ShapeDtypeStruct``s in bfloat16), by default 64 prompts of 256 tokens and 256 new tokens;
nothing runs. ``--small``: a 2-layer, width-64 model (a quick check that the script works).

Prints one JSON line: seconds to lower, to compile, each run after and per decode step; the
device compiled for and the CPU. Figures: docs/performance.md#gpu; ``XLA_FLAGS=
--xla_gpu_autotune_level=0`` in the environment compiles without the GPU's autotuning.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from ppojax.models import CausalLM, init_params, public
from ppojax.models.config import ModelConfig
from ppojax.rollout.sampling import SamplingConfig, decode_layers, generate
from ppojax.run import evaluation

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from algorithms import machine  # noqa: E402

_SMOL = dict(model_type="llama", vocab_size=49152, max_position_embeddings=2048, norm_eps=1e-5,
             tie_word_embeddings=True, rope_theta=1e5, eos_token_id=2, pad_token_id=2)
MODELS = {
    "smollm2-135m": lambda: ModelConfig(
        hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
        head_dim=64, **_SMOL),
    "small": lambda: ModelConfig(
        hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1,
        head_dim=32, **_SMOL),
    "qwen2.5-0.5b": lambda: ModelConfig.from_hf(public.lookup("Qwen/Qwen2.5-0.5B")),
    "qwen3-0.6b": lambda: ModelConfig.from_hf(public.lookup("Qwen/Qwen3-0.6B")),
    # Gemma 3's layers differ by type (5 sliding with a local RoPE base to 1 full): in a scan
    # each layer's window and RoPE table index are scanned inputs; "-uniform" is the same model
    # with every layer full and one RoPE, what that per-layer index costs to compile and run
    "gemma3-270m": lambda: ModelConfig.from_hf(public.lookup("google/gemma-3-270m")),
    "gemma3-270m-uniform": lambda: ModelConfig.from_hf(public.lookup("google/gemma-3-270m"))
    .replace(layer_windows=None, local_rope_theta=None),
}
# (batch, prompt length, new tokens): the CPU's held-out evaluation, and a TPU rollout
SHAPES = {"cpu": (56, 40, 24), "tpu": (64, 256, 256)}


def tpu_device(topology: str):
  """The first chip of a TPU ``topology`` such as "v5e:1x1", without the TPU (libtpu)."""
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  one_chip = {"chips_per_host_bounds": [1, 1, 1]} if topology.endswith(":1x1") else {}
  return topologies.get_topology_desc(platform="tpu", topology_name=topology,
                                      **one_chip).devices[0]


def _on_tpu(cfg: ModelConfig, topology: str, batch: int, prompt: int):
  """(compile function, params, tokens, mask, key): ``generate`` alone, its inputs abstract
  and placed on a one-device mesh of the topology's first chip."""
  mesh = jax.sharding.Mesh(np.array([tpu_device(topology)]).reshape(1, 1, 1),
                           ("data", "fsdp", "tensor"))
  placed = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placed)  # noqa: E731
  params = jax.tree.map(abstract, jax.eval_shape(
      lambda: init_params(CausalLM(cfg), jax.random.key(0))))
  tokens = jax.ShapeDtypeStruct((batch, prompt), jnp.int32, sharding=placed)
  mask = jax.ShapeDtypeStruct((batch, prompt), jnp.bool_, sharding=placed)
  key = abstract(jax.eval_shape(lambda: jax.random.key(0)))
  return generate, params, tokens, mask, key


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", choices=("auto", "scan", "unroll"), default="auto")
  parser.add_argument("--model", choices=tuple(MODELS), default="smollm2-135m")
  parser.add_argument("--small", action="store_true", help="--model small")
  parser.add_argument("--tpu", default="", help="compile deviceless for this TPU topology")
  parser.add_argument("--batch", type=int)
  parser.add_argument("--prompt", type=int)
  parser.add_argument("--new", type=int)
  parser.add_argument("--runs", type=int, default=3)
  parser.add_argument("--decode-attention", choices=("auto", "einsum", "pallas"), default="auto",
                      help="ModelConfig.decode_attention: auto takes the fused kernel on a GPU "
                      "in bf16/fp16")
  parser.add_argument("--dtype", default=None, help="the model's dtype (default: float32, "
                      "ModelConfig's; bfloat16 with --tpu)")
  args = parser.parse_args(argv)
  name = "small" if args.small else args.model
  cfg = MODELS[name]().replace(decode_attention=args.decode_attention)
  if args.dtype:
    cfg = cfg.replace(dtype=args.dtype, param_dtype=args.dtype)
  batch, prompt, new = SHAPES["tpu" if args.tpu else "cpu"]
  batch, prompt, new = args.batch or batch, args.prompt or prompt, args.new or new
  sampling = SamplingConfig(max_new_tokens=new, min_new_tokens=new, stop_ids=(2,), pad_id=2,
                            greedy=True, layers=args.layers)
  if args.tpu and not args.dtype:
    cfg = cfg.replace(dtype="bfloat16", param_dtype="bfloat16")
    program, params, tokens, mask, key = _on_tpu(cfg, args.tpu, batch, prompt)
  else:
    program = evaluation._generate  # pylint: disable=protected-access
    params = init_params(CausalLM(cfg), jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 1000, (batch, prompt)), jnp.int32)
    mask, key = jnp.ones_like(tokens, dtype=bool), jax.random.key(0)
  t = time.perf_counter()
  lowered = program.lower(CausalLM(cfg), params, tokens, mask, key, sampling)
  lower_s = time.perf_counter() - t
  t = time.perf_counter()
  compiled = lowered.compile()
  compile_s = time.perf_counter() - t
  runs = []
  for _ in range(0 if args.tpu else args.runs):
    t = time.perf_counter()
    jax.block_until_ready(compiled(params, tokens, mask, key))
    runs.append(time.perf_counter() - t)
  target = tpu_device(args.tpu).device_kind + f" ({args.tpu})" if args.tpu else None
  print(json.dumps({
      "model": name, "dtype": cfg.dtype, "layers": decode_layers(args.layers, params),
      "decode_attention": args.decode_attention,
      "batch": batch,
      "prompt": prompt, "new": new, "lower_s": lower_s, "compile_s": compile_s, "run_s": runs,
      "step_ms": [1e3 * r / new for r in runs], "compiled_for": target or "here",
      "machine": machine()}))


if __name__ == "__main__":
  main()
