"""The chunked log-prob / entropy kernels never hold a second [B, T, V] float32 array.

Checked on the compiled program (XLA's buffer assignment), not by timing: the temporary bytes of
forward and backward must stay well below the size of the logits in float32.
"""

import jax
import jax.numpy as jnp
import pytest

from ppojax.core import logprobs

B, T, V, CHUNK = 4, 128, 4096, 64


def _temp_bytes(fn, *args):
  return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def _logp_sum(logits, tokens):
  return logprobs.selective_log_softmax(logits, tokens, chunk_size=CHUNK).sum()


def _entropy_sum(logits, tokens):
  del tokens
  return logprobs.entropy_from_logits(logits, chunk_size=CHUNK).sum()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("fn", [_logp_sum, _entropy_sum], ids=["logp", "entropy"])
@pytest.mark.parametrize("grad", [False, True], ids=["fwd", "grad"])
def test_no_full_float32_copy(dtype, fn, grad):
  logits = jax.ShapeDtypeStruct((B, T, V), dtype)
  tokens = jax.ShapeDtypeStruct((B, T), jnp.int32)
  f32_copy = B * T * V * 4
  temp = _temp_bytes(jax.grad(fn) if grad else fn, logits, tokens)
  # One [chunk, V] float32 slab is 1/16 of the array here; on CPU bf16 adds one bf16-sized copy
  # (see logprobs._bf16_as_bits). A full float32 copy would put this at >= 1.0.
  assert temp < 0.7 * f32_copy, f"temp {temp / f32_copy:.3f} x the float32 logits"


def test_naive_formulation_does_materialise_the_copy():
  """Guards the test above: the obvious implementation would fail it."""
  logits = jax.ShapeDtypeStruct((B, T, V), jnp.bfloat16)
  tokens = jax.ShapeDtypeStruct((B, T), jnp.int32)

  def naive(z, tok):
    logp = jax.nn.log_softmax(z.astype(jnp.float32))
    return jnp.take_along_axis(logp, tok[..., None], -1).sum()

  assert _temp_bytes(jax.grad(naive), logits, tokens) >= 1.0 * B * T * V * 4
