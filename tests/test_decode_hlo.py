"""benchmarks/decode_hlo.py (issue 62, items 1 and 5): its reading of optimized HLO on a
hand-written module, and ``generate`` of a small model compiled for each back end: in the layers
``SamplingConfig.layers="auto"`` chooses, the token loop copies no weight and no KV cache
(unrolled for the GPU's layout, compiled here by XLA:CPU; scanned for XLA:TPU, which reads the
stacked slices in place), and writes at most two vocabulary-sized arrays per step."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest
from benchmark_script import load

from ppojax.rollout.sampling import SamplingConfig

decode_hlo = load("decode_hlo")
SCRIPT = pathlib.Path(decode_hlo.__file__)


def _cuda_plugin() -> bool:
  try:
    return importlib.util.find_spec("jax_plugins.xla_cuda13") is not None
  except ModuleNotFoundError:  # no jax_plugins namespace at all
    return False

# batch 2, 5 new tokens, vocabulary 100; one layer's weight bf16[4, 8] of a stacked [3, 4, 8]
HLO = """HloModule toy, entry_computation_layout={()->()}

%fused_slice (p0: bf16[3,4,8], p1: s32[]) -> bf16[4,8] {
  %p0 = bf16[3,4,8]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %c = s32[] constant(0)
  %ds = bf16[1,4,8]{2,1,0} dynamic-slice(%p0, %p1, %c, %c), dynamic_slice_sizes={1,4,8}
  %f = f32[1,4,8]{2,1,0} convert(%ds)
  %g = bf16[1,4,8]{2,1,0} convert(%f)
  ROOT %b = bf16[4,8]{1,0} bitcast(%g)
}

%fused_cast (p0: bf16[2,100]) -> f32[2,100] {
  %p0 = bf16[2,100]{1,0} parameter(0)
  ROOT %cv = f32[2,100]{1,0} convert(%p0)
}

%fused_exp (p0: f32[2,100]) -> f32[2,100] {
  %p0 = f32[2,100]{1,0} parameter(0)
  ROOT %e = f32[2,100]{1,0} exponential(%p0)
}

%fused_write (p0: s32[2,5], p1: s32[2,1], p2: s32[]) -> s32[2,5] {
  %p0 = s32[2,5]{1,0} parameter(0)
  %p1 = s32[2,1]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %z = s32[] constant(0)
  %c = s32[2,1]{1,0} copy(%p1)
  ROOT %u = s32[2,5]{1,0} dynamic-update-slice(%p0, %c, %z, %p2)
}

%layer_body (arg: (s32[], bf16[3,4,8])) -> (s32[], bf16[3,4,8]) {
  %arg = (s32[], bf16[3,4,8]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %w = bf16[3,4,8]{2,1,0} get-tuple-element(%arg), index=1
  %slice = bf16[4,8]{1,0} fusion(%w, %i), kind=kLoop, calls=%fused_slice
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], bf16[3,4,8]{2,1,0}) tuple(%next, %w)
}

%layer_cond (arg: (s32[], bf16[3,4,8])) -> pred[] {
  %arg = (s32[], bf16[3,4,8]{2,1,0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

%token_body (arg: (s32[], s32[2,5], bf16[3,4,8], bf16[2,100])) -> (s32[], s32[2,5], bf16[3,4,8], bf16[2,100]) {
  %arg = (s32[], s32[2,5]{1,0}, bf16[3,4,8]{2,1,0}, bf16[2,100]{1,0}) parameter(0)
  %t = s32[] get-tuple-element(%arg), index=0
  %tokens = s32[2,5]{1,0} get-tuple-element(%arg), index=1
  %w = bf16[3,4,8]{2,1,0} get-tuple-element(%arg), index=2
  %x = bf16[2,100]{1,0} get-tuple-element(%arg), index=3
  %zero = s32[] constant(0)
  %state = (s32[], bf16[3,4,8]{2,1,0}) tuple(%zero, %w)
  %layers = (s32[], bf16[3,4,8]{2,1,0}) while(%state), condition=%layer_cond, body=%layer_body, backend_config={"known_trip_count":{"n":"3"}}
  %logits = f32[2,100]{1,0} fusion(%x), kind=kLoop, calls=%fused_cast
  %e = f32[2,100]{1,0} fusion(%logits), kind=kLoop, calls=%fused_exp
  %cp = f32[2,100]{1,0} copy(%e)
  %new = s32[2,1]{1,0} constant({ {1}, {2} })
  %written = s32[2,5]{1,0} fusion(%tokens, %new, %t), kind=kLoop, calls=%fused_write
  ROOT %out = (s32[], s32[2,5]{1,0}, bf16[3,4,8]{2,1,0}, bf16[2,100]{1,0}) tuple(%t, %written, %w, %x)
}

%token_cond (arg: (s32[], s32[2,5], bf16[3,4,8], bf16[2,100])) -> pred[] {
  %arg = (s32[], s32[2,5]{1,0}, bf16[3,4,8]{2,1,0}, bf16[2,100]{1,0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

ENTRY %main (w: bf16[3,4,8], x: bf16[2,100]) -> s32[2,5] {
  %w = bf16[3,4,8]{2,1,0} parameter(0)
  %x = bf16[2,100]{1,0} parameter(1)
  %zero = s32[] constant(0)
  %prefill_state = (s32[], bf16[3,4,8]{2,1,0}) tuple(%zero, %w)
  %prefill = (s32[], bf16[3,4,8]{2,1,0}) while(%prefill_state), condition=%layer_cond, body=%layer_body, backend_config={"known_trip_count":{"n":"3"}}
  %tokens = s32[2,5]{1,0} constant({ {0,0,0,0,0}, {0,0,0,0,0} })
  %init = (s32[], s32[2,5]{1,0}, bf16[3,4,8]{2,1,0}, bf16[2,100]{1,0}) tuple(%zero, %tokens, %w, %x)
  %loop = (s32[], s32[2,5]{1,0}, bf16[3,4,8]{2,1,0}, bf16[2,100]{1,0}) while(%init), condition=%token_cond, body=%token_body
  ROOT %r = s32[2,5]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_a_hand_written_module_is_read_as_documented():
  report = decode_hlo.analyse(HLO, batch=2, new=5, vocab=100, kv_shapes=set(),
                              weight_shapes={(4, 8), (3, 4, 8)})
  assert report["token_loop"] == "loop"
  # the layer's weight slice (bf16[4, 8], 64 bytes) three times, and the copy of exp's output;
  # not the cast, nor the in-place write of the token buffer
  assert report["weight_copy_bytes_per_step"] == 3 * 64
  assert report["other_copy_bytes_per_step"] == 2 * 100 * 4
  assert report["copy_bytes_per_step"] == 3 * 64 + 800
  assert [(c["name"], c["per_step"]) for c in report["top_copies"]] == [("cp", 1), ("slice", 3)]
  assert report["vocab_arrays_per_step"] == 3  # the cast, exp and the copy
  # every output but the constants, tuples and the in-place write: per layer the slice and the
  # counter's add (s32, 4 bytes), then the cast, exp and the copy
  assert report["written_bytes_per_step"] == 3 * (64 + 4) + 3 * 800
  assert report["top_writes"][0] == {"shape": "f32[2,100]", "bytes_per_step": 2400}
  assert report["notes"] == []


def _compiled(layers: str, dtype: str = "bfloat16", batch: int = 8):
  cfg = decode_hlo.MODELS["small"]().replace(vocab_size=4096, dtype=dtype, param_dtype=dtype)
  prompt, new = 16, 8
  config = SamplingConfig(max_new_tokens=new, min_new_tokens=new, stop_ids=(0,), pad_id=0,
                          layers=layers)
  got = decode_hlo.compile_generate(cfg, batch, prompt, config)
  report = decode_hlo.analyse(got.hlo, batch, new, cfg.vocab_size, got.kv_shapes,
                              got.weight_shapes)
  return got, report


@pytest.fixture(scope="module")
def scanned():
  return _compiled("scan")


def test_the_shape_of_the_small_model_is_counted(scanned):
  got, report = scanned
  # K and V: 2 layers × 8 rows × 1 KV head × 32 × (16 + 8 − 1) slots, bfloat16
  assert got.kv_bytes == 2 * 2 * 8 * 32 * 23 * 2
  assert got.kv_shapes == {(8, 32, 23), (8, 23, 32)}  # [B, H_kv, D, S], [B, H_kv, S, D]: 1s dropped
  assert got.weight_bytes > 4096 * 64 * 2  # the embedding and more, in bfloat16
  assert report["token_loop"] and report["notes"] == []
  assert report["copy_bytes_per_step"] == sum(
      report[f"{k}_copy_bytes_per_step"] for k in ("kv", "weight", "other"))


def test_unrolled_layers_copy_no_weight_and_no_cache():
  _, report = _compiled("unroll")
  assert report["kv_copy_bytes_per_step"] == report["weight_copy_bytes_per_step"] == 0


def test_scanned_layers_copy_each_layer_out_of_the_stacked_arrays_on_this_compiler(scanned):
  """Why "auto" unrolls outside TPUs: XLA:CPU (and XLA:GPU for the weights, ``--target gpu``)
  copies each layer's slices out of the stacked arrays on every token."""
  got, report = scanned
  copied = report["kv_copy_bytes_per_step"] + report["weight_copy_bytes_per_step"]
  assert copied > decode_hlo.GOAL_FRACTION * (got.weight_bytes + got.kv_bytes), report


def test_the_default_layers_copy_little_of_the_weights_and_cache():
  got, report = _compiled("auto")
  assert got.layers == "unroll"  # as on a GPU
  copied = report["kv_copy_bytes_per_step"] + report["weight_copy_bytes_per_step"]
  assert copied <= decode_hlo.GOAL_FRACTION * (got.weight_bytes + got.kv_bytes), report


def test_the_token_loop_carries_no_table_of_every_steps_rope(scanned):
  """Each step gathers its own RoPE rows [B, 1, 1, D]: a [B, R − 1, 1, D] table of every step's
  (67 MB per table at 256 × 512) in the loop's carry was moved between memory spaces on every
  step by XLA:TPU (``--target tpu``: 1.26 → 0.59 GB written per step without it)."""
  got, _ = scanned
  comps = decode_hlo.parse_hlo(got.hlo)
  carry = decode_hlo.token_loop(comps, 8, 8).type
  assert "f32[8,7,1,32]" not in carry, carry  # B = 8, R − 1 = 7, head dim 32


def test_sampling_writes_few_vocabulary_sized_arrays():
  """The logits and, with stop tokens banned before ``min_new_tokens`` (forced here), the
  banned select; in float32, as XLA:CPU computes a bfloat16 LM head in float32 and casts its
  output down and back up (two arrays a GPU's head does not write: ``--target gpu`` counts 1).
  More than ``kernels.FEW_ROWS`` rows: with fewer, XLA:CPU's tied head runs ``columns_matmul``,
  whose [V, B] output is transposed (a third array, on CPUs only)."""
  _, report = _compiled("auto", dtype="float32", batch=128)  # > FEW_ROWS: see below
  assert report["vocab_arrays_per_step"] <= decode_hlo.GOAL_VOCAB_ARRAYS, report["vocab_arrays"]


def _script(*args: str) -> dict:
  """benchmarks/decode_hlo.py in a child process (libtpu and JAX's CUDA plugin stay out of the
  test workers, as in tests/test_aot.py), its JSON line."""
  done = subprocess.run([sys.executable, str(SCRIPT), "--small", "--batch", "8", "--prompt", "16",
                         "--new", "8", *args], capture_output=True, text=True, timeout=600,
                        check=False, env=dict(os.environ, JAX_PLATFORMS="cpu",
                                              ALLOW_MULTIPLE_LIBTPU_LOAD="1"))
  assert done.returncode == 0, done.stderr[-3000:]
  return json.loads(done.stdout.strip().splitlines()[-1])


def test_xla_tpu_reads_the_scanned_layers_slices_in_place():
  """Scanned, as "auto" decodes for a TPU: XLA:TPU fuses the layer's slices into their users
  (at the suite's 0.5B shape it copies none; at this small one it copies a layer's K and V,
  11.8 KB each, as cheap). Its layer loop has no known trip count, so the reader counts one
  layer: scaled by the two layers here."""
  pytest.importorskip("libtpu", reason="the TPU target compiles with libtpu")
  report = _script("--target", "tpu")
  assert report["layers"] == "scan"  # "auto" for a TPU
  copied = 2 * (report["kv_copy_bytes_per_step"] + report["weight_copy_bytes_per_step"])
  total = report["weight_bytes"] + report["kv_cache_bytes"]
  assert copied <= decode_hlo.GOAL_FRACTION * total, report


@pytest.mark.skipif(not _cuda_plugin(),
                    reason="the GPU target needs JAX's CUDA plugin (decode_hlo.CUDA_INSTALL)")
def test_xla_gpu_copies_no_layer_and_writes_one_vocabulary_array():
  report = _script("--target", "gpu", "--dtype", "bfloat16", "--min-new-tokens", "0",
                   "--new", "25")  # 40 slots, 48 in the cache: not the head dim (32)
  assert report["layers"] == "unroll"
  assert report["kv_copy_bytes_per_step"] == report["weight_copy_bytes_per_step"] == 0, report
  assert report["vocab_arrays_per_step"] == 1, report["vocab_arrays"]
  # the fused decode attention: no [.., S] scores or probabilities written
  assert report["decode_attention"] == "pallas" and report["cache_slots"] == 48, report
  assert report["score_bytes_per_step"] == 0, report["top_writes"]


def test_the_einsum_decode_writes_its_scores_and_the_reader_sees_them(scanned):
  """On this CPU the decode keeps the einsum path, whose float32 scores [B·H_kv, G, S] and
  probabilities are written every layer: what ``score_bytes_per_step`` counts."""
  got, report = scanned
  assert got.decode_attention == "einsum"
  scores = decode_hlo.analyse(got.hlo, 8, 8, 4096, got.kv_shapes, got.weight_shapes,
                              got.slots)["score_bytes_per_step"]
  assert scores >= 8 * 2 * 23 * 4, report["top_writes"]  # a layer's float32 scores at least
