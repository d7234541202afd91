"""Compiled generation: one prefill, then a ``lax.while_loop`` of cached decode steps that exits as
soon as every row has stopped. No Python runs per token; static shapes compile once per
(batch, prompt length, max_new_tokens).

    out = generate(CausalLM(cfg), params, prompts, prompt_mask, key, SamplingConfig(...))

Prompts that all begin with the same tokens (a chat template's system header) can share that
prefix's prefill: ``prefix, rest, rest_mask = split_shared_prefix(tokens, mask)`` on the host,
then ``generate(..., rest, rest_mask, key, config, prefix=prefix)`` runs the prefix through the
model once, for one row, and the batch's prefill over the rest only. The sample distribution is
the same; only float rounding differs.

Log-probs: ``out.logprobs`` is log π_T(token) under softmax(logits / temperature) — the
distribution PPO's ratio uses (``logprobs.selective_log_softmax(logits, tokens, temperature)``
recomputes exactly it). ``out.sampling_logprobs`` is under the distribution the token was actually
drawn from: the temperature-scaled one after top-k / top-p / min-p truncation (and the exclusion
of stop tokens before ``min_new_tokens``), renormalised. The two are equal when nothing is
excluded.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ppojax.core import ops
from ppojax.infra.sharding import compile_platform, shard_rows
from ppojax.infra.trees import cast_floats
from ppojax.models.cache import (
  KVCache,
  cache_length,
  init_cache,
  positions_from_mask,
  repeat_rows,
  with_shared_prefix,
)
from ppojax.models import lora
from ppojax.models.layout import (
  fuse_projections,
  stack_layers,
  transpose_kernels,
  unstack_layers,
)
from ppojax.models.rope import model_rope
from ppojax.rollout.draw import sample_token
from ppojax.rollout.prefix import split_shared_prefix  # noqa: F401  (its home before)

Array = jax.Array
LAYERS = ("auto", "scan", "unroll")  # SamplingConfig.layers


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How to pick tokens (hashable: a jit static)."""

  max_new_tokens: int
  stop_ids: tuple[int, ...]  # the first of these ends a response (and stays in it)
  pad_id: int  # written after the stop token; may equal a stop id
  temperature: float = 1.0
  greedy: bool = False  # argmax; log-probs still at ``temperature``
  top_k: int = 0  # keep the k most likely tokens (0: off)
  top_p: float = 1.0  # keep the smallest set with probability ≥ top_p (1: off)
  min_p: float = 0.0  # drop tokens with p < min_p · p_max (0: off)
  min_new_tokens: int = 0  # stop tokens are excluded before this many new tokens
  # samples per prompt: prompt i's n samples are rows i·n … i·n + n − 1 of the output (a
  # group, contiguous), all decoding from one prefill of the prompt
  num_samples_per_prompt: int = 1
  # the decode's layers (``decode_layers``): "scan" (one compiled layer body), "unroll" (each
  # layer its own code, reading its weights and cache in place), "auto" (scan on TPU only)
  layers: str = "auto"
  # decode steps per check of the stop condition (``stop_check_steps``; 0: 8 on a GPU, else 1):
  # the rows' outputs are the same whatever it is; up to N − 1 steps run past the last stop
  stop_check_every: int = 0

  def __post_init__(self):
    object.__setattr__(self, "stop_ids", tuple(int(i) for i in self.stop_ids))  # hashable
    if self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
    if not self.stop_ids:
      raise ValueError("stop_ids is empty: give at least one stop token id (e.g. EOS)")
    if not self.temperature > 0:  # also rejects NaN
      raise ValueError(f"temperature must be > 0 (use greedy=True for argmax), "
                       f"got {self.temperature}")
    if not 0 <= self.min_new_tokens <= self.max_new_tokens:
      raise ValueError(f"need 0 <= min_new_tokens <= max_new_tokens, got {self.min_new_tokens}")
    n = self.num_samples_per_prompt
    if not isinstance(n, (int, np.integer)) or n < 1:
      raise ValueError(f"num_samples_per_prompt must be an int >= 1, got "
                       f"{self.num_samples_per_prompt!r}")
    if not 0 < self.top_p <= 1 or not 0 <= self.min_p < 1 or self.top_k < 0:
      raise ValueError(f"need 0 < top_p <= 1, 0 <= min_p < 1, top_k >= 0; got "
                       f"top_p={self.top_p}, min_p={self.min_p}, top_k={self.top_k}")
    if not isinstance(self.stop_check_every, (int, np.integer)) or self.stop_check_every < 0:
      raise ValueError(f"stop_check_every must be an int >= 0 (0: automatic), got "
                       f"{self.stop_check_every!r}")
    if self.layers not in LAYERS:
      raise ValueError(f"layers must be one of {', '.join(map(repr, LAYERS))}, got "
                       f"{self.layers!r}")

  @property
  def truncates(self) -> bool:
    return bool(self.top_k) or self.top_p < 1 or self.min_p > 0


class Generation(NamedTuple):
  tokens: Array  # [B, R] int32; pad_id after each row's first stop token
  logprobs: Array  # [B, R] float32, log π_T(token); 0 on padding
  sampling_logprobs: Array  # [B, R] float32, under the truncated distribution; 0 on padding
  mask: Array  # [B, R] bool, ops.response_mask(tokens, stop_ids)
  lengths: Array  # [B] int32, response lengths (stop token included)


class _LoopState(NamedTuple):
  t: Array  # index of the token the next step samples
  cache: object
  kv_mask: Array
  last: Array  # [B] the token sampled at t − 1, fed to the next forward pass
  tokens: Array
  logp: Array
  sampling_logp: Array
  done: Array


def _shared_prefix_cache(apply, cfg, prefix: Array, cache: KVCache, size: int) -> KVCache:
  """``cache`` with the keys and values of ``prefix`` [C] (positions 0 … C − 1) shared by all
  its rows: one prefill of one row. ``size`` bounds every position the caller will use (the
  RoPE table's length)."""
  length = prefix.shape[0]
  positions = jnp.arange(length, dtype=jnp.int32)[None]
  _, prefix_cache = apply(prefix[None], positions, jnp.ones((1, length), jnp.bool_),
                          init_cache(cfg, 1, length), 0, last_only=True,
                          rope=model_rope(cfg, positions, size))
  return with_shared_prefix(cache, prefix_cache)


def decode_layers(layers: str, params) -> str:
  """``SamplingConfig.layers`` resolved for ``params``: "auto" is "scan" where they are compiled
  for a TPU (``compile_platform``), "unroll" elsewhere; "scan" and "unroll" stay.

  What each back end's compiler makes of a scanned decode step (``benchmarks/decode_hlo.py``,
  Qwen2.5-0.5B, 256 rows, docs/performance/decode.md "The decode loop's copies"): XLA:TPU
  reads each layer's weights and cache slices in place; XLA:GPU copies every layer's weights
  out of the stacked arrays on every token (0.72 GB per step), XLA:CPU its weights and KV cache
  (2.7 GB).
  Unrolled, no back end copies either; the program is longer to compile, once per shape per
  machine with the persistent compilation cache (``infra.compile.use_cache``)."""
  if layers not in LAYERS:
    raise ValueError(f"layers must be one of {', '.join(map(repr, LAYERS))}, got {layers!r}")
  if layers != "auto":
    return layers
  return "scan" if compile_platform(params) == "tpu" else "unroll"


STOP_CHECK_GPU = 8  # ``stop_check_steps``'s automatic N on a GPU


def stop_check_steps(every: int, x=None) -> int:
  """Decode steps per check of the stop condition: ``every``, or for 0 (automatic)
  ``STOP_CHECK_GPU`` where ``x`` (an array, or None: the default) is compiled for a GPU, whose
  while loop reads its condition back to the host on every iteration, and 1 elsewhere (a CPU's
  and a TPU's loops check on their own cores). N steps then run as one fixed-trip inner loop."""
  if every:
    return int(every)
  return STOP_CHECK_GPU if compile_platform(x) in ("gpu", "cuda", "rocm") else 1


def decode_layout(module: nn.Module, params, layers: str = "auto") -> tuple[nn.Module, dict]:
  """(module, params) as ``generate`` decodes with them: LoRA adapters merged into their kernels
  (``lora.merge``), layers as ``decode_layers(layers, params)`` says — unrolled (each reads its
  weights in place; a scanned step copies every layer's weights out of the stacked arrays, but
  its program holds one layer body, compiled and tuned once) or stacked for one ``nn.scan`` —,
  q/k/v and gate/up joined (``fused_projections``: the split copies the weights anyway), no
  remat (no gradient flows through sampling), floats in the compute dtype, and for the CPU the
  kernels stored [out, in] (``transposed_kernels``: a decode step's few rows then take
  ``columns_matmul``).

  ``generate`` applies it on every call, which copies every weight. Call it once and pass its
  result to reuse one set of params across calls (evaluation, serving, benchmarks); on params
  already in this layout it copies nothing. Timings: docs/performance/decode.md."""
  cfg = module.cfg
  scan = decode_layers(layers, params) == "scan"
  transposed = compile_platform(params) == "cpu"
  if cfg.lora_rank:  # sample from W + (α/r)·A·B, as the training step's sampler does
    params, cfg = lora.merge(params, cfg), lora.base_config(cfg)
  if cfg.transposed_kernels and not cfg.fused_projections:  # fuse in the [in, out] layout
    params, cfg = transpose_kernels(params), cfg.replace(transposed_kernels=False)
  if cfg.scan_layers != scan:
    params = stack_layers(params) if scan else unstack_layers(params)
  if not cfg.fused_projections:
    params = fuse_projections(params)
  if cfg.transposed_kernels != transposed:
    params = transpose_kernels(params)
  module = module.clone(cfg=cfg.replace(scan_layers=scan, remat=False, fused_projections=True,
                                        transposed_kernels=transposed))
  return module, cast_floats(params, module.cfg.compute_dtype)  # as every layer would


def _repeat_rows(tree, n: int):
  """Every [B, ...] array of ``tree`` with each row repeated n times, [B·n, ...] (row i's copies
  at i·n … i·n + n − 1), the rows over the mesh's batch axes (``sharding.shard_rows``)."""
  return jax.tree.map(lambda x: shard_rows(jnp.repeat(x, n, axis=0)), tree)


@functools.partial(jax.jit, static_argnames=("module", "config"))
def generate(module: nn.Module, params, prompts: Array, prompt_mask: Array, key: Array,
             config: SamplingConfig, prefix: Array | None = None) -> Generation:
  """Sample up to ``config.max_new_tokens`` tokens after left-padded ``prompts`` [B, P]:
  ``config.num_samples_per_prompt`` = n samples of each, [B·n, R], prompt i's in rows
  i·n … i·n + n − 1.

  Args:
    module: a ``CausalLM`` (its ``cfg`` sizes the KV cache). Decoding always runs in
      ``decode_layout`` (layers scanned or unrolled as ``config.layers`` says, fused
      projections), converted here on every call unless ``module`` and ``params`` already are.
    params: its parameters (may be sharded; the batch too).
    prompts, prompt_mask: [B, P], left-padded (real tokens at the end of each row; at least one
      per row).
    key: PRNG key; the same key gives the same sample. Step t draws with ``fold_in(key, t)``.
    prefix: [C] tokens that precede every row's prompt (see ``split_shared_prefix``): each row
      is then the sequence prefix + prompt. The prefix's keys and values are computed once, for
      one row, kept once for the batch (``KVCache.prefix_k``), and every decode step scores
      them with one matmul over all rows; a sliding-window layer sees the prefix keys within
      its window (they sit at positions 0 … C − 1).

  The prefill's logits give token 0; each loop step feeds token t − 1 and samples token t, so
  the last token costs no forward pass. With n > 1 the prefill runs once per prompt; its cache
  rows and last logits are then repeated n times (``repeat_rows``) and the n samples of a
  prompt differ from their first token on (each row draws its own noise).
  """
  if prefix is not None and prefix.ndim != 1:
    raise ValueError(f"prefix must be one row of token ids [C], got shape {prefix.shape}")
  shared = 0 if prefix is None else prefix.shape[0]
  # the last token is sampled but never fed back: P + R − 1 cache slots
  slots = prompts.shape[1] + config.max_new_tokens - 1
  prompt_mask = prompt_mask.astype(jnp.bool_)
  module, params = decode_layout(module, params, config.layers)
  apply = functools.partial(module.apply, {"params": params})
  logits, cache, kv_mask, first_position = _prefill(
      apply, module.cfg, prompts, prompt_mask, prefix, shared, slots,
      config.num_samples_per_prompt)
  state = _decode(apply, module.cfg, logits, cache, kv_mask, first_position, prompts.shape[1],
                  shared + slots, key, config)
  mask = ops.response_mask(state.tokens, config.stop_ids)
  return Generation(
      tokens=state.tokens, logprobs=jnp.where(mask, state.logp, 0.0),
      sampling_logprobs=jnp.where(mask, state.sampling_logp, 0.0), mask=mask,
      lengths=jnp.sum(mask, axis=1, dtype=jnp.int32))


def _prefill(apply, cfg, prompts: Array, prompt_mask: Array, prefix: Array | None, shared: int,
             slots: int, n: int):
  """The prefill of ``prompts`` [B, P] (after the shared ``prefix``'s, C = ``shared`` tokens)
  into a cache of ``slots`` slots: (last logits [B·n, 1, V], cache, kv_mask [B·n, slots], the
  first new token's position [B·n]), each row repeated for its n samples."""
  prompt_rows, prompt_len = prompts.shape
  slots = cache_length(cfg, slots)  # a multiple of 16 where the fused decode kernel reads it
  kv_mask = jnp.zeros((prompt_rows, slots), jnp.bool_).at[:, :prompt_len].set(prompt_mask)
  cache = init_cache(cfg, prompt_rows, slots)
  if shared:
    cache = _shared_prefix_cache(apply, cfg, prefix.astype(jnp.int32), cache, shared + slots)
  # RoPE from a table of the cache's positions (every position here is below C + ``slots``)
  prompt_positions = shared + positions_from_mask(prompt_mask)
  logits, cache = apply(prompts, prompt_positions, kv_mask, cache, 0, last_only=True,
                        rope=model_rope(cfg, prompt_positions, shared + slots))
  first_position = shared + jnp.sum(prompt_mask, axis=1, dtype=jnp.int32)  # first new token
  if n > 1:  # each prompt's prefill serves its n samples
    logits, kv_mask, first_position = _repeat_rows((logits, kv_mask, first_position), n)
    cache = repeat_rows(cache, n)
  return logits, cache, kv_mask, first_position


def _record(s: _LoopState, t, tok: Array, logp: Array, slogp: Array, pad_id: int,
            stop_ids: Array) -> _LoopState:
  """Token t [B] and its log-probs written at column t (pad_id and 0 in rows already stopped);
  past the last column (t ≥ R: N steps between stop checks) nothing changes but t."""
  tok = jnp.where(s.done, pad_id, tok)
  logp, slogp = jnp.where(s.done, 0.0, logp), jnp.where(s.done, 0.0, slogp)
  live = t < s.tokens.shape[1]

  def write(buf, x):  # column t, or where t ≥ R the (clamped) last column as it was
    old = jax.lax.dynamic_slice_in_dim(buf, t, 1, axis=1)
    return jax.lax.dynamic_update_slice(buf, jnp.where(live, x[:, None], old), (0, t))
  return s._replace(
      t=t + 1, last=tok, tokens=write(s.tokens, tok), logp=write(s.logp, logp),
      sampling_logp=write(s.sampling_logp, slogp),
      done=s.done | (live & jnp.any(tok[:, None] == stop_ids, axis=-1)))


def _decode(apply, cfg, logits: Array, cache, kv_mask: Array, first_position: Array,
            prompt_len, size: int, key: Array, config: SamplingConfig,
            done: Array | None = None) -> _LoopState:
  """Token 0 from the prefill's ``logits``, then the ``lax.while_loop`` of decode steps until
  every row has stopped or R tokens are out; ``size`` is the RoPE table's (C + slots). Token t
  is fed at slot ``prompt_len`` + t (an int, or traced: a later turn's first slot). ``done``
  [B]: rows that sample nothing (pad_id, log-probs 0; default: none).

  The stop condition is checked every N = ``stop_check_steps`` steps, N steps running as one
  fixed-trip loop: a step past token R − 1 changes no output (its writes keep the values there)
  but does write the cache at a slot past the last (clamped: the last slot, read by no later
  step here; a later turn writes its own slots before it reads them)."""
  batch, length = logits.shape[0], config.max_new_tokens
  every = stop_check_steps(config.stop_check_every, logits)
  stop_ids = jnp.asarray(config.stop_ids, jnp.int32)
  is_stop_id = jnp.isin(jnp.arange(logits.shape[-1]), stop_ids)  # [V]

  def pick(t, logits, s: _LoopState) -> _LoopState:
    """Sample token t from next-token logits [B, V] and record it (pad_id, log-probs 0 in rows
    already stopped)."""
    banned = None
    if config.min_new_tokens:  # as Hugging Face's MinNewTokensLengthLogitsProcessor
      banned = (t < config.min_new_tokens) & is_stop_id
    drawn = sample_token(logits, jax.random.fold_in(key, t), config, banned)
    return _record(s, t, *drawn, config.pad_id, stop_ids)

  def step(s: _LoopState) -> _LoopState:
    """Feed token t − 1 (slot P + t − 1), then sample token t."""
    slot = prompt_len + s.t - 1
    kv_mask = jax.lax.dynamic_update_slice(s.kv_mask, jnp.ones((batch, 1), jnp.bool_), (0, slot))
    positions = first_position[:, None] + s.t - 1  # [B, 1]
    # this step's RoPE [B, 1, 1, D], gathered once (the barrier: not again in every layer's
    # fusions); every step's, [B, R − 1, 1, D], made before the loop, was a 67 MB loop
    # invariant per table at 256 × 512 that XLA:TPU moved between memory spaces every step
    rope = jax.lax.optimization_barrier(model_rope(cfg, positions, size))
    logits, cache = apply(s.last[:, None], positions, kv_mask, s.cache, slot, rope=rope)
    return pick(s.t, logits[:, -1], s._replace(cache=cache, kv_mask=kv_mask))

  def body(s: _LoopState) -> _LoopState:
    return step(s) if every == 1 else jax.lax.fori_loop(0, every, lambda _, s: step(s), s)

  def cond(s: _LoopState) -> Array:
    return (s.t < length) & ~jnp.all(s.done)

  zeros = jnp.zeros((batch, length), jnp.float32)
  state = _LoopState(
      t=jnp.zeros((), jnp.int32), cache=cache, kv_mask=kv_mask,
      last=jnp.zeros((batch,), jnp.int32),
      tokens=jnp.full((batch, length), config.pad_id, jnp.int32), logp=zeros,
      sampling_logp=zeros,
      done=jnp.zeros((batch,), jnp.bool_) if done is None else done.astype(jnp.bool_))
  state = pick(state.t, logits[:, -1], state)  # token 0, from the prefill
  return jax.lax.while_loop(cond, body, state)
