"""Attention paths: ``jax.nn.dot_product_attention`` ("xla"; "cudnn" on a GPU) against the
einsum path (``attention.attend``), on CPU — the attention function alone and whole tiny models:
outputs and gradients at real tokens, causal, left padding, grouped-query heads, sliding
windows, a prefill into a KV cache; and which path ``attention_path`` picks on each platform.

Tolerances: float32, max |Δ| ≤ 1e-5 on outputs and gradients of O(1) (the two paths sum the
same products in a different order); bfloat16 compute, max |Δ| ≤ 0.04 on O(1) attention outputs
and ≤ 0.1 on whole-model logits (8-bit mantissas: one rounding of an O(1) value is ≤ 2^-8 ≈ 0.004,
and the paths round probabilities and partial sums at different points), ≤ 5% of the largest
gradient entry on gradients. Padding rows' outputs are not compared: the fused path lets a query
with no real key see itself (finite), the einsum path averages every value; no real token reads
either.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppojax.models import attention as A
from ppojax.models import cache as C
from ppojax.models import layout
from ppojax.models import transformer as T
from ppojax.models.config import ModelConfig

B, TQ, HQ, HKV, DH = 3, 10, 4, 2, 8  # batch, tokens, query heads, KV heads (GQA), head dim
LEFT_PAD = (0, 3, 6)
F32_TOL, BF16_TOL, BF16_LOGITS_TOL, BF16_GRAD_REL = 1e-5, 0.04, 0.1, 0.05
V, D, I = 97, 64, 96  # tiny model: vocab, hidden, intermediate


def _left_padded(left_pad=LEFT_PAD, length=TQ):
  """kv_mask [B, T] (row b's first left_pad[b] tokens are padding)."""
  return np.arange(length)[None] >= np.asarray(left_pad)[:, None]


def _qkv(dtype, seed=0):
  """q [B, T, H, D], k and v [B, H_kv, T, D] (the layout ``attention`` takes without a cache)."""
  ks = jax.random.split(jax.random.PRNGKey(seed), 3)
  q = jax.random.normal(ks[0], (B, TQ, HQ, DH))
  k, v = (jax.random.normal(key, (B, HKV, TQ, DH)) for key in ks[1:])
  return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def _run(path, window, dtype):
  """Output [B, T, H, D] and the gradients of Σ real rows' out·w with respect to q, k, v."""
  mask = jnp.asarray(_left_padded())
  slots = (jnp.arange(TQ), jnp.arange(TQ))
  w = jax.random.normal(jax.random.PRNGKey(9), (B, TQ, HQ, DH))
  q, k, v = _qkv(dtype)

  def loss(q, k, v):
    out = A.attention(path, q, k, v, slots, window, mask)
    return jnp.sum(jnp.where(mask[..., None, None], out.astype(jnp.float32) * w, 0.0)), out
  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  return np.asarray(out, np.float32), [np.asarray(g, np.float32) for g in grads]


def _real(x, mask=None):
  """Rows' real tokens only (x [B, T, ...])."""
  return x[_left_padded() if mask is None else mask]


def _assert_grads_close(ga, gb, rel):
  for a, b in zip(ga, gb):
    assert np.isfinite(a).all() and np.isfinite(b).all()
    np.testing.assert_allclose(a, b, atol=rel * np.abs(b).max())


@pytest.mark.parametrize("window", [0, 4])
def test_fused_attention_matches_einsum_float32(window):
  """Causal, left padding (row 2: 6 of 10 padding), GQA (4 query heads on 2 KV heads)."""
  out_e, grads_e = _run("einsum", window, jnp.float32)
  out_f, grads_f = _run("xla", window, jnp.float32)
  assert np.abs(_real(out_e)).max() > 0.3
  np.testing.assert_allclose(_real(out_f), _real(out_e), atol=F32_TOL)
  assert np.isfinite(out_f).all()
  for a, b in zip(grads_f, grads_e):  # padding rows' keys and values get no gradient in either
    np.testing.assert_allclose(a, b, atol=F32_TOL)


@pytest.mark.parametrize("window", [0, 4])
def test_fused_attention_matches_einsum_bfloat16(window):
  out_e, grads_e = _run("einsum", window, jnp.bfloat16)
  out_f, grads_f = _run("xla", window, jnp.bfloat16)
  np.testing.assert_allclose(_real(out_f), _real(out_e), atol=BF16_TOL)
  assert np.isfinite(out_f).all()
  _assert_grads_close(grads_f, grads_e, BF16_GRAD_REL)


def test_fully_masked_rows_are_finite_with_finite_gradients():
  """A padding query (all its keys padding) sees its own slot: outputs and the gradient of a
  loss over every row (padding ones included, as a masked mean would reach them) are finite."""
  mask = jnp.asarray(_left_padded())
  q, k, v = _qkv(jnp.bfloat16)
  slots = (jnp.arange(TQ), jnp.arange(TQ))

  def total(q, k, v):
    return jnp.sum(A.attention("xla", q, k, v, slots, 0, mask).astype(jnp.float32))
  grads = jax.grad(total, argnums=(0, 1, 2))(q, k, v)
  assert all(np.isfinite(np.asarray(g, np.float32)).all() for g in grads)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, F32_TOL), (jnp.bfloat16, BF16_TOL)])
def test_fused_attention_over_cache_slots_matches_einsum(dtype, tol):
  """Queries at slots 3 … 3 + T − 1 of a cache of T + 5 slots (a prefill at a traced
  cache_index: keys [B, H_kv, D, S] read from the cache, the mask not aligned with the queries),
  a window of 4 given traced, 3 real earlier slots and left padding in them."""
  q, _, _ = _qkv(dtype)
  s = TQ + 5
  ks = jax.random.split(jax.random.PRNGKey(3), 2)
  k_t = jax.random.normal(ks[0], (B, HKV, DH, s)).astype(dtype)
  v = jax.random.normal(ks[1], (B, HKV, s, DH)).astype(dtype)
  kv_mask = jnp.zeros((B, s), bool).at[:, :TQ + 3].set(
      jnp.arange(TQ + 3)[None] >= jnp.asarray([0, 2, 5])[:, None])
  slots = (3 + jnp.arange(TQ), jnp.arange(s))
  run = jax.jit(lambda path, w: A.attention(path, q, k_t, v, slots, w, kv_mask,
                                            keys_transposed=True), static_argnums=0)
  out_e, out_f = (np.asarray(run(path, jnp.int32(4)), np.float32) for path in ("einsum", "xla"))
  real = np.asarray(kv_mask[:, 3:TQ + 3])
  assert np.abs(out_e[real]).max() > 0.3
  np.testing.assert_allclose(out_f[real], out_e[real], atol=tol)
  assert np.isfinite(out_f).all()


def test_decode_steps_and_shared_prefixes_keep_the_einsum_path():
  """One query row (a decode step) or a shared prefix: ``attention`` takes ``attend`` whatever
  the path, and gives what ``attend`` gives."""
  q, k, v = _qkv(jnp.float32)
  mask = jnp.ones((B, TQ), bool)
  slots = (jnp.arange(TQ - 1, TQ), jnp.arange(TQ))
  k_t = k.transpose(0, 1, 3, 2)
  one = A.attention("xla", q[:, -1:], k_t, v, slots, 0, mask, keys_transposed=True)
  ref = A.attend(q[:, -1:], k_t, v, A.allowed_keys(*slots, 0, mask), keys_transposed=True)
  np.testing.assert_array_equal(np.asarray(one), np.asarray(ref))
  shared = (k[0].transpose(0, 2, 1), v[0])  # [H_kv, D, C], [H_kv, C, D]
  full = (jnp.arange(TQ), jnp.arange(TQ))
  with_prefix = A.attention("xla", q, k, v, full, 0, mask, shared=shared)
  ref = A.attend(q, k, v, A.allowed_keys(*full, 0, mask), shared=shared)
  np.testing.assert_array_equal(np.asarray(with_prefix), np.asarray(ref))


@pytest.mark.parametrize("platform,dtype,head_dim,expected", [
    ("gpu", "bfloat16", 64, "cudnn"), ("cuda", "float16", 128, "cudnn"),
    ("gpu", "float32", 64, "einsum"), ("gpu", "bfloat16", 12, "einsum"),
    ("gpu", "bfloat16", 256, "einsum"), ("rocm", "bfloat16", 64, "einsum"),
    ("cpu", "bfloat16", 64, "einsum"), ("cpu", "float32", 64, "einsum"),
    ("tpu", "bfloat16", 128, "einsum"),
])
def test_auto_picks_cudnn_on_nvidia_gpus_in_half_precision_only(platform, dtype, head_dim,
                                                                expected):
  assert A.attention_path("auto", jnp.dtype(dtype), head_dim, platform) == expected


def test_explicit_paths_and_their_errors():
  assert A.attention_path("einsum", jnp.bfloat16, 64, "gpu") == "einsum"
  assert A.attention_path("xla", jnp.float32, 12, "tpu") == "xla"
  assert A.attention_path("cudnn", jnp.bfloat16, 64, "gpu") == "cudnn"
  with pytest.raises(ValueError, match="NVIDIA GPU.*platform is 'cpu'"):
    A.attention_path("cudnn", jnp.bfloat16, 64, "cpu")
  with pytest.raises(ValueError, match="got float32"):
    A.attention_path("cudnn", jnp.float32, 64, "gpu")
  with pytest.raises(ValueError, match="auto, einsum, xla or cudnn"):
    A.attention_path("flash", jnp.bfloat16, 64, "gpu")
  assert A.accelerator_platform() == "cpu"  # these tests' backend
  assert A.attention_path("auto", jnp.bfloat16, 64) == "einsum"


def test_cudnn_takes_the_fused_form_only_where_it_can():
  """Not for a decode step, a shared prefix, or (cuDNN with a mask) odd lengths."""
  assert A.fused_applies("cudnn", 64, 64, False) and A.fused_applies("xla", 63, 63, False)
  assert not A.fused_applies("cudnn", 63, 63, False)
  assert not A.fused_applies("cudnn", 1, 64, False)
  assert not A.fused_applies("xla", 64, 64, True)
  assert not A.fused_applies("einsum", 64, 64, False)
  with pytest.raises(ValueError, match="attention 'flash': choose one of auto, einsum"):
    _tiny_config("llama", attention="flash")


# ---------------------------------------------------------------------------------------------
# Whole models
# ---------------------------------------------------------------------------------------------


def _tiny_config(model_type, **changes):
  base = dict(model_type=model_type, vocab_size=V, hidden_size=D, intermediate_size=I,
              num_layers=2, num_heads=4, num_kv_heads=4 if model_type == "gpt2" else 2,
              head_dim=16, max_position_embeddings=64, norm_eps=1e-5,
              tie_word_embeddings=model_type == "gpt2", qkv_bias=model_type == "gpt2",
              out_bias=model_type == "gpt2")
  return ModelConfig(**dict(base, **changes))


MODELS = {
    "llama-gqa": _tiny_config("llama"),
    "mistral-window": _tiny_config("mistral", layer_windows=(3, 3)),
    "gpt2": _tiny_config("gpt2"),
}


@functools.cache
def _params(cfg):
  """Random params (float32) of the flax shapes, norm scales ≈ 1."""
  tokens = jnp.zeros((1, 4), jnp.int32)
  shapes = jax.eval_shape(lambda: T.CausalLM(cfg).init(
      jax.random.PRNGKey(0), tokens, tokens, tokens > -1)["params"])
  rng = np.random.RandomState(0)
  return jax.tree_util.tree_map_with_path(
      lambda path, x: ((1.0 if "scale" in jax.tree_util.keystr(path) else 0.0)
                       + 0.15 * rng.standard_normal(x.shape)).astype(x.dtype), shapes)


def _tokens(length=TQ, seed=1):
  mask = _left_padded(length=length)
  tokens = np.where(mask, np.random.RandomState(seed).randint(1, V, (B, length)), 0)
  return (jnp.asarray(tokens, jnp.int32), C.positions_from_mask(jnp.asarray(mask)),
          jnp.asarray(mask))


def _forward_and_grad(cfg):
  """Logits [B, T, V] (float32) and the parameter gradient of the mean log-likelihood of the
  real next tokens."""
  tokens, positions, mask = _tokens()
  model = T.CausalLM(cfg)

  def loss(p):
    logits = model.apply({"params": p}, tokens, positions, mask)[0].astype(jnp.float32)
    logp = jax.nn.log_softmax(logits[:, :-1])
    picked = jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
    real = mask[:, 1:] & mask[:, :-1]
    return -jnp.sum(jnp.where(real, picked, 0.0)) / real.sum(), logits
  (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(_params(cfg))
  return np.asarray(logits), [np.asarray(g) for g in jax.tree.leaves(grads)]


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_forward_and_gradient_match(name, dtype):
  base = MODELS[name].replace(dtype=dtype)
  logits_e, grads_e = _forward_and_grad(base.replace(attention="einsum"))
  logits_f, grads_f = _forward_and_grad(base.replace(attention="xla"))
  assert np.abs(_real(logits_e)).max() > 0.5
  if dtype == "float32":
    np.testing.assert_allclose(_real(logits_f), _real(logits_e), atol=F32_TOL)
    for a, b in zip(grads_f, grads_e):
      np.testing.assert_allclose(a, b, atol=F32_TOL)
  else:
    np.testing.assert_allclose(_real(logits_f), _real(logits_e), atol=BF16_LOGITS_TOL)
    _assert_grads_close(grads_f, grads_e, BF16_GRAD_REL)


@pytest.mark.parametrize("scan", [True, False])
def test_cache_prefill_matches(scan):
  """A prefill of a left-padded prompt into a KV cache (scanned layers: cache_index traced, the
  keys read from the cache; unrolled: a Python 0, the prompt's own keys), then two decode steps:
  logits and the cache's slots agree between the paths."""
  cfg = MODELS["mistral-window"].replace(scan_layers=scan)
  params = _params(MODELS["mistral-window"])
  params = params if scan else layout.unstack_layers(params)
  tokens, positions, mask = _tokens(length=TQ + 2)
  slots = TQ + 4

  def run(path):
    model = T.CausalLM(cfg.replace(attention=path))
    kv_mask = jnp.zeros((B, slots), bool).at[:, :TQ].set(mask[:, :TQ])
    prefill = jax.jit(lambda p, c: model.apply({"params": p}, tokens[:, :TQ],
                                               positions[:, :TQ], kv_mask, c, 0))
    logits, cache = prefill(params, C.init_cache(cfg, B, slots))
    out = [logits]
    for t in (TQ, TQ + 1):
      kv_mask = kv_mask.at[:, t].set(True)
      logits, cache = model.apply({"params": params}, tokens[:, t:t + 1],
                                  positions[:, t:t + 1], kv_mask, cache, t)
      out.append(logits)
    return np.asarray(jnp.concatenate(out, 1)), cache

  (logits_e, cache_e), (logits_f, cache_f) = run("einsum"), run("xla")
  real = np.asarray(mask)
  assert np.abs(logits_e[real]).max() > 0.5
  np.testing.assert_allclose(logits_f[real], logits_e[real], atol=F32_TOL)
  keep = np.asarray(jnp.zeros((B, slots), bool).at[:, :TQ + 2].set(mask))[:, None, None]
  np.testing.assert_allclose(_slots_last(cache_f, keep), _slots_last(cache_e, keep),
                             atol=F32_TOL)


def _slots_last(cache, keep):
  """The cache's keys and values, each [(L,) B, H_kv, D, S], the slots ``keep`` [B, 1, 1, S]
  leaves (real tokens') and 0 elsewhere."""
  k, v = (np.stack(x) if isinstance(x, tuple) else np.asarray(x) for x in cache[:2])
  return [np.where(keep, k, 0.0), np.where(keep, np.swapaxes(v, -1, -2), 0.0)]
