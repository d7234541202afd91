"""One decoder-only transformer in Flax linen for every supported family (``models.families``:
Llama, Mistral, Qwen2/3, SmolLM2/3, Gemma 2/3, OLMo 2/3, GPT-2), with an explicit KV cache, as
a causal LM or a value/reward model.

One ``Block`` follows ``ModelConfig``'s layer description: which norms (RMSNorm with w or
1 + w, LayerNorm) sit before and/or after each sublayer, q/k norms, the MLP's activation,
positions (RoPE per layer, none, or learned), the embedding scale, the attention scale and
soft-caps, each layer's sliding window. Layers are one ``nn.scan`` over stacked parameters
(what differs per layer, its window and RoPE table, are scanned inputs), so the compiled
program holds one layer body.

Calling convention (``CausalLM`` and ``ValueModel`` alike)::

    out, cache = model.apply({"params": p}, tokens, positions, kv_mask, cache, cache_index)

* ``tokens``/``positions``: [B, T] int32. Prompts are left-padded; ``positions`` count real tokens
  only (``positions_from_mask``), so a row's first real token has position 0.
* without a cache: ``kv_mask`` [B, T] marks real tokens; attention is causal over the T tokens.
  An int32 ``kv_mask`` holds segment ids instead (packed rows, ``models/packing.py``): 0 is
  padding, and each token attends only within its own segment.
* with a cache (``models/cache.py``; ``init_cache``: keys [L, B, H_kv, D, S], values [L, B, H_kv,
  S, D]): the T new tokens are written at slots ``cache_index … cache_index + T − 1``; ``kv_mask``
  [B, S] marks every slot holding a real token (prompt and generated so far, the new ones
  included); the returned cache is the updated one. Prefill is ``cache_index=0`` with the whole
  prompt (a Python 0: the prompt then attends over its own keys and reads no other slot),
  decode ``T=1``. The cache travels through the layer scan as part of the carry, so a
  decode step writes only its new slot in place.
* a prefix shared by every row (``with_shared_prefix``): its keys and values are held once for
  the batch and every query attends to them; the rows' own tokens take
  positions C, C + 1, … and slots 0, 1, … as before. Without a cache, ``prefix=`` [C] token ids
  does the same in one forward pass: the prefix runs through every layer once, not once per
  row.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from ppojax.infra.sharding import shard_rows, vocab_parallel_logits
from ppojax.models import decode_kernel
from ppojax.models.attention import accelerator_platform, allowed_keys, attend, attention
from ppojax.models.attention import attention_path, check_prefix
from ppojax.models.cache import fills_from_start, layer_prefix, update_cache
from ppojax.models.cache import keys_transposed as keys_transposed_in
from ppojax.models.config import REMAT_POLICIES, ModelConfig
from ppojax.models.families import NORM_PLACES
from ppojax.models.kernels import dot_f32_accumulate
from ppojax.models.layers import MLP, Linear, lora_a_init, norm_layer, softcap  # noqa: F401
from ppojax.models.rope import apply_rope, layer_rope, model_rope, stack_ropes

Array = jax.Array


class Attention(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x, rope, kv_mask, cache, layer, cache_index, window, positions,
               prefix=None):
    """Self-attention of x [B, T, D] at ``positions`` [B, T] → (out [B, T, D], cache, prefix
    out [1, C, D] or None).

    ``prefix``: (xp [1, C, D], its RoPE) for a cache-free forward pass over rows that all
    begin with the same C tokens (``Decoder``'s ``prefix``): the prefix attends causally to
    itself, once, and every row's queries attend to its keys and values before their own.
    q/k norms (``cfg.qk_norm``, before RoPE): "head" over each head's D, "proj" over all H·D."""
    cfg = self.cfg
    h, hk, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qk_norms = (norm_layer(cfg, "q_norm"), norm_layer(cfg, "k_norm")) if cfg.qk_norm else None
    if cfg.fused_projections:  # one matmul, split by columns: [q | k | v]
      qkv = Linear(cfg, (h + 2 * hk) * d, cfg.qkv_bias, name="qkv")
      project = lambda x: jnp.split(qkv(x), [h * d, (h + hk) * d], axis=-1)  # noqa: E731
    else:
      qkv = [Linear(cfg, n * d, cfg.qkv_bias, name=name)
             for n, name in ((h, "q"), (hk, "k"), (hk, "v"))]
      project = lambda x: [proj(x) for proj in qkv]  # noqa: E731
    o_proj = Linear(cfg, cfg.hidden_size, cfg.out_bias, name="o")

    def heads(x, rope):
      """q [B, T, H, D], k [B, T, H_kv, D] (rotated), v [B, H_kv, T, D]."""
      b, t, _ = x.shape
      q, k, v = project(x)
      if cfg.qk_norm == "proj":
        q, k = qk_norms[0](q), qk_norms[1](k)
      q, k, v = q.reshape(b, t, h, d), k.reshape(b, t, hk, d), v.reshape(b, t, hk, d)
      if cfg.qk_norm == "head":
        q, k = qk_norms[0](q), qk_norms[1](k)
      if rope is not None:  # None: NoPE layers; GPT-2 adds learned positions to the embeddings
        q, k = apply_rope(q, rope), apply_rope(k, rope)
      return q, k, v.transpose(0, 2, 1, 3)

    (b, t, _), (q, k, v) = x.shape, heads(x, rope)
    cache, (k, v, keys_transposed), (q_slots, kv_slots), kv_mask = _keys_to_attend(
        cfg, cache, layer, cache_index, k, v, kv_mask)
    shared = layer_prefix(cache, layer, keys_transposed_in(cfg))  # a prefix every row sees
    out_p = None
    if self.fused_decode(t, keys_transposed, v.shape[2], shared):  # Pallas's kernel, fused
      visible = allowed_keys(q_slots, kv_slots, window, kv_mask)[:, 0]
      out = decode_kernel.decode_attention(q[:, 0], k.astype(q.dtype), v.astype(q.dtype), visible,
                                           interpret=accelerator_platform() != "cuda",
                                           **self.scores)
      return o_proj(out.reshape(b, t, h * d)), cache, out_p
    if prefix is not None:  # the prefix's own causal attention, then its keys for every row
      xp, rope_p = prefix
      qp, kp, vp = heads(xp, rope_p)
      c = xp.shape[1]
      causal = allowed_keys(jnp.arange(c), jnp.arange(c), window, jnp.ones((1, c), jnp.bool_))
      out_p = attend(qp, kp.transpose(0, 2, 1, 3).astype(qp.dtype), vp.astype(qp.dtype), causal,
                     **self.scores)
      out_p = o_proj(out_p.reshape(1, c, h * d))
      shared = kp[0].transpose(1, 2, 0), vp[0]  # [H_kv, D, C], [H_kv, C, D]
    out = attention(attention_path(cfg.attention, cfg.compute_dtype, d), q, k, v,
                    (q_slots, kv_slots), window, kv_mask, bool(keys_transposed), shared, positions,
                    prefix_window=window if any(cfg.windows) else 0,
                    aligned=keys_transposed is None, **self.scores)
    return o_proj(out.reshape(b, t, h * d)), cache, out_p

  def fused_decode(self, t: int, keys_transposed, slots: int, shared) -> bool:
    """Whether this step's attention takes ``decode_kernel``: one query per row over the cache
    (``keys_transposed`` False: keys in the kernel's layout; None: no cache read), of a length
    it takes, with no shared prefix."""
    return (t == 1 and keys_transposed is False and shared is None
            and slots % decode_kernel.SLOT_MULTIPLE == 0)

  @property
  def scores(self) -> dict:
    """How scores are scaled and capped: q·kᵀ / √``query_pre_attn_scalar`` (head_dim unless
    the config says otherwise), then c·tanh(s/c) with ``attn_softcap`` c."""
    return dict(scale_base=self.cfg.query_pre_attn_scalar, softcap=self.cfg.attn_softcap)


def _keys_to_attend(cfg, cache, layer, cache_index, k, v, kv_mask):
  """This layer's new keys k [B, T, H_kv, D] and values v [B, H_kv, T, D] written into the cache
  in place (where there is one), and what the T queries attend to: (cache, (keys, values, the
  keys' layout: True [B, H_kv, D, S], False [B, H_kv, S, D], None: no cache read), (query slots
  [T], key slots [S]), kv_mask [B, S])."""
  t = k.shape[1]
  transposed = keys_transposed_in(cfg)  # the cache's key layout
  if cache is not None:
    cache, k_all, v_all = update_cache(cache, layer, cache_index, k.transpose(
        (0, 2, 3, 1) if transposed else (0, 2, 1, 3)), v, transposed)
    if not fills_from_start(cache_index):  # attend over all its slots
      slots = cache_index + jnp.arange(t), jnp.arange(v_all.shape[2])
      return cache, (k_all, v_all, transposed), slots, kv_mask
  # no cache, or a prefill from slot 0: causally, the T tokens see only their own keys
  return cache, (k.transpose(0, 2, 1, 3), v, None), (jnp.arange(t),) * 2, kv_mask[:, :t]


class Block(nn.Module):
  """A residual block as ``cfg.sublayer_norms`` places its norms: "pre" (Llama) x + f(norm(x)),
  "post" (OLMo 2) x + norm(f(x)), "both" (Gemma) x + post_norm(f(pre_norm(x))), for f the
  attention, then the MLP. The same for the shared prefix's hidden states ``xp`` [1, C, D]
  (None without one), whose keys every row attends to. ``rope``: this layer's (cos, sin), or
  None for a layer without RoPE; in a layer scan with per-layer RoPE, ``rope_id`` indexes
  the stacked tables (``rope.stack_ropes``)."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, carry, layer, window, rope_id, rope, kv_mask, cache_index, positions,
               prefix_rope=None):
    x, cache, xp = carry
    cfg = self.cfg
    if rope_id is not None:  # a layer scan: this layer's table of ``stack_ropes``' stack
      pick = lambda r: None if r is None else tuple(t[rope_id] for t in r)  # noqa: E731
      rope, prefix_rope = pick(rope), pick(prefix_rope)
    norms = {name: norm_layer(cfg, name) for name in NORM_PLACES[cfg.sublayer_norms]}
    norm = lambda name, x: norms[name](x) if name in norms else x  # noqa: E731
    mlp = MLP(cfg, name="mlp")
    prefix = None if xp is None else (norm("attn_norm", xp), prefix_rope)
    attn, cache, attn_p = Attention(cfg, name="attn")(
        norm("attn_norm", x), rope, kv_mask, cache, layer, cache_index, window, positions, prefix)
    x = x + norm("attn_post_norm", attn)
    x = shard_rows(x + norm("mlp_post_norm", mlp(norm("mlp_norm", x))))
    if xp is not None:
      xp = xp + norm("attn_post_norm", attn_p)
      xp = xp + norm("mlp_post_norm", mlp(norm("mlp_norm", xp)))
    return (x, cache, xp), None


class Decoder(nn.Module):
  """Embeddings → scanned blocks → final norm. Returns hidden states [B, T, D] and the cache."""

  cfg: ModelConfig

  def setup(self):
    cfg = self.cfg
    embed = lambda n, name: nn.Embed(  # noqa: E731
        n, cfg.hidden_size, dtype=cfg.compute_dtype, param_dtype=cfg.param_dtype,
        embedding_init=nn.initializers.normal(0.02), name=name)
    self.embed = embed(cfg.vocab_size, "embed")
    if cfg.positions == "learned":
      self.wpe = embed(cfg.max_position_embeddings, "wpe")
    block = nn.remat(Block, prevent_cse=not cfg.scan_layers,
                     policy=REMAT_POLICIES[cfg.remat_policy]) if cfg.remat else Block
    if cfg.scan_layers:
      self.layers = nn.scan(
          block, variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True},
          in_axes=(0, 0, 0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast,
                   nn.broadcast),
          length=cfg.num_layers,
      )(cfg, name="layers")
    else:
      self.layers = [block(cfg, name=f"layers_{i}") for i in range(cfg.num_layers)]
    self.final_norm = norm_layer(cfg, "final_norm")

  def embedded(self, tokens):
    """Token embeddings, × ``cfg.embed_scale`` rounded to the compute dtype (Gemma's √d)."""
    x = self.embed(tokens)
    scale = self.cfg.embed_scale
    return x * jnp.asarray(scale, x.dtype) if scale != 1.0 else x

  def __call__(self, tokens, positions, kv_mask, cache=None, cache_index=0, rope=None,
               prefix=None):
    """``rope``: ``model_rope(cfg, positions)`` when the caller already has it (a decode loop
    computes it once for all its steps, outside its loop: docs/performance/decode.md).

    ``prefix``: [C] token ids that precede every row (no cache): they take positions 0 … C − 1
    and the rows' ``positions`` start at C; the prefix runs through each layer once, for the
    whole batch, and every row's queries attend to its keys. The rows' outputs are those of
    the rows with the prefix prepended, up to float rounding."""
    cfg = self.cfg
    x = shard_rows(self.embedded(tokens))
    if cfg.positions == "learned":
      x, rope = x + self.wpe(positions), None
    elif rope is None:
      rope = model_rope(cfg, positions)
    windows = cfg.windows
    xp = rope_p = None
    if prefix is not None:
      check_prefix(prefix, cache)
      positions_p = jnp.arange(prefix.shape[0], dtype=jnp.int32)[None]
      xp = self.embedded(prefix[None].astype(jnp.int32))
      if cfg.positions == "learned":
        xp = xp + self.wpe(positions_p)
      else:
        rope_p = model_rope(cfg, positions_p)
    if cfg.scan_layers:
      if not isinstance(cache_index, int):  # a Python 0 stays static (``fills_from_start``)
        cache_index = jnp.asarray(cache_index, jnp.int32)
      layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
      rope_ids = None
      if cfg.rope_per_layer:  # one stacked table per RoPE kind, each layer's index scanned
        rope, rope_ids = stack_ropes(cfg, rope)
        rope_p = None if rope_p is None else stack_ropes(cfg, rope_p)[0]
      (x, cache, _), _ = self.layers((x, cache, xp), layer_ids, jnp.asarray(windows, jnp.int32),
                                     rope_ids, rope, kv_mask, cache_index, positions, rope_p)
    else:
      for i, layer in enumerate(self.layers):
        (x, cache, xp), _ = layer((x, cache, xp), i, windows[i], None, layer_rope(cfg, rope, i),
                                  kv_mask, cache_index, positions, layer_rope(cfg, rope_p, i))
    return self.final_norm(x), cache


class CausalLM(nn.Module):
  """Next-token logits [B, T, V] (compute dtype) and the updated cache."""

  cfg: ModelConfig

  def setup(self):
    self.model = Decoder(self.cfg)
    if not self.cfg.tie_word_embeddings:
      self.lm_head = Linear(self.cfg, self.cfg.vocab_size, False, name="lm_head")

  def __call__(self, tokens, positions, kv_mask, cache=None, cache_index=0, last_only=False,
               rope=None, prefix=None):
    """``last_only``: logits of the last position only, [B, 1, V] (a generation prefill needs
    no others, and the LM head over a whole prompt costs as much as several layers). ``rope``,
    ``prefix``: see ``Decoder``."""
    x, cache = self.hidden(tokens, positions, kv_mask, cache, cache_index, rope, prefix)
    return self.logits(x[:, -1:] if last_only else x), cache

  def hidden(self, tokens, positions, kv_mask, cache=None, cache_index=0, rope=None,
             prefix=None):
    """Final hidden states [B, T, D] and the cache (``apply(..., method="hidden")``)."""
    return self.model(tokens, positions, kv_mask, cache, cache_index, rope, prefix)

  def logits(self, x):
    """The LM head on hidden states [..., D] → [..., V] (``apply(..., method="logits")``); tied
    embeddings: x·Eᵀ, accumulated in float32 like every other matmul (``dot_f32_accumulate``),
    vocabulary-parallel under a mesh (``sharding.vocab_parallel_logits``); soft-capped,
    c·tanh(z/c), where the model says so (``final_softcap``: Gemma 2)."""
    if not self.cfg.tie_word_embeddings:
      return softcap(shard_rows(self.lm_head(x)), self.cfg.final_softcap)
    embed = self.model.embed
    x, table = embed.promote_dtype(x, embed.embedding, dtype=embed.dtype)

    def dot(x, table):  # x·Eᵀ
      return dot_f32_accumulate(x, table, (((x.ndim - 1,), (1,)), ((), ())))
    return softcap(shard_rows(vocab_parallel_logits(x, table, dot)), self.cfg.final_softcap)


class ValueModel(nn.Module):
  """A scalar per position [B, T] (float32) from a linear head on the final hidden state.

  As a critic, out[:, t] is V(s_t); as a reward model, the score of a sequence is ``out`` read
  at its last response token (``ops.gather_last(out, mask)``). The head is named ``score`` like
  Hugging Face's ``*ForSequenceClassification`` (num_labels=1), so trl / OpenRLHF reward models
  load.
  """

  cfg: ModelConfig

  @nn.compact
  def __call__(self, tokens, positions, kv_mask, cache=None, cache_index=0, prefix=None):
    """``prefix``: see ``Decoder``."""
    x, cache = Decoder(self.cfg, name="model")(tokens, positions, kv_mask, cache, cache_index,
                                               prefix=prefix)
    head = nn.Dense(1, use_bias=False, dtype=jnp.float32, param_dtype=self.cfg.param_dtype,
                    kernel_init=nn.initializers.normal(1.0 / math.sqrt(self.cfg.hidden_size + 1)),
                    name="score")
    return head(x.astype(jnp.float32))[..., 0], cache
