"""Models: parity with transformers' PyTorch implementations on tiny random checkpoints that the
tests write themselves (no hub), KV-cache decoding, export back to Hugging Face, loading errors,
numerics options and config round trips.

Every checkpoint is built by transformers with random weights (all parameters perturbed, so norm
scales and biases are not trivially 1 and 0), saved with ``save_pretrained`` (safetensors) and
loaded with ``hf.load_config`` + ``hf.params_from_hf(cfg, hf.read_safetensors(dir))``.
"""

from __future__ import annotations

import functools
import json
import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import transformers as tf

from ppojax.core import ops
from ppojax.models import cache as C
from ppojax.models import hf, layout
from ppojax.models import kernels as K
from ppojax.models import rope as R
from ppojax.models import transformer as T
from ppojax.models.config import REMAT_POLICIES, ModelConfig

V, D, I, L, H = 97, 64, 96, 2, 4  # vocab, hidden, intermediate, layers, heads
B, S = 3, 12  # batch, sequence
LEFT_PAD = (0, 3, 7)  # ragged left padding per row (row 0 unpadded)
PAD_ID = 0  # real tokens are drawn from 1..V-1
TOL = 1e-4

_LLAMA = dict(vocab_size=V, hidden_size=D, intermediate_size=I, num_hidden_layers=L,
              num_attention_heads=H, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
              pad_token_id=PAD_ID)
_GPT2 = dict(vocab_size=V, n_embd=D, n_layer=L, n_head=H, n_positions=64, bos_token_id=1,
             eos_token_id=2, pad_token_id=PAD_ID)

# name -> (config class, model class, config kwargs)
CASES = {
    "llama-gqa": ("LlamaConfig", "LlamaForCausalLM", dict(_LLAMA, num_key_value_heads=2)),
    "llama-mha-tied": ("LlamaConfig", "LlamaForCausalLM",
                       dict(_LLAMA, num_key_value_heads=H, tie_word_embeddings=True)),
    "llama-mqa-headdim": ("LlamaConfig", "LlamaForCausalLM",
                          dict(_LLAMA, num_key_value_heads=1, head_dim=8)),  # H·D_h ≠ hidden
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM", dict(
        _LLAMA, num_key_value_heads=2, rope_theta=500.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "llama-linear-rope": ("LlamaConfig", "LlamaForCausalLM", dict(
        _LLAMA, num_key_value_heads=2, rope_scaling={"rope_type": "linear", "factor": 3.0})),
    "qwen2-tied": ("Qwen2Config", "Qwen2ForCausalLM",
                   dict(_LLAMA, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen2-untied-window": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        _LLAMA, num_key_value_heads=2, tie_word_embeddings=False, use_sliding_window=True,
        sliding_window=4, max_window_layers=1)),  # layer 0 full, layer 1 sliding
    "mistral-window": ("MistralConfig", "MistralForCausalLM",
                       dict(_LLAMA, num_key_value_heads=2, sliding_window=5)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(_GPT2)),
    "gpt2-untied": ("GPT2Config", "GPT2LMHeadModel", dict(_GPT2, tie_word_embeddings=False)),
}
VALUE_CASES = {
    "llama": ("LlamaConfig", "LlamaForSequenceClassification",
              dict(_LLAMA, num_key_value_heads=2, num_labels=1)),
    "gpt2": ("GPT2Config", "GPT2ForSequenceClassification", dict(_GPT2, num_labels=1)),
}


@pytest.fixture(scope="module")
def torch():
  torch = pytest.importorskip("torch")
  torch.set_num_threads(2)
  return torch


def _perturb(torch, model, seed):
  """Random weights everywhere (norm scales ≈ 1, biases ≠ 0) so a swapped tensor shows."""
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.05 * torch.randn(p.shape, generator=g))
  return model.eval()


@functools.lru_cache(maxsize=None)
def _build(name, value, root):
  """(torch model, checkpoint dir) for a case, written once per session."""
  import torch  # pylint: disable=import-outside-toplevel  (the ``torch`` fixture ran first)
  config_cls, model_cls, kwargs = (VALUE_CASES if value else CASES)[name]
  torch.manual_seed(0)
  model = getattr(tf, model_cls)(getattr(tf, config_cls)(**kwargs))
  model = _perturb(torch, model, seed=sum(map(ord, name)))
  directory = pathlib.Path(root) / (("value-" if value else "") + name)
  model.save_pretrained(str(directory))
  return model, directory


@pytest.fixture(scope="module")
def checkpoint(torch, tmp_path_factory):
  root = str(tmp_path_factory.mktemp("ckpt"))
  return lambda name, value=False: _build(name, value, root)


def _load(directory, head="lm", **overrides):
  cfg = hf.load_config(directory, **overrides)
  return cfg, hf.params_from_hf(cfg, hf.read_safetensors(directory), head=head)


def _batch(left_pad=LEFT_PAD, right_pad=None, length=S, seed=0):
  rng = np.random.RandomState(seed)
  tokens = rng.randint(1, V, (len(left_pad), length))
  idx = np.arange(length)[None]
  mask = idx >= np.asarray(left_pad)[:, None]
  if right_pad is not None:
    mask &= idx < length - np.asarray(right_pad)[:, None]
  tokens = np.where(mask, tokens, PAD_ID)
  positions = np.asarray(C.positions_from_mask(jnp.asarray(mask)))
  return tokens.astype(np.int32), positions.astype(np.int32), mask


@functools.lru_cache(maxsize=None)
def _jit_apply(cfg, value=False):
  model = (T.ValueModel if value else T.CausalLM)(cfg)
  return jax.jit(lambda p, tok, pos, m: model.apply({"params": p}, tok, pos, m)[0])


def _ours(cfg, params, tokens, positions, mask, value=False):
  return np.asarray(_jit_apply(cfg, value)(params, tokens, positions, mask), np.float32)


def _theirs(torch, model, tokens, positions, mask):
  with torch.no_grad():
    return model(input_ids=torch.tensor(tokens, dtype=torch.long),
                 attention_mask=torch.tensor(mask, dtype=torch.long),
                 position_ids=torch.tensor(positions, dtype=torch.long)).logits.float().numpy()


def _max_diff(a, b, mask):
  """max |a − b| over real positions (mask [B, T]; a, b [B, T] or [B, T, V])."""
  m = mask if a.ndim == 2 else mask[..., None]
  return float(np.abs(np.where(m, a - b, 0.0)).max())


# ---------------------------------------------------------------------------------------------
# 1. Logits parity with transformers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(torch, checkpoint, name):
  model, directory = checkpoint(name)
  cfg, params = _load(directory)
  assert cfg.tie_word_embeddings == ("lm_head" not in params)
  tokens, positions, mask = _batch()
  ours = _ours(cfg, params, tokens, positions, mask)
  theirs = _theirs(torch, model, tokens, positions, mask)
  assert ours.shape == theirs.shape == (B, S, V)
  assert np.abs(theirs[mask]).max() > 0.1  # the logits are not trivially small
  assert _max_diff(ours, theirs, mask) <= TOL


def test_config_reads_architecture_details(checkpoint):
  cases = {name: hf.load_config(checkpoint(name)[1]) for name in CASES}
  assert cases["llama-gqa"].num_kv_heads == 2 and cases["llama-mha-tied"].num_kv_heads == H
  assert cases["llama-mqa-headdim"].head_dim == 8
  assert cases["llama3-rope"].rope_type == "llama3"
  assert cases["llama-linear-rope"].rope_type == "linear"
  for name in ("llama3-rope", "llama-linear-rope"):  # the scaling really changes the frequencies
    cfg = cases[name]
    scaled, plain = R.rope_inv_freq(cfg), R.rope_inv_freq(cfg.replace(rope_scaling=None))
    assert (scaled < plain).any()
  # llama3: the three wavelength bands (kept, smoothed, divided by the factor) all occur
  ratio = R.rope_inv_freq(cases["llama3-rope"]) / R.rope_inv_freq(
      cases["llama3-rope"].replace(rope_scaling=None))
  assert np.isclose(ratio, 1).any() and np.isclose(ratio, 1 / 8).any()
  assert ((ratio > 1 / 8 + 1e-3) & (ratio < 1 - 1e-3)).any()
  assert cases["qwen2-tied"].qkv_bias and cases["qwen2-tied"].tie_word_embeddings
  assert cases["qwen2-untied-window"].layer_windows == (0, 4)
  assert cases["mistral-window"].layer_windows == (5, 5)
  assert cases["gpt2"].is_gpt2 and cases["gpt2"].tie_word_embeddings
  assert not cases["gpt2-untied"].tie_word_embeddings


# ---------------------------------------------------------------------------------------------
# 2. Value model from a *ForSequenceClassification checkpoint
# ---------------------------------------------------------------------------------------------


def _torch_scores(torch, model, tokens, positions, mask):
  """Per-position score logits: transformers' backbone, then ``score`` at every position."""
  backbone = model.transformer if hasattr(model, "transformer") else model.model
  with torch.no_grad():
    hidden = backbone(input_ids=torch.tensor(tokens, dtype=torch.long),
                      attention_mask=torch.tensor(mask, dtype=torch.long),
                      position_ids=torch.tensor(positions, dtype=torch.long)).last_hidden_state
    per_position = model.score(hidden)[..., 0].numpy()
    pooled = model(input_ids=torch.tensor(tokens, dtype=torch.long),
                   attention_mask=torch.tensor(mask, dtype=torch.long),
                   position_ids=torch.tensor(positions, dtype=torch.long)).logits[:, 0].numpy()
  return per_position, pooled


@pytest.mark.parametrize("name", list(VALUE_CASES))
def test_value_model_matches_sequence_classification(torch, checkpoint, name):
  model, directory = checkpoint(name, value=True)
  cfg, params = _load(directory, head="value")
  assert set(params) == {"model", "score"}
  # Right-padded / unpadded rows: transformers pools at the last non-pad token.
  tokens, positions, mask = _batch(left_pad=(0, 0, 0), right_pad=(0, 4, 2))
  values = _ours(cfg, params, tokens, positions, mask, value=True)
  per_position, pooled = _torch_scores(torch, model, tokens, positions, mask)
  assert values.shape == (B, S) and values.dtype == np.float32
  assert _max_diff(values, per_position, mask) <= TOL
  last = np.asarray(ops.last_index(jnp.asarray(mask)))
  np.testing.assert_array_equal(last, [S - 1, S - 5, S - 3])
  np.testing.assert_allclose(values[np.arange(B), last], pooled, atol=TOL, rtol=0)
  # Left-padded rows (prompts, as the critic sees them in PPO): the last token is the last slot.
  tokens, positions, mask = _batch()
  values = _ours(cfg, params, tokens, positions, mask, value=True)
  per_position, pooled = _torch_scores(torch, model, tokens, positions, mask)
  assert _max_diff(values, per_position, mask) <= TOL
  np.testing.assert_allclose(values[:, -1], pooled, atol=TOL, rtol=0)


def test_value_head_from_policy_checkpoint_is_rejected_without_score(checkpoint):
  _, directory = checkpoint("llama-gqa")
  cfg = hf.load_config(directory)
  with pytest.raises(hf.CheckpointError, match="score.weight"):
    hf.params_from_hf(cfg, hf.read_safetensors(directory), head="value")


# ---------------------------------------------------------------------------------------------
# 3. KV cache: prefill + cached decoding == one full forward pass
# ---------------------------------------------------------------------------------------------


def _random_params(cfg, seed=0):
  """Random params of the flax shapes (no init compiled), at a scale where errors show; norm
  scales ≈ 1."""
  tokens = jnp.zeros((1, 4), jnp.int32)
  shapes = jax.eval_shape(lambda: T.CausalLM(cfg).init(
      jax.random.PRNGKey(0), tokens, tokens, tokens > -1)["params"])
  rng = np.random.RandomState(seed)
  return jax.tree_util.tree_map_with_path(
      lambda path, x: ((1.0 if "scale" in jax.tree_util.keystr(path) else 0.0)
                       + 0.15 * rng.standard_normal(x.shape)).astype(x.dtype), shapes)


def _tiny_config(model_type, **changes):
  base = dict(model_type=model_type, vocab_size=V, hidden_size=D, intermediate_size=I,
              num_layers=L, num_heads=H, num_kv_heads=H if model_type == "gpt2" else 2,
              head_dim=D // H, max_position_embeddings=64, norm_eps=1e-5,
              tie_word_embeddings=model_type == "gpt2", qkv_bias=model_type in ("gpt2", "qwen2"),
              out_bias=model_type == "gpt2")
  return ModelConfig(**dict(base, **changes))


CACHE_CONFIGS = {
    "llama": _tiny_config("llama"),
    "gpt2": _tiny_config("gpt2"),
    "mistral-window": _tiny_config("mistral", layer_windows=(3, 3)),
    "qwen2-mixed-window": _tiny_config("qwen2", layer_windows=(0, 4)),
}
PROMPT_PAD = (0, 2, 5)
P, N_NEW, EXTRA = 7, 5, 2  # prompt length, decoded tokens, unused trailing cache slots


@functools.lru_cache(maxsize=None)
def _decode_setup(cfg):
  params = _random_params(cfg)
  tokens, _, prompt_mask = _batch(left_pad=PROMPT_PAD, length=P + N_NEW, seed=1)
  full_mask = np.concatenate([prompt_mask[:, :P], np.ones((B, N_NEW), bool)], axis=1)
  full_pos = np.asarray(C.positions_from_mask(jnp.asarray(full_mask)))
  tokens = np.where(full_mask, tokens, PAD_ID).astype(np.int32)
  full = _ours(cfg, params, tokens, full_pos, full_mask)
  return params, tokens, full_pos, full_mask, full


def _decode(cfg, params, tokens, full_pos, full_mask, prefill_fn, step_fn, cache=None):
  """Prefill the prompt (its first P tokens), then feed the others one at a time into ``cache``
  (default: an empty one of P + new + EXTRA slots); logits [B, T, V]."""
  slots = tokens.shape[1] + EXTRA
  cache = C.init_cache(cfg, B, slots) if cache is None else cache
  kv_mask = np.zeros((B, slots), bool)
  kv_mask[:, :P] = full_mask[:, :P]
  logits, cache = prefill_fn(params, tokens[:, :P], full_pos[:, :P], kv_mask, cache)
  out = [np.asarray(logits)]
  for t in range(P, tokens.shape[1]):
    kv_mask[:, t] = True
    logits, cache = step_fn(params, tokens[:, t:t + 1], full_pos[:, t:t + 1], kv_mask.copy(),
                            cache, jnp.int32(t))
    out.append(np.asarray(logits))
  return np.concatenate(out, axis=1)


@pytest.mark.parametrize("name", list(CACHE_CONFIGS))
def test_cached_decoding_matches_full_forward(name):
  """Under jit, cache_index traced: one compilation serves every decode step."""
  cfg = CACHE_CONFIGS[name]
  params, tokens, full_pos, full_mask, full = _decode_setup(cfg)
  assert np.abs(full[full_mask]).max() > 0.5
  model = T.CausalLM(cfg)
  traces = {"prefill": 0, "step": 0}

  def counted(kind):
    def fn(p, tok, pos, m, c, i=0):
      traces[kind] += 1
      return model.apply({"params": p}, tok, pos, m, c, i)
    return jax.jit(fn)

  cached = _decode(cfg, params, tokens, full_pos, full_mask, counted("prefill"), counted("step"))
  assert traces == {"prefill": 1, "step": 1}
  assert _max_diff(cached, full, full_mask) <= 1e-5


@pytest.mark.parametrize("name", ["llama", "mistral-window", "gpt2"])
def test_prefill_from_slot_zero_reads_no_other_slot(name):
  """With unrolled layers and cache_index a Python 0, the prompt attends over its own keys and
  never reads the cache's other slots: NaN left there changes nothing. It writes the same slots
  as the general path (cache_index traced), and decoding after it matches the full forward."""
  cfg = CACHE_CONFIGS[name].replace(scan_layers=False)
  params, tokens, full_pos, full_mask, full = _decode_setup(CACHE_CONFIGS[name])
  params = layout.unstack_layers(params)
  model = T.CausalLM(cfg)
  slots = P + N_NEW + EXTRA
  kv_mask = np.zeros((B, slots), bool)
  kv_mask[:, :P] = full_mask[:, :P]
  nan_cache = jax.tree.map(lambda x: jnp.full_like(x, np.nan), C.init_cache(cfg, B, slots))
  static = jax.jit(lambda p, c: model.apply({"params": p}, tokens[:, :P], full_pos[:, :P],
                                            kv_mask, c, 0))
  traced = jax.jit(lambda p, c, i: model.apply({"params": p}, tokens[:, :P], full_pos[:, :P],
                                               kv_mask, c, i))
  logits, cache = static(params, nan_cache)
  np.testing.assert_allclose(np.asarray(logits)[full_mask[:, :P]],
                             full[:, :P][full_mask[:, :P]], atol=1e-5)
  _, reference = traced(params, C.init_cache(cfg, B, slots), jnp.int32(0))
  for is_values, (ours, theirs) in enumerate(zip((cache.k, cache.v), (reference.k, reference.v))):
    for mine, ref in zip(ours, theirs):  # per layer
      mine, ref = (np.asarray(x) if is_values else np.swapaxes(np.asarray(x), -1, -2)
                   for x in (mine, ref))  # [B, H_kv, S, D]
      real = kv_mask[:, None, :, None] & np.ones_like(mine, bool)  # slots of real tokens
      np.testing.assert_allclose(mine[real], ref[real], atol=1e-5)
      assert np.isnan(mine[:, :, P:]).all()  # the other slots: left as they were
  _assert_decodes_like_full(cfg, params, tokens, full_pos, full_mask, full)


@pytest.mark.parametrize("name", ["llama", "gpt2", "mistral-window"])
@pytest.mark.parametrize("prefill_index", ["static", "traced"])
def test_shared_prefix_cache_matches_full_forward(name, prefill_index):
  """A prefix held once for the batch (``with_shared_prefix``): prefilling each row's own
  tokens after it, then decoding, gives the full forward's logits over prefix + row, on the
  prefill's fast path (cache_index a Python 0) and on the general one (traced); with a
  sliding window (3) narrower than prefix + row, the later tokens no longer see the prefix."""
  cfg = CACHE_CONFIGS[name].replace(scan_layers=False)
  params = layout.unstack_layers(_random_params(CACHE_CONFIGS[name]))
  model = T.CausalLM(cfg)
  prefix_len, new = 3, 4
  tokens, _, full_mask = _batch(left_pad=(0, 1, 3), length=P + new, seed=4)
  starts = np.argmax(full_mask, axis=1)
  prefix = tokens[0, :prefix_len].copy()
  for row, start in enumerate(starts):  # every row begins with the prefix
    tokens[row, start:start + prefix_len] = prefix
  full_pos = np.asarray(C.positions_from_mask(jnp.asarray(full_mask)))
  full = _ours(CACHE_CONFIGS[name], _random_params(CACHE_CONFIGS[name]), tokens, full_pos,
               full_mask)

  own = full_mask.copy()  # each row's tokens after the prefix
  for row, start in enumerate(starts):
    own[row, start:start + prefix_len] = False
  apply = jax.jit(lambda p, tok, pos, m, c, i: model.apply({"params": p}, tok, pos, m, c, i))
  _, prefix_cache = apply(params, prefix[None], np.arange(prefix_len)[None],
                          np.ones((1, prefix_len), bool), C.init_cache(cfg, 1, prefix_len),
                          jnp.int32(0))
  cache = C.with_shared_prefix(C.init_cache(cfg, B, P + new + EXTRA), prefix_cache)
  assert cache.prefix_k[0].shape == (cfg.num_kv_heads, cfg.head_dim, prefix_len)
  positions = prefix_len + np.asarray(C.positions_from_mask(jnp.asarray(own)))
  if prefill_index == "static":
    prefill = jax.jit(lambda p, tok, pos, m, c: model.apply({"params": p}, tok, pos, m, c, 0))
  else:
    prefill = lambda p, tok, pos, m, c: apply(p, tok, pos, m, c, jnp.int32(0))  # noqa: E731
  decoded = _decode(cfg, params, tokens, positions, own, prefill, apply, cache)
  assert own.sum() > B * new  # the rows' own prompt tokens are checked too
  np.testing.assert_allclose(decoded[own], full[own], atol=1e-5)


def _rows_with_prefix(prefix_len, length, seed):
  """Left-padded rows [B, length] that all begin with the same ``prefix_len`` tokens: (tokens,
  mask, the prefix [C], each row's mask without its prefix)."""
  tokens, _, mask = _batch(left_pad=(0, 1, 3), length=length, seed=seed)
  starts = np.argmax(mask, axis=1)
  prefix = tokens[0, :prefix_len].copy()
  own = mask.copy()
  for row, start in enumerate(starts):
    tokens[row, start:start + prefix_len] = prefix
    own[row, start:start + prefix_len] = False
  return tokens, mask, prefix, own


@pytest.mark.parametrize("name,scan,value", [("llama", True, False), ("llama", False, False),
                                             ("gpt2", True, False), ("llama", True, True),
                                             ("mistral-window", True, False),
                                             ("mistral-window", False, False)])
def test_prefix_forward_matches_full_forward(name, scan, value):
  """``prefix=`` [C] in a cache-free forward pass (the prefix run once for the batch, the rows
  after it): the outputs at the rows' own tokens and the parameter gradient of a loss on them
  equal those of the full rows (prefix + own tokens), for the policy and the value model."""
  cfg = CACHE_CONFIGS[name].replace(scan_layers=scan)
  params = _random_params(CACHE_CONFIGS[name])
  model = T.CausalLM(cfg)
  if value:
    model = T.ValueModel(cfg)
    score = jax.random.normal(jax.random.PRNGKey(3), (D, 1)) * 0.3
    params = {"model": params["model"], "score": {"kernel": score}}
  if not scan:
    params = layout.unstack_layers(params)
  prefix_len = 3
  tokens, mask, prefix, own = _rows_with_prefix(prefix_len, 10, seed=5)
  positions = np.asarray(C.positions_from_mask(jnp.asarray(mask)))
  rest = (tokens[:, prefix_len:], positions[:, prefix_len:], own[:, prefix_len:])

  def loss(p, tok, pos, m, sel, prefix=None):
    """Σ out·cos(out) over the selected positions (a loss whose gradient is not uniform)."""
    out = model.apply({"params": p}, tok, pos, m, prefix=prefix)[0]
    return jnp.sum(jnp.where(sel if value else sel[..., None], out * jnp.cos(out), 0.0)), out

  grad = jax.jit(jax.value_and_grad(loss, has_aux=True))
  (full_loss, full), full_grad = grad(params, tokens, positions, mask, own)
  (part_loss, part), part_grad = grad(params, *rest, rest[2], prefix=prefix)
  assert part.shape[1] == tokens.shape[1] - prefix_len
  sel = own[:, prefix_len:]
  np.testing.assert_allclose(np.asarray(part)[sel], np.asarray(full)[:, prefix_len:][sel],
                             atol=2e-5)
  np.testing.assert_allclose(part_loss, full_loss, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(part_grad), jax.tree.leaves(full_grad)):
    np.testing.assert_allclose(a, b, atol=1e-4 * max(1.0, float(np.abs(b).max())), rtol=0)


def test_prefix_forward_rejects_a_cache():
  tok = jnp.ones((1, 2), jnp.int32)
  cfg = CACHE_CONFIGS["llama"]
  with pytest.raises(ValueError, match="without a cache"):
    T.CausalLM(cfg).apply({"params": _random_params(cfg)}, tok, tok + 2, tok > 0,
                          C.init_cache(cfg, 1, 4), prefix=jnp.ones(2, jnp.int32))
  with pytest.raises(ValueError, match=r"one row of token ids \[C\]"):
    T.CausalLM(cfg).apply({"params": _random_params(cfg)}, tok, tok + 2, tok > 0,
                          prefix=jnp.ones((1, 2), jnp.int32))


def test_shared_prefix_needs_one_layer_layout():
  scanned = C.init_cache(CACHE_CONFIGS["llama"], 1, 3)
  unrolled = C.init_cache(CACHE_CONFIGS["llama"].replace(scan_layers=False), 1, 3)
  with pytest.raises(ValueError, match="same layer layout"):
    C.with_shared_prefix(scanned, unrolled)


def test_rope_table_of_a_bounded_range_matches_the_computed_one():
  """rope_table(..., size) gathers from a NumPy table: the same cos/sin (within float32
  rounding) as computed in the graph, and NaN for a position outside the table."""
  inv_freq = R.rope_inv_freq(_tiny_config("llama", rope_theta=500.0))
  positions = jnp.asarray(np.random.RandomState(0).randint(0, 300, (3, 9)), jnp.int32)
  for table, computed in zip(R.rope_table(positions, inv_freq, 300),
                             R.rope_table(positions, inv_freq)):
    assert table.shape == computed.shape == (3, 9, 1, inv_freq.size * 2)
    np.testing.assert_allclose(table, computed, rtol=0, atol=3e-7)
  cos, sin = R.rope_table(jnp.asarray([[0, 299, 300]]), inv_freq, 300)
  assert np.isfinite(cos[0, :2]).all() and np.isnan(cos[0, 2]).all() and np.isnan(sin[0, 2]).all()
  np.testing.assert_array_equal(cos[0, 0], 1.0)
  # beyond ROPE_TABLE_MAX entries the table is not embedded: computed, so no NaN past the bound
  big = R.ROPE_TABLE_MAX // inv_freq.size
  cos, _ = R.rope_table(jnp.asarray([[big + 5]]), inv_freq, big)
  assert np.isfinite(cos).all()


def test_sliding_window_changes_the_result():
  """Guards the window tests above against a window that is silently ignored."""
  cfg = CACHE_CONFIGS["mistral-window"]
  params, tokens, full_pos, full_mask, full = _decode_setup(cfg)
  no_window = _ours(cfg.replace(layer_windows=None), params, tokens, full_pos, full_mask)
  assert _max_diff(no_window, full, full_mask) > 1e-3
  # ... but only where a row holds more real tokens than the window.
  np.testing.assert_allclose(no_window[2, P - 1], full[2, P - 1], atol=1e-5)


# ---------------------------------------------------------------------------------------------
# 4. Export to Hugging Face
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama-gqa", "llama-mha-tied", "qwen2-tied", "gpt2",
                                  "gpt2-untied", "llama3-rope", "mistral-window",
                                  "qwen2-untied-window"])
def test_export_loads_in_transformers(torch, checkpoint, tmp_path, name):
  _, directory = checkpoint(name)
  cfg, params = _load(directory)
  out = hf.save_pretrained(tmp_path / "export", cfg, jax.tree.map(jnp.asarray, params))
  assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
  model = tf.AutoModelForCausalLM.from_pretrained(str(out)).eval()
  assert type(model).__name__ == CASES[name][1]
  tokens, positions, mask = _batch(seed=3)
  ours = _ours(cfg, params, tokens, positions, mask)
  assert _max_diff(ours, _theirs(torch, model, tokens, positions, mask), mask) <= 1e-5
  assert hf.load_config(out) == cfg
  # a tied model stores its embedding once, as transformers saves it; it reads back exactly
  stored = safetensors.numpy.load_file(str(out / "model.safetensors"))
  assert ("lm_head.weight" in stored) == (not cfg.tie_word_embeddings)
  again = _load(out)[1]
  assert jax.tree.structure(again) == jax.tree.structure(params)
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(params)))


@pytest.mark.parametrize("name", list(VALUE_CASES))
def test_export_value_model_loads_as_sequence_classification(torch, checkpoint, tmp_path, name):
  _, directory = checkpoint(name, value=True)
  cfg, params = _load(directory, head="value")
  out = hf.save_pretrained(tmp_path / "value", cfg, params, head="value")
  model = tf.AutoModelForSequenceClassification.from_pretrained(str(out)).eval()
  assert type(model).__name__ == VALUE_CASES[name][1] and model.config.num_labels == 1
  tokens, positions, mask = _batch(left_pad=(0, 0, 0), right_pad=(0, 4, 2), seed=4)
  values = _ours(cfg, params, tokens, positions, mask, value=True)
  per_position, pooled = _torch_scores(torch, model, tokens, positions, mask)
  assert _max_diff(values, per_position, mask) <= 1e-5
  last = np.asarray(ops.last_index(jnp.asarray(mask)))
  np.testing.assert_allclose(values[np.arange(B), last], pooled, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name,value", [(n, False) for n in CASES] + [(n, True) for n in
                                                                       VALUE_CASES])
def test_state_dict_round_trip_is_exact(checkpoint, name, value):
  _, directory = checkpoint(name, value=value)
  head = "value" if value else "lm"
  cfg = hf.load_config(directory)
  sd = hf.read_safetensors(directory)
  back = hf.params_to_hf(cfg, hf.params_from_hf(cfg, sd, head=head), head=head)
  moved = dict(sd)  # consume=True (load_model's): the same params, the tensors moved out
  consumed = hf.params_from_hf(cfg, moved, head=head, consume=True)
  assert not moved
  chex.assert_trees_all_equal(consumed, hf.params_from_hf(cfg, sd, head=head))
  for key, tensor in sd.items():
    assert back[key].dtype == np.float32
    np.testing.assert_array_equal(back[key], tensor, err_msg=key)
  extra = set(back) - set(sd)
  # A tied checkpoint may omit lm_head.weight; the export writes the (identical) copy.
  assert extra <= {"lm_head.weight"}
  if extra:
    assert cfg.tie_word_embeddings
    embed = "transformer.wte.weight" if cfg.is_gpt2 else "model.embed_tokens.weight"
    np.testing.assert_array_equal(back["lm_head.weight"], sd[embed])


def test_export_replaces_existing_directory_atomically(checkpoint, tmp_path):
  _, directory = checkpoint("llama-gqa")
  cfg, params = _load(directory)
  target = tmp_path / "model"
  target.mkdir()
  (target / "stale.bin").write_text("old")
  (target / "config.json").write_text("{}")
  hf.save_pretrained(target, cfg, params)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no temp dirs left behind
  assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors"]
  hf.save_pretrained(target, cfg, params)  # and again, over a complete export
  assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
  cfg2, params2 = _load(target)
  assert cfg2 == cfg
  jax.tree.map(np.testing.assert_array_equal, params2, params)


def test_failed_export_leaves_existing_directory_and_no_temp_dir(checkpoint, tmp_path):
  _, directory = checkpoint("llama-gqa")
  cfg, params = _load(directory)
  target = tmp_path / "model"
  hf.save_pretrained(target, cfg, params)
  before = (target / "model.safetensors").read_bytes()
  broken = dict(params, model=dict(params["model"], final_norm={}))  # missing a tensor
  with pytest.raises(KeyError):
    hf.save_pretrained(target, cfg, broken)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
  assert (target / "model.safetensors").read_bytes() == before


# ---------------------------------------------------------------------------------------------
# 5. Loading: shards, bfloat16, errors
# ---------------------------------------------------------------------------------------------


def test_sharded_checkpoint_loads_identically(checkpoint, tmp_path):
  model, directory = checkpoint("llama-gqa")
  model.save_pretrained(str(tmp_path), max_shard_size="40KB")
  assert (tmp_path / "model.safetensors.index.json").exists()
  assert not (tmp_path / "model.safetensors").exists()
  assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
  sharded, single = hf.read_safetensors(tmp_path), hf.read_safetensors(directory)
  assert sorted(sharded) == sorted(single)
  for key in single:
    np.testing.assert_array_equal(sharded[key], single[key], err_msg=key)


def test_bfloat16_checkpoint_is_upcast(torch, checkpoint, tmp_path):
  model, _ = checkpoint("qwen2-tied")
  bf16 = tf.Qwen2ForCausalLM(model.config)
  bf16.load_state_dict(model.state_dict())
  bf16 = bf16.to(torch.bfloat16)
  bf16.save_pretrained(str(tmp_path))
  sd = hf.read_safetensors(tmp_path)
  for key, tensor in bf16.state_dict().items():
    if key in sd:
      assert sd[key].dtype == np.float32
      np.testing.assert_array_equal(sd[key], tensor.float().numpy(), err_msg=key)
  cfg, params = _load(tmp_path)
  assert cfg.param_dtype == "float32"
  tokens, positions, mask = _batch()
  theirs = _theirs(torch, bf16.float().eval(), tokens, positions, mask)
  assert _max_diff(_ours(cfg, params, tokens, positions, mask), theirs, mask) <= TOL


@pytest.fixture
def copy_of(checkpoint, tmp_path):
  import shutil  # pylint: disable=import-outside-toplevel

  def copy(name, value=False):
    target = tmp_path / name
    shutil.copytree(checkpoint(name, value)[1], target)
    return target
  return copy


def test_missing_config_json(copy_of):
  directory = copy_of("llama-gqa")
  (directory / "config.json").unlink()
  with pytest.raises(hf.CheckpointError, match=r"config\.json is missing"):
    hf.load_config(directory)


def test_missing_weights(copy_of):
  directory = copy_of("llama-gqa")
  (directory / "model.safetensors").unlink()
  with pytest.raises(hf.CheckpointError, match=r"neither model\.safetensors"):
    hf.read_safetensors(directory)


def test_missing_shard(checkpoint, tmp_path):
  model, _ = checkpoint("llama-gqa")
  model.save_pretrained(str(tmp_path), max_shard_size="40KB")
  shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
  shard.unlink()
  with pytest.raises(hf.CheckpointError, match=f"shard .*{shard.name}.* is missing"):
    hf.read_safetensors(tmp_path)


def test_corrupt_safetensors(copy_of):
  directory = copy_of("llama-gqa")
  path = directory / "model.safetensors"
  data = path.read_bytes()
  path.write_bytes(data[: len(data) // 2])
  with pytest.raises(hf.CheckpointError, match=r"cannot read .*model\.safetensors"):
    hf.read_safetensors(directory)


def test_tensor_with_wrong_shape(copy_of):
  directory = copy_of("llama-gqa")
  config = json.loads((directory / "config.json").read_text())
  config["intermediate_size"] = I + 8
  (directory / "config.json").write_text(json.dumps(config))
  cfg = hf.load_config(directory)
  with pytest.raises(hf.CheckpointError,
                     match=r"layers\.0\.mlp\.\w+_proj\.weight.* has shape"):
    hf.params_from_hf(cfg, hf.read_safetensors(directory))


def test_missing_and_unexpected_tensors(checkpoint):
  _, directory = checkpoint("llama-gqa")
  cfg = hf.load_config(directory)
  sd = hf.read_safetensors(directory)
  missing = {k: v for k, v in sd.items() if k != "model.norm.weight"}
  with pytest.raises(hf.CheckpointError, match=r"'norm\.weight' is missing"):
    hf.params_from_hf(cfg, missing)
  with pytest.raises(hf.CheckpointError, match=r"unexpected tensors.*extra\.weight"):
    hf.params_from_hf(cfg, dict(sd, **{"model.extra.weight": np.zeros(3, np.float32)}))


@pytest.mark.parametrize("field,value,message", [
    ("model_type", "bert", r"model_type 'bert' is not supported"),
    ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4},
     r"rope_type 'yarn' is not supported"),
    ("hidden_act", "gelu", r"hidden_act 'gelu' is not supported"),
    ("attention_bias", True, r"attention_bias or mlp_bias are not supported"),
])
def test_unsupported_config(copy_of, field, value, message):
  directory = copy_of("llama-gqa")
  config = json.loads((directory / "config.json").read_text())
  config[field] = value
  config.pop("rope_scaling", None)
  (directory / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match=message) as info:
    hf.load_config(directory)
  assert isinstance(info.value, hf.CheckpointError)
  assert "config.json" in str(info.value)  # names the file


@pytest.mark.parametrize("option,message", [
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ({"scale_attn_weights": False}, "scale_attn_weights"),
    ({"activation_function": "relu"}, "activation 'relu'"),
])
def test_unsupported_gpt2_options_are_rejected(option, message):
  """Options that change GPT-2's numerics must not load silently into a different model."""
  with pytest.raises(ValueError, match=message):
    ModelConfig.from_hf(tf.GPT2Config(**_GPT2, **option).to_dict())


def test_resolve_offline_hub_id_fails_fast_with_advice(monkeypatch, tmp_path):
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  monkeypatch.setenv("HF_HOME", str(tmp_path))
  try:
    import huggingface_hub.constants as hub_constants  # pylint: disable=import-outside-toplevel
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
  except ImportError:
    pass
  with pytest.raises(hf.CheckpointError) as info:
    hf.resolve("some-org/some-model")
  message = str(info.value)
  assert "some-org/some-model" in message and "Hugging Face Hub" in message
  assert "hf download" in message and "--local-dir" in message and "pass DIR" in message


def test_resolve_local_paths(checkpoint, tmp_path):
  _, directory = checkpoint("gpt2")
  assert hf.resolve(str(directory)) == directory
  with pytest.raises(hf.CheckpointError, match="not a model directory"):
    hf.resolve(str(tmp_path / "nope"))


# ---------------------------------------------------------------------------------------------
# 6. Numerics: bfloat16 compute, rematerialisation
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama-gqa", "gpt2"])
def test_bfloat16_compute_close_to_float32(checkpoint, name):
  cfg, params = _load(checkpoint(name)[1])
  tokens, positions, mask = _batch()
  f32 = _ours(cfg, params, tokens, positions, mask)
  bf16_cfg = cfg.replace(dtype="bfloat16")
  logits = _jit_apply(bf16_cfg)(params, tokens, positions, mask)
  assert logits.dtype == jnp.bfloat16
  bf16 = np.asarray(logits, np.float32)
  assert np.isfinite(bf16).all()
  scale = np.abs(f32[mask]).max()
  assert _max_diff(bf16, f32, mask) < 0.1 * scale
  assert _max_diff(bf16, f32, mask) > 0  # it did compute in bfloat16


@pytest.mark.parametrize("policy", list(REMAT_POLICIES))
@pytest.mark.parametrize("scan_layers", [True, False])
def test_remat_gives_the_same_gradient(policy, scan_layers):
  cfg = CACHE_CONFIGS["llama"].replace(scan_layers=scan_layers)
  params = _random_params(cfg)
  tokens, positions, mask = _batch()

  def grad(cfg):
    def loss(p):
      logits, _ = T.CausalLM(cfg).apply({"params": p}, tokens, positions, mask)
      logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
      logp = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
      return -ops.masked_mean(logp, mask[:, 1:] & mask[:, :-1])
    return jax.jit(jax.value_and_grad(loss))(params)

  (loss0, g0), (loss1, g1) = grad(cfg), grad(cfg.replace(remat=True, remat_policy=policy))
  np.testing.assert_allclose(loss1, loss0, atol=1e-6, rtol=0)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=0), g1, g0)
  assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(g0)) > 1e-3



def test_remat_policies_keep_more_as_they_save_more():
  """The policies are not all the same program: compiled on CPU, the backward pass's temporaries
  grow from "nothing" (recompute the layer) to "dots_no_batch" (the weight matmuls' outputs
  kept: named inside ``Linear``, where jax's dot policies cannot see through the custom VJP) to
  "dots" (attention's products too)."""
  cfg = CACHE_CONFIGS["llama"].replace(remat=True)
  params = _random_params(cfg)
  tokens, positions, mask = _batch()

  def temp_bytes(policy):
    module = T.CausalLM(cfg.replace(remat_policy=policy))
    loss = lambda p: module.apply({"params": p}, tokens, positions, mask)[0].sum()  # noqa: E731
    return jax.jit(jax.grad(loss)).lower(params).compile().memory_analysis().temp_size_in_bytes

  sizes = [temp_bytes(p) for p in ("nothing", "dots_no_batch", "dots")]
  assert sizes[0] < sizes[1] < sizes[2], sizes


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-tied", "gpt2"])
def test_parameter_gradients_match_torch(torch, checkpoint, name):
  """∂/∂θ of Σ_real R·logits for a fixed random R [B, T, V], against torch's autograd: every
  Dense kernel's dW = xᵀ·dy (``weight_matmul``'s written-out gradient), the tied LM head's dE
  (both of its uses summed), norms, biases and embeddings."""
  model, directory = checkpoint(name)
  cfg, params = _load(directory)
  tokens, positions, mask = _batch()
  weights = np.random.RandomState(1).randn(B, S, V).astype(np.float32) * mask[..., None]

  def loss(p):
    logits, _ = T.CausalLM(cfg).apply({"params": p}, tokens, positions, mask)
    return jnp.sum(logits.astype(jnp.float32) * weights)

  ours = jax.jit(jax.grad(loss))(params)
  model.zero_grad()
  logits = model(input_ids=torch.tensor(tokens, dtype=torch.long),
                 attention_mask=torch.tensor(mask, dtype=torch.long),
                 position_ids=torch.tensor(positions, dtype=torch.long)).logits
  (logits * torch.from_numpy(weights)).sum().backward()
  theirs = hf.params_from_hf(cfg, {n: p.grad.numpy() for n, p in model.named_parameters()})
  scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(theirs))
  assert scale > 1e-2
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5 * scale, rtol=0),
               ours, theirs)


@pytest.mark.parametrize("w_axis", [0, 1])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weight_matmul_gradient_equals_autodiff(w_axis, dtype):
  """The written-out VJP equals JAX's own transpose of the same float32-accumulated dot."""
  kx, kw, ky = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (3, 5, 8)).astype(dtype)
  w = jax.random.normal(kw, (8, 6) if w_axis == 0 else (6, 8)).astype(dtype)
  dy = jax.random.normal(ky, (3, 5, 6)).astype(dtype)
  dims = (((2,), (w_axis,)), ((), ()))
  autodiff = lambda x, w: K._dot_f32(x, w, dims)  # noqa: E731
  y0, vjp0 = jax.vjp(autodiff, x, w)
  y1, vjp1 = jax.vjp(lambda x, w: K.dot_f32_accumulate(x, w, dims), x, w)
  assert y1.dtype == x.dtype
  for a, b in zip((y1, *vjp1(dy)), (y0, *vjp0(dy))):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=1e-6 if dtype == "float32" else 1e-2, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 16, K.FEW_ROWS, K.FEW_ROWS + 1])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weight_matmul_takes_columns_matmul_on_few_rows(rows, dtype):
  """On CPU, x·Wᵀ over at most FEW_ROWS rows (a decode step) runs as columns_matmul — (W·xᵀ)ᵀ
  between optimization barriers — and more rows, or an [in, out] kernel, as one plain dot;
  every form equals NumPy's product, and the gradient is the written-out one either way."""
  assert jax.default_backend() == "cpu"
  kx, kw = jax.random.split(jax.random.key(rows))
  x = jax.random.normal(kx, (1, rows, 24)).astype(dtype)
  w = jax.random.normal(kw, (40, 24)).astype(dtype)  # [out, in]
  want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
  tol = dict(rtol=1e-5, atol=1e-5) if dtype == "float32" else dict(rtol=1e-2, atol=2e-2)
  for w_axis, kernel in ((1, w), (0, w.T)):
    f = lambda x, k, w_axis=w_axis: K.weight_matmul(x, k, w_axis)  # noqa: E731
    barriers = str(jax.make_jaxpr(f)(x, kernel)).count("optimization_barrier")
    assert barriers == (2 if w_axis == 1 and rows <= K.FEW_ROWS else 0), (w_axis, barriers)
    y = jax.jit(f)(x, kernel)
    assert y.shape == (1, rows, 40) and y.dtype == x.dtype
    np.testing.assert_allclose(np.asarray(y, np.float64), want, **tol)
  dy = jax.random.normal(jax.random.key(9), (1, rows, 40)).astype(dtype)
  dx, dw = jax.vjp(lambda x, w: K.weight_matmul(x, w, 1), x, w)[1](dy)
  dy64 = np.asarray(dy, np.float64)
  np.testing.assert_allclose(np.asarray(dx, np.float64), dy64 @ np.asarray(w, np.float64), **tol)
  np.testing.assert_allclose(np.asarray(dw, np.float64),
                             dy64[0].T @ np.asarray(x, np.float64)[0], **tol)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_swiglu_gradient_equals_autodiff(dtype):
  """The written-out gradient of silu(g)·u equals autodiff's (float32 math for reference),
  saturated gates included."""
  kg, ku, ky = jax.random.split(jax.random.key(0), 3)
  gate = jnp.concatenate([jax.random.normal(kg, (64,)) * 4, jnp.array([-1e3, -30., 30., 1e3])])
  gate, up, dy = (x.astype(dtype) for x in (
      gate, jax.random.normal(ku, gate.shape), jax.random.normal(ky, gate.shape)))
  f32 = lambda g, u: jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)  # noqa: E731
  _, vjp0 = jax.vjp(f32, gate, up)
  y1, vjp1 = jax.vjp(K.swiglu, gate, up)
  assert y1.dtype == gate.dtype
  for a, b in zip(vjp1(dy), vjp0(dy.astype(jnp.float32))):
    assert a.dtype == gate.dtype and np.isfinite(np.asarray(a, np.float32)).all()
    b = np.asarray(b, np.float32)  # bf16: a few roundings of 2⁻⁸ each, relative to |b|_max
    atol = 1e-5 if dtype == "float32" else 0.03 * np.abs(b).max()
    np.testing.assert_allclose(np.asarray(a, np.float32), b, rtol=1e-5, atol=atol)

# ---------------------------------------------------------------------------------------------
# 7. Config round trip (no weights, no torch)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES) + [f"value-{n}" for n in VALUE_CASES])
def test_config_round_trip(name):
  value = name.startswith("value-")
  config_cls, _, kwargs = VALUE_CASES[name[6:]] if value else CASES[name]
  cfg = ModelConfig.from_hf(getattr(tf, config_cls)(**kwargs).to_dict())
  assert ModelConfig.from_hf(cfg.to_hf()) == cfg
  # transformers reads our dict back into the same architecture
  again = getattr(tf, config_cls)(**cfg.to_hf())
  assert ModelConfig.from_hf(again.to_dict()) == cfg


@pytest.mark.parametrize("cfg", list(CACHE_CONFIGS.values()), ids=list(CACHE_CONFIGS))
def test_config_round_trip_direct(cfg):
  assert ModelConfig.from_hf(cfg.to_hf()) == cfg
  assert hash(cfg) == hash(ModelConfig.from_hf(cfg.to_hf()))  # usable as a jit static


def test_config_reads_transformers_4_spelling():
  """rope_theta at the top level, rope_scaling with "type" instead of "rope_type"."""
  hf4 = dict(tf.LlamaConfig(**CASES["llama3-rope"][2]).to_dict())
  rope = dict(hf4.pop("rope_parameters"))
  hf4["rope_theta"] = rope.pop("rope_theta")
  rope["type"] = rope.pop("rope_type")
  hf4["rope_scaling"] = rope
  cfg5 = ModelConfig.from_hf(tf.LlamaConfig(**CASES["llama3-rope"][2]).to_dict())
  assert ModelConfig.from_hf(hf4) == cfg5


def _assert_decodes_like_full(cfg, params, tokens, full_pos, full_mask, full):
  """Cached prefill + one-token decode steps give the full forward's logits ``full``."""
  model = T.CausalLM(cfg)
  apply = jax.jit(lambda p, tok, pos, m, c, i: model.apply({"params": p}, tok, pos, m, c, i))
  decoded = _decode(cfg, params, tokens, full_pos, full_mask,
                    lambda p, tok, pos, m, c: apply(p, tok, pos, m, c, jnp.int32(0)), apply)
  np.testing.assert_allclose(decoded[full_mask], full[full_mask], atol=1e-5)


def _partition_specs(params) -> dict:
  """{leaf path: PartitionSpec} under the models' partition rules on a one-device mesh."""
  from ppojax.infra import sharding  # pylint: disable=import-outside-toplevel
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  return {jax.tree_util.keystr(k): s.spec for k, s in jax.tree_util.tree_leaves_with_path(
      sharding.param_shardings(params, mesh, layout.partition_rules()))}


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_unrolled_layers_match_scanned(name):
  """scan_layers=False (one subtree per layer, used for decoding) computes the same function,
  with and without a cache; stack_layers inverts unstack_layers; the partition rules cover both
  layouts with the same per-layer specs."""
  cfg = CACHE_CONFIGS[name]
  params, tokens, full_pos, full_mask, full = _decode_setup(cfg)
  unrolled_cfg = cfg.replace(scan_layers=False)
  unrolled = layout.unstack_layers(params)
  assert "layers" not in unrolled["model"] and f"layers_{L - 1}" in unrolled["model"]
  jax.tree.map(np.testing.assert_array_equal, layout.stack_layers(unrolled), params)
  np.testing.assert_allclose(_ours(unrolled_cfg, unrolled, tokens, full_pos, full_mask)[full_mask],
                             full[full_mask], atol=1e-5)
  _assert_decodes_like_full(unrolled_cfg, unrolled, tokens, full_pos, full_mask, full)
  # the same state dict either way
  for key, value in hf.params_to_hf(cfg, params).items():
    np.testing.assert_array_equal(hf.params_to_hf(unrolled_cfg, unrolled)[key], value)

  stacked, per_layer = _partition_specs(params), _partition_specs(unrolled)
  q = "['model']['layers']['attn']['q']['kernel']"
  assert tuple(stacked[q]) == (None, "fsdp", "tensor")
  assert tuple(per_layer[q.replace("['layers']", "['layers_0']")]) == ("fsdp", "tensor")


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_transposed_kernels_match(name):
  """transposed_kernels=True (every Linear kernel [out, in], converted by transpose_kernels:
  generate's decode layout on CPU) computes the same function, without and with a cache, as a
  causal LM and as a value model; transpose_kernels swaps exactly the Linear kernels' matrix
  axes (not the embeddings, not the value head) and is its own inverse."""
  cfg = CACHE_CONFIGS[name]
  params, tokens, full_pos, full_mask, full = _decode_setup(cfg)
  t_cfg, t_params = cfg.replace(transposed_kernels=True), layout.transpose_kernels(params)
  q = params["model"]["layers"]["attn"]["q"]["kernel"]  # [L, in, out]
  np.testing.assert_array_equal(t_params["model"]["layers"]["attn"]["q"]["kernel"],
                                np.swapaxes(q, 1, 2))
  np.testing.assert_array_equal(t_params["model"]["embed"]["embedding"],
                                params["model"]["embed"]["embedding"])
  jax.tree.map(np.testing.assert_array_equal, layout.transpose_kernels(t_params), params)
  np.testing.assert_allclose(_ours(t_cfg, t_params, tokens, full_pos, full_mask)[full_mask],
                             full[full_mask], atol=1e-5)
  _assert_decodes_like_full(t_cfg, t_params, tokens, full_pos, full_mask, full)

  value_params = T.ValueModel(cfg).init(jax.random.key(3), tokens, full_pos, full_mask)["params"]
  t_value = layout.transpose_kernels(value_params)
  np.testing.assert_array_equal(t_value["score"]["kernel"], value_params["score"]["kernel"])
  np.testing.assert_allclose(_ours(t_cfg, t_value, tokens, full_pos, full_mask, value=True),
                             _ours(cfg, value_params, tokens, full_pos, full_mask, value=True),
                             atol=1e-5)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize("scan", [True, False])
def test_fused_projections_match_separate(name, scan):
  """fused_projections=True (q/k/v and gate/up joined by fuse_projections, the decode layout of
  generate) computes the same function, without and with a cache; the joined kernels are the
  column blocks [q | k | v] and [gate | up], and the partition rules shard them like q and
  gate."""
  cfg = CACHE_CONFIGS[name]
  params, tokens, full_pos, full_mask, full = _decode_setup(cfg)
  cfg = cfg.replace(scan_layers=scan)
  params = params if scan else layout.unstack_layers(params)
  fused_cfg = cfg.replace(fused_projections=True)
  fused = layout.fuse_projections(params)
  layer = fused["model"]["layers" if scan else "layers_1"]
  plain = params["model"]["layers" if scan else "layers_1"]
  assert set(layer["attn"]) == {"qkv", "o"}
  np.testing.assert_array_equal(
      layer["attn"]["qkv"]["kernel"],
      np.concatenate([plain["attn"][p]["kernel"] for p in "qkv"], axis=-1))
  if name == "llama":
    assert set(layer["mlp"]) == {"gate_up", "down"}
    h = plain["mlp"]["gate"]["kernel"].shape[-1]
    np.testing.assert_array_equal(layer["mlp"]["gate_up"]["kernel"][..., h:],
                                  plain["mlp"]["up"]["kernel"])
  else:  # GPT-2: fc/proj stay as they are; q/k/v carry biases
    assert set(layer["mlp"]) == {"fc", "proj"} and "bias" in layer["attn"]["qkv"]
  np.testing.assert_allclose(_ours(fused_cfg, fused, tokens, full_pos, full_mask)[full_mask],
                             full[full_mask], atol=1e-5)
  _assert_decodes_like_full(fused_cfg, fused, tokens, full_pos, full_mask, full)

  specs = _partition_specs(fused)
  prefix = "['model']['layers']" if scan else "['model']['layers_1']"
  lead = (None,) if scan else ()
  assert tuple(specs[prefix + "['attn']['qkv']['kernel']"]) == lead + ("fsdp", "tensor")
  if name == "llama":
    assert tuple(specs[prefix + "['mlp']['gate_up']['kernel']"]) == lead + ("fsdp", "tensor")


@pytest.mark.parametrize("head", ["lm", "value"])
def test_to_transformers_builds_the_same_model_in_memory(torch, head):
  cfg = CACHE_CONFIGS["llama"]
  tokens, positions, mask = _batch(left_pad=(0, 0, 0))
  module = T.ValueModel(cfg) if head == "value" else T.CausalLM(cfg)
  params = module.init(jax.random.PRNGKey(3), tokens, positions, mask)["params"]
  net = hf.to_transformers(cfg, params, head=head)
  with torch.no_grad():
    if head == "value":  # per-position scores: the backbone, then the head
      hidden = net.model(input_ids=torch.tensor(tokens, dtype=torch.long)).last_hidden_state
      ref = net.score(hidden)[..., 0].numpy()
    else:
      ref = net(input_ids=torch.tensor(tokens, dtype=torch.long)).logits.numpy()
  ours = np.asarray(module.apply({"params": params}, tokens, positions, mask)[0])
  np.testing.assert_allclose(ours, ref, atol=1e-5)
