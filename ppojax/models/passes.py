"""Forward passes over prompt + response, without sampling: the policy's log-probs and hidden
states at the response positions, a value model's V(s_t), a reward model's score.

A prompt + response sequence is scored in one forward pass over [B, P + R] tokens: the logits at
position P − 1 + t predict response token t, and a value head's output there is V(s_t) (the
state holding the prompt and t response tokens). Tokens after a response's stop token are masked
out of attention. With a shared prefix [C] (``data.batch.Prompts``) the passes drop each row's
first C real tokens (``without_prefix``) and the model runs them once for the batch.
"""

from __future__ import annotations

from typing import Callable

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from ppojax.core import logprobs, ops
from ppojax.models.cache import positions_from_mask
from ppojax.models.packing import Packing, unpack

Array = jax.Array


def without_prefix(tokens: Array, mask: Array, c: int) -> tuple[Array, Array, Array]:
  """Left-padded rows [B, T] whose first c real tokens are a shared prefix, without it:
  (tokens, mask, positions), [B, T − c]: the last T − c columns (every row's tokens after its
  prefix lie there), the prefix's own tokens masked out, positions counted from c."""
  positions = positions_from_mask(mask)
  return tokens[:, c:], mask[:, c:] & (positions[:, c:] >= c), positions[:, c:]


def sequence(prompts: Array, prompt_mask: Array, responses: Array, response_mask: Array,
             prefix: Array | None = None) -> tuple[Array, Array, Array]:
  """Prompt + response as one left-padded sequence: (tokens, mask, positions), [B, P + R];
  with a shared ``prefix`` [C], without it (``without_prefix``): [B, P − C + R]. Either way
  response token t sits at column −R + t."""
  chex.assert_equal_shape_prefix([prompts, prompt_mask, responses, response_mask], 1)
  tokens = jnp.concatenate([prompts, responses], axis=1)
  mask = jnp.concatenate([prompt_mask.astype(jnp.bool_), response_mask.astype(jnp.bool_)], 1)
  if prefix is not None:
    return without_prefix(tokens, mask, prefix.shape[0])
  return tokens, mask, positions_from_mask(mask)


def response_logits(module: nn.Module, params, prompts, prompt_mask, responses, response_mask,
                    prefix: Array | None = None) -> Array:
  """Logits [B, R, V] that predict each response token: the LM head at the R positions before
  each (the head runs on those R positions only). The training passes never hold these whole
  (``head_logprobs``); evaluation reads them."""
  hidden = response_hidden(module, params, prompts, prompt_mask, responses, response_mask,
                           prefix)
  return module.apply({"params": params}, hidden, method="logits")


def response_hidden(module: nn.Module, params, prompts, prompt_mask, responses, response_mask,
                    prefix: Array | None = None, rngs: dict | None = None) -> Array:
  """The policy's final hidden states [B, R, D] at the R positions before each response token
  (where the LM head predicts it). ``rngs``: ``apply``'s (the update's LoRA dropout; None:
  deterministic, as every rollout pass)."""
  tokens, mask, positions = sequence(prompts, prompt_mask, responses, response_mask, prefix)
  hidden, _ = module.apply({"params": params}, tokens, positions, mask, prefix=prefix,
                           method="hidden", rngs=rngs)
  r = responses.shape[1]
  return hidden[:, -r - 1:-1]


def packed_hidden(module: nn.Module, params, packing: Packing, prefix: Array | None = None,
                  rngs: dict | None = None) -> Array:
  """The policy's final hidden states [N, L, D] over packed rows (``models.packing``): every
  segment attends to itself only (and to the shared ``prefix`` [C], run once)."""
  hidden, _ = module.apply({"params": params}, packing.tokens, packing.positions,
                           packing.segments, prefix=prefix, method="hidden", rngs=rngs)
  return hidden


def packed_values(module: nn.Module, params, packing: Packing, response_mask: Array,
                  prefix: Array | None = None, rngs: dict | None = None) -> Array:
  """V(s_t) [B, R] from a ``ValueModel`` run over packed rows: ``response_values`` without the
  padding's FLOPs."""
  out, _ = module.apply({"params": params}, packing.tokens, packing.positions,
                        packing.segments, prefix=prefix, rngs=rngs)
  return unpack(out, packing, response_mask)


def head_params(params) -> dict:
  """The part of a ``CausalLM``'s parameters that its LM head reads: ``lm_head``, or the
  embedding table where the head is tied to it."""
  if "lm_head" in params:
    return {"lm_head": params["lm_head"]}
  return {"model": {"embed": params["model"]["embed"]}}


def head_logprobs(module: nn.Module, params, hidden: Array, tokens: Array, temperature: float,
                  entropy: bool = False, chunk_size: int | None = logprobs.DEFAULT_CHUNK
                  ) -> tuple[Array, Array | None]:
  """(log π_T(tokens_t), H_t or None), [B, T] float32, from hidden states [B, T, D] through the
  LM head, about ``chunk_size`` tokens (all rows together) at a time:

      for each time chunk c:  z_c = head(h_c) / T,  log π_c = z_c[token] − lse(z_c),
                              H_c = lse(z_c) − Σ softmax(z_c)·z_c

  Only one chunk's logits [B, c, V] exist at a time: the whole [B, T, V] never do (for
  Qwen2.5's 151,936-token vocabulary, 0.6 GB per 1,000 tokens in float32). The rows stay whole
  in every chunk, so rows sharded over a mesh stay sharded. This is for passes without a
  gradient (the rollout's): differentiated, the chunk loop accumulates the head's gradient in a
  whole, unsharded buffer ([D, V] float32, 2 GB for Llama-3.1-8B) on every device, so a loss
  passes ``chunk_size=None`` (the whole logits at once, ``logprobs.selective_log_softmax`` chunking
  their float32 work)."""
  b, t, _ = hidden.shape
  head = head_params(params)

  def one(h, tok):
    logits = module.apply({"params": head}, h, method="logits")
    logp = logprobs.selective_log_softmax(logits, tok, temperature)
    return logp, logprobs.entropy_from_logits(logits, temperature) if entropy else None

  target = t if chunk_size is None else max(1, chunk_size // max(b, 1))
  c = logprobs._chunk_size(t, target)  # pylint: disable=protected-access
  if c == t:
    return one(hidden, tokens)
  split = lambda x: jnp.swapaxes(x.reshape((b, t // c, c) + x.shape[2:]), 0, 1)  # noqa: E731
  merge = lambda y: jnp.swapaxes(y, 0, 1).reshape(b, t)  # noqa: E731
  outs = jax.lax.map(lambda xs: one(*xs), (split(hidden), split(tokens)))
  return jax.tree.map(merge, outs)


def response_logprobs(module, params, prompts, prompt_mask, responses, response_mask,
                      temperature: float, prefix: Array | None = None,
                      chunk_size: int | None = logprobs.DEFAULT_CHUNK) -> Array:
  """log π_T(response_t | prefix) [B, R], float32, 0 off the mask (``head_logprobs``: the
  logits ``chunk_size`` tokens at a time; None for a loss)."""
  hidden = response_hidden(module, params, prompts, prompt_mask, responses, response_mask,
                           prefix)
  logp, _ = head_logprobs(module, params, hidden, responses, temperature,
                          chunk_size=chunk_size)
  return jnp.where(response_mask, logp, 0.0)


def response_values(module: nn.Module, params, prompts, prompt_mask, responses, response_mask,
                    prefix: Array | None = None, rngs: dict | None = None) -> Array:
  """V(s_t) [B, R] from a ``ValueModel``: its output at the position before response token t
  (``rngs``: as ``response_hidden``'s)."""
  tokens, mask, positions = sequence(prompts, prompt_mask, responses, response_mask, prefix)
  out, _ = module.apply({"params": params}, tokens, positions, mask, prefix=prefix, rngs=rngs)
  r = responses.shape[1]
  return jnp.where(response_mask, out[:, -r - 1:-1], 0.0)


def model_scores(module: nn.Module, params, prompts, prompt_mask, responses, response_mask,
                 prefix: Array | None = None) -> Array:
  """A reward model's score [B]: its output at the last response token."""
  tokens, mask, positions = sequence(prompts, prompt_mask, responses, response_mask, prefix)
  out, _ = module.apply({"params": params}, tokens, positions, mask, prefix=prefix)
  return ops.gather_last(out[:, -responses.shape[1]:], response_mask)


def map_rows(fn: Callable, rows: tuple, micro_batches: int = 1, *shared):
  """``fn(*rows, *shared)`` computed in ``micro_batches`` sequential parts of the rows (a
  ``lax.map``), so that one part's activations are alive at a time; the outputs (a pytree of
  [B, ...] arrays) are the same as one call's.

  Part j holds rows j, j + k, j + 2k, … (k = micro_batches): rows sharded in contiguous blocks
  over devices give every device its equal share of every part, with no data moved."""
  if micro_batches == 1:
    return fn(*rows, *shared)
  b, k = rows[0].shape[0], micro_batches
  if b % k:
    raise ValueError(f"{b} rows do not split into {k} micro-batches")
  split = lambda x: jnp.swapaxes(x.reshape((b // k, k) + x.shape[1:]), 0, 1)  # noqa: E731
  merge = lambda y: jnp.swapaxes(y, 0, 1).reshape((b,) + y.shape[2:])  # noqa: E731
  outs = jax.lax.map(lambda part: fn(*part, *shared), tuple(split(x) for x in rows))
  return jax.tree.map(merge, outs)
