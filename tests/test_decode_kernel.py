"""The fused decode attention (``models.decode_kernel``, Pallas; here in Pallas's interpreter):
equal to an independent NumPy softmax-attention over the visible slots (holes, left padding,
windows, soft-cap, grouped heads, several splits, bf16), how it blocks the slots, when "auto"
takes it, and generations with it equal to the einsum path's (one turn and multi-turn, scanned
and unrolled layers, several samples, a shared prefix)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from benchmark_script import load

from ppojax.models import CausalLM, ModelConfig, decode_kernel, init_params
from ppojax.models.attention import decode_path
from ppojax.models.cache import cache_length, init_cache, keys_transposed
from ppojax.rollout.multiturn import generate_turns
from ppojax.rollout.sampling import SamplingConfig, generate


def _reference(q, k, v, visible, scale_base=None, softcap=0.0):
  """softmax over the visible slots of (q·kᵀ/√D', capped), times v; float64; zeros where a row
  sees nothing. q [B, H, D], k and v [B, H_kv, S, D], visible [B, S]."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, h, d = q.shape
  g = h // k.shape[1]
  k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)  # head j reads KV head j // g
  s = np.einsum("bhd,bhsd->bhs", q, k) / np.sqrt(d if scale_base is None else scale_base)
  if softcap:
    s = softcap * np.tanh(s / softcap)
  seen = np.asarray(visible)[:, None, :]
  e = np.where(seen, np.exp(s - np.where(seen, s, -np.inf).max(-1, keepdims=True)), 0.0)
  out = np.einsum("bhs,bhsd->bhd", e, v) / np.maximum(e.sum(-1, keepdims=True), 1e-300)
  return np.where(seen.any(-1, keepdims=True), out, 0.0)


def _inputs(b, h, hk, s, d, dtype, seed=0):
  ks = jax.random.split(jax.random.key(seed), 4)
  q, k, v = (jax.random.normal(key, shape, jnp.float32).astype(dtype) for key, shape in
             zip(ks, ((b, h, d), (b, hk, s, d), (b, hk, s, d))))
  rng = np.random.default_rng(seed)
  visible = rng.random((b, s)) < 0.7  # holes
  pad = rng.integers(0, s // 2, b)
  now = rng.integers(s // 2, s, b)
  slots = np.arange(s)[None]
  visible &= (slots >= pad[:, None]) & (slots <= now[:, None])  # left padding, the current slot
  visible[np.arange(b), now] = True
  return q, k, v, jnp.asarray(visible)


CASES = {  # (B, H, H_kv, S, D, scale_base, softcap)
    "grouped_7": (3, 14, 2, 256, 64, None, 0.0),
    "mha_one_split": (2, 4, 4, 128, 32, None, 0.0),
    "one_row_several_splits": (1, 2, 1, 512, 16, None, 0.0),
    "gemma_scale_and_cap": (2, 8, 4, 96, 32, 24.0, 5.0),
}


@pytest.mark.parametrize("case", CASES)
def test_kernel_equals_a_numpy_reference_float32(case):
  b, h, hk, s, d, scale_base, softcap = CASES[case]
  q, k, v, visible = _inputs(b, h, hk, s, d, jnp.float32)
  out = decode_kernel.decode_attention(q, k, v, visible, scale_base, softcap, interpret=True)
  np.testing.assert_allclose(out, _reference(q, k, v, visible, scale_base, softcap),
                             atol=2e-6, rtol=1e-5)


def test_kernel_in_bfloat16_within_its_rounding():
  q, k, v, visible = _inputs(2, 14, 2, 256, 64, jnp.bfloat16, seed=1)
  out = decode_kernel.decode_attention(q, k, v, visible, interpret=True)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out, np.float32), _reference(q, k, v, visible),
                             atol=2e-2, rtol=2e-2)


def test_a_row_that_sees_nothing_gets_zeros_and_the_others_are_unchanged():
  q, k, v, visible = _inputs(3, 4, 2, 64, 16, jnp.float32, seed=2)
  visible = visible.at[1].set(False)
  out = decode_kernel.decode_attention(q, k, v, visible, interpret=True)
  assert np.all(np.asarray(out[1]) == 0)
  np.testing.assert_allclose(out, _reference(q, k, v, visible), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("slots", [16, 48, 96, 128, 640, 1008, 4096])
@pytest.mark.parametrize("rows", [1, 8, 256])
def test_blocking_tiles_the_slots(slots, rows):
  block, splits = decode_kernel.blocking(rows, 2, slots)
  assert block in (16, 32, 64, 128) and slots % block == 0
  assert (slots // block) % splits == 0
  assert block == max(b for b in (16, 32, 64, 128) if slots % b == 0)
  assert rows * 2 * splits >= decode_kernel.TARGET_PROGRAMS or splits == slots // block


def test_blocking_refuses_a_length_off_the_grid():
  with pytest.raises(ValueError, match="multiple of 16.*einsum"):
    decode_kernel.blocking(4, 2, 639)


@pytest.mark.parametrize("platform, dtype, head_dim, expected", [
    ("cuda", "bfloat16", 64, "pallas"), ("cuda", "float16", 128, "pallas"),
    ("cuda", "float32", 64, "einsum"), ("cuda", "bfloat16", 96, "einsum"),
    ("cuda", "bfloat16", 8, "einsum"), ("cpu", "bfloat16", 64, "einsum"),
    ("tpu", "bfloat16", 64, "einsum"), ("rocm", "bfloat16", 64, "einsum")])
def test_auto_takes_the_kernel_on_one_nvidia_gpu_in_half_precision(platform, dtype, head_dim,
                                                                  expected):
  assert decode_path("auto", dtype, head_dim, platform) == expected


def test_auto_keeps_einsum_under_a_mesh_of_several_devices():
  mesh = jax.sharding.AbstractMesh((2,), ("data",))
  with jax.sharding.use_abstract_mesh(mesh):
    assert decode_path("auto", "bfloat16", 64, "cuda") == "einsum"


def test_explicit_choices_and_a_wrong_one():
  assert decode_path("pallas", "float32", 8, "cpu") == "pallas"
  assert decode_path("einsum", "bfloat16", 64, "cuda") == "einsum"
  with pytest.raises(ValueError, match="auto, einsum or pallas"):
    decode_path("flash", "bfloat16", 64, "cuda")
  with pytest.raises(ValueError, match="decode_attention 'flash'"):
    TINY.replace(decode_attention="flash")


TINY = ModelConfig(model_type="llama", vocab_size=48, hidden_size=64, intermediate_size=64,
                   num_layers=2, num_heads=6, num_kv_heads=2, head_dim=16,
                   max_position_embeddings=96, norm_eps=1e-5, tie_word_embeddings=False)
STOP, PAD = 1, 0


def test_the_cache_stores_keys_as_the_kernel_reads_them():
  cfg = TINY.replace(decode_attention="pallas")
  assert not keys_transposed(cfg) and keys_transposed(TINY)
  assert cache_length(cfg, 639) == 640 and cache_length(TINY, 639) == 639
  cache = init_cache(cfg, 3, cache_length(cfg, 30))
  assert cache.k.shape == cache.v.shape == (2, 3, 2, 32, 16)


@pytest.fixture(scope="module")
def params():
  p = init_params(CausalLM(TINY), jax.random.key(0))
  return {**p, "lm_head": {"kernel": p["lm_head"]["kernel"] * 20.0}}  # peaked: tokens differ


def _prompts(rows=4, length=9, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(2, TINY.vocab_size, (rows, length)).astype(np.int32)
  mask = np.arange(length)[None] >= rng.integers(0, length - 1, rows)[:, None]
  return jnp.asarray(np.where(mask, tokens, PAD)), jnp.asarray(mask)


def _both(run, calls_kernel=True, attention="einsum"):
  """``run(module)`` with the einsum decode and with the kernel (host arrays); the kernel's
  program calls it (where ``calls_kernel``), the einsum one does not. ``attention``: the
  path of the passes over several tokens (``ModelConfig.attention``)."""
  out = []
  for path in ("einsum", "pallas"):
    module = CausalLM(TINY.replace(decode_attention=path, attention=attention))
    assert ("pallas_call" in str(jax.make_jaxpr(lambda: run(module))())) == (
        path == "pallas" and calls_kernel)
    out.append(jax.device_get(run(module)))
  return out


@pytest.mark.parametrize("layers, greedy, n", [("unroll", False, 1), ("scan", True, 1),
                                               ("unroll", False, 2)])
def test_generation_equals_the_einsum_decode(params, layers, greedy, n):
  prompts, mask = _prompts()
  config = SamplingConfig(20, stop_ids=(STOP,), pad_id=PAD, greedy=greedy, layers=layers,
                          num_samples_per_prompt=n)
  einsum, kernel = _both(lambda m: generate(m, params, prompts, mask, jax.random.key(3), config))
  np.testing.assert_array_equal(kernel.tokens, einsum.tokens)
  np.testing.assert_allclose(kernel.logprobs, einsum.logprobs, atol=1e-5)
  assert int(einsum.mask.sum()) > 2 * prompts.shape[0] * n  # several tokens compared


@pytest.mark.parametrize("layers", ["unroll", "scan"])
def test_generation_with_sliding_windows_and_a_soft_cap_equals_the_einsum_decode(layers):
  """Gemma-2-like layers: a window of 8 slots on the first layer (traced per layer in a scan:
  the kernel's visible range starts at the window), full attention on the second, scores
  soft-capped."""
  cfg = TINY.replace(layer_windows=(8, 0), attn_softcap=3.0)
  p = init_params(CausalLM(cfg), jax.random.key(1))
  p = {**p, "lm_head": {"kernel": p["lm_head"]["kernel"] * 20.0}}
  prompts, mask = _prompts()
  config = SamplingConfig(20, stop_ids=(STOP,), pad_id=PAD, layers=layers)
  out = []
  for path in ("einsum", "pallas"):
    module = CausalLM(cfg.replace(decode_attention=path))
    out.append(jax.device_get(generate(module, p, prompts, mask, jax.random.key(6), config)))
  np.testing.assert_array_equal(out[1].tokens, out[0].tokens)
  np.testing.assert_allclose(out[1].logprobs, out[0].logprobs, atol=1e-5)


def test_generation_with_a_shared_prefix_equals_the_einsum_decode(params):
  """The kernel takes no second key set: with a shared prefix the decode keeps the einsum path,
  over keys stored [.., S, D] (the prefix's transposed for it)."""
  prompts, mask = _prompts()
  config = SamplingConfig(12, stop_ids=(STOP,), pad_id=PAD, layers="unroll")
  prefix = jnp.asarray([3, 4, 5], jnp.int32)
  einsum, kernel = _both(lambda m: generate(m, params, prompts, mask, jax.random.key(4), config,
                                            prefix=prefix), calls_kernel=False)
  np.testing.assert_array_equal(kernel.tokens, einsum.tokens)
  np.testing.assert_allclose(kernel.logprobs, einsum.logprobs, atol=1e-5)


class _Echo:
  """Observations of 1–3 tokens (the rest of the turn's slots are holes in the cache)."""

  max_turns, obs_tokens = 3, 4

  def reset(self, key, prompts, prompt_mask):
    del key, prompt_mask
    return jnp.zeros(prompts.shape[:1], jnp.int32)

  def step(self, state, action, action_mask, turn):
    from ppojax.rollout.multiturn import EnvStep  # pylint: disable=import-outside-toplevel
    n = 1 + jnp.sum(jnp.where(action_mask, action, 0), axis=1) % 3
    cols = jnp.arange(self.obs_tokens)
    obs_mask = cols[None] >= self.obs_tokens - n[:, None]
    obs = jnp.broadcast_to(10 + cols[None] + turn, obs_mask.shape).astype(jnp.int32)
    return EnvStep(state + 1, obs, obs_mask, jnp.sum(action_mask, 1).astype(jnp.float32),
                   jnp.zeros(state.shape, bool), {})


@pytest.mark.parametrize("attention", ["einsum", "xla"])
def test_multiturn_generation_equals_the_einsum_decode(params, attention):
  """Each observation's forward pass attends over the cache from a later slot (its queries do
  not sit at slots 0 … T − 1): with keys stored for the kernel, also through
  ``jax.nn.dot_product_attention`` ("xla", the form cuDNN's path takes on a GPU)."""
  prompts, mask = _prompts()
  config = SamplingConfig(6, stop_ids=(STOP,), pad_id=PAD, num_samples_per_prompt=2,
                          layers="unroll")
  einsum, kernel = _both(lambda m: generate_turns(m, params, prompts, mask, jax.random.key(5),
                                                  config, _Echo()), attention=attention)
  np.testing.assert_array_equal(kernel.tokens, einsum.tokens)
  np.testing.assert_allclose(kernel.logprobs, einsum.logprobs, atol=1e-5)
  assert not np.all(einsum.seen)  # holes in the cache: turns that stopped early


def test_the_benchmark_runs_and_agrees_in_its_small_form(capsys):
  """benchmarks/decode_attention.py --small: one JSON line, the two paths' outputs within
  bfloat16 rounding (the GPU run's figures come from the same function)."""
  load("decode_attention").main(["--small"])
  row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert row["interpret"] and row["kernel_us"] > 0 and row["einsum_us"] > 0
  assert row["max_abs_diff"] < 2e-2, row
