"""The 2026 families (Qwen3, Gemma 2, Gemma 3 text, OLMo 2, OLMo 3, SmolLM3) against transformers'
PyTorch models, on tiny random configs built from transformers' own config classes (no download):
float32 logits, cached greedy decoding (scanned and unrolled layers, with and without a shared
prefix, sliding windows past their width), export back to transformers, LoRA with peft's layout,
and the value/reward head on each backbone. Plus the family rows themselves and the errors for
what is out of scope (MoE, unknown layer types).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers as tf

from ppojax.models import families, hf, layout, lora
from ppojax.models import cache as C
from ppojax.models import transformer as T
from ppojax.rollout import sampling
from ppojax.rollout.sampling import SamplingConfig, generate

torch = pytest.importorskip("torch")

V, D, I, HEADS = 97, 64, 96, 4
PAD, STOP = 0, 96  # real tokens are 1 … 95; STOP ends a response
WINDOW = 4  # sliding window: prompts of 10 + 32 new tokens slide far past it
NEW = 32  # greedy tokens compared with transformers
TOL = 1e-4

_COMMON = dict(vocab_size=V, hidden_size=D, intermediate_size=I, num_attention_heads=HEADS,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
               bos_token_id=1, eos_token_id=STOP, pad_token_id=PAD)
_SLIDE, _FULL = "sliding_attention", "full_attention"
# name -> (config class, causal-LM class, sequence-classification class, config kwargs)
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "Qwen3ForSequenceClassification", dict(
        _COMMON, num_hidden_layers=3, tie_word_embeddings=False, use_sliding_window=True,
        sliding_window=WINDOW, layer_types=[_FULL, _SLIDE, _SLIDE], rope_theta=1000.0)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", "Gemma2ForSequenceClassification", dict(
        _COMMON, num_hidden_layers=2, sliding_window=WINDOW, layer_types=[_SLIDE, _FULL],
        query_pre_attn_scalar=24, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", "Gemma3TextForSequenceClassification",
               dict(_COMMON, num_hidden_layers=3, sliding_window=WINDOW,
                    layer_types=[_SLIDE, _SLIDE, _FULL], query_pre_attn_scalar=16,
                    rope_parameters={_FULL: {"rope_type": "linear", "factor": 2.0,
                                             "rope_theta": 1e6},
                                     _SLIDE: {"rope_type": "default", "rope_theta": 100.0}})),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", "Olmo2ForSequenceClassification", dict(
        _COMMON, num_hidden_layers=2, tie_word_embeddings=False)),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", "Olmo3ForSequenceClassification", dict(
        _COMMON, num_hidden_layers=4, sliding_window=WINDOW,
        layer_types=[_SLIDE, _SLIDE, _SLIDE, _FULL])),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", "SmolLM3ForSequenceClassification", dict(
        _COMMON, num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0], rope_theta=5000.0)),
}
NAMES = list(FAMILIES)


def _perturb(model, seed):
  """Random weights everywhere (norm scales and Gemma's zero-initialised (1 + w) scales moved),
  so a swapped, missing or mis-offset tensor shows."""
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.1 * torch.randn(p.shape, generator=g))
  return model.eval()


@functools.lru_cache(maxsize=None)
def _hf_model(name: str, head: str = "lm"):
  """(transformers model in float32, eager attention; its checkpoint directory)."""
  import atexit  # pylint: disable=import-outside-toplevel
  import shutil  # pylint: disable=import-outside-toplevel
  import tempfile  # pylint: disable=import-outside-toplevel
  config_cls, lm_cls, value_cls, kwargs = FAMILIES[name]
  config = getattr(tf, config_cls)(**kwargs, **({"num_labels": 1} if head == "value" else {}))
  config._attn_implementation = "eager"  # pylint: disable=protected-access
  torch.manual_seed(0)
  model = getattr(tf, value_cls if head == "value" else lm_cls)(config)
  model = _perturb(model, seed=sum(map(ord, name + head)))
  directory = pathlib.Path(tempfile.mkdtemp(prefix=f"ppojax-{name}-{head}-"))
  atexit.register(shutil.rmtree, directory, ignore_errors=True)  # per worker, at its exit
  model.save_pretrained(str(directory))
  return model, directory


def _load(name, head="lm", **overrides):
  _, directory = _hf_model(name, head)
  cfg = hf.load_config(directory, **overrides)
  return cfg, hf.params_from_hf(cfg, hf.read_safetensors(directory), head=head)


def _batch(left_pad=(0, 2, 5), length=9, seed=0, prefix=0):
  """Left-padded rows [B, length] of tokens 1 … 95 (the first ``prefix`` real tokens the same in
  every row), their mask and positions."""
  rng = np.random.RandomState(seed)
  tokens = rng.randint(1, STOP, (len(left_pad), length))
  mask = np.arange(length)[None] >= np.asarray(left_pad)[:, None]
  for row, start in enumerate(left_pad):
    tokens[row, start:start + prefix] = tokens[0, :prefix]
  tokens = np.where(mask, tokens, PAD).astype(np.int32)
  return tokens, mask, np.asarray(C.positions_from_mask(jnp.asarray(mask)))


def _torch_out(model, tokens, mask, positions):
  with torch.no_grad():
    out = model(input_ids=torch.from_numpy(tokens).long(),
                attention_mask=torch.from_numpy(mask).long(),
                position_ids=torch.from_numpy(np.array(positions)).long())
  return out.logits.float().numpy()


def _torch_greedy(model, tokens, mask):
  """transformers' greedy ``generate`` of NEW tokens, padded with PAD after a stop."""
  threads = torch.get_num_threads()
  torch.set_num_threads(1)  # see test_sampling: spinning workers on a 2-core machine
  try:
    with torch.no_grad():
      out = model.generate(input_ids=torch.from_numpy(tokens).long(),
                           attention_mask=torch.from_numpy(mask).long(), max_new_tokens=NEW,
                           min_new_tokens=0, do_sample=False, pad_token_id=PAD,
                           eos_token_id=STOP)
  finally:
    torch.set_num_threads(threads)
  new = out[:, tokens.shape[1]:].numpy()
  return np.pad(new, ((0, 0), (0, NEW - new.shape[1])), constant_values=PAD)


def test_rows_name_every_tensor_of_their_layers():
  """Each Llama-like row's name map holds exactly the norms its sublayer placement and q/k
  norm imply, and the seven projections."""
  for model_type, row in families.FAMILIES.items():
    if row.norm == "layer":
      continue
    expected = {"attn/q", "attn/k", "attn/v", "attn/o", "mlp/gate", "mlp/up", "mlp/down"}
    expected |= set(families.NORM_PLACES[row.sublayer_norms])
    expected |= {"attn/q_norm", "attn/k_norm"} if row.qk_norm else set()
    assert set(row.names) == expected, model_type


@pytest.mark.parametrize("name", NAMES)
def test_config_reads_the_layer_description(name):
  cfg, _ = _load(name)
  kwargs = FAMILIES[name][3]
  types = kwargs.get("layer_types")
  if types:
    assert cfg.windows == tuple(WINDOW if t == _SLIDE else 0 for t in types)
  assert cfg.to_hf()["model_type"] == json.loads(
      (_hf_model(name)[1] / "config.json").read_text())["model_type"]
  expect = {"gemma3": dict(local_rope_theta=100.0, norm_offset=1.0, qk_norm="head",
                           sublayer_norms="both", mlp="geglu", query_pre_attn_scalar=16.0),
            "gemma2": dict(attn_softcap=5.0, final_softcap=3.0, local_rope_theta=None),
            "olmo2": dict(sublayer_norms="post", qk_norm="proj"),
            "olmo3": dict(sublayer_norms="post", qk_norm="proj", local_rope_theta=None),
            "qwen3": dict(qk_norm="head", sublayer_norms="pre"),
            "smollm3": dict(nope_layers=(3,))}[name]
  for field, value in expect.items():
    assert getattr(cfg, field) == value, field
  if name == "gemma3":
    assert cfg.layer_ropes == (1, 1, 0) and cfg.embed_scale == pytest.approx(8.0)
    assert dict(cfg.rope_scaling) == {"rope_type": "linear", "factor": 2.0}
  if name == "smollm3":
    assert cfg.layer_ropes == (0, 0, 0, -1)


@pytest.mark.parametrize("scan", [True, False])
@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(name, scan):
  model, _ = _hf_model(name)
  cfg, params = _load(name, scan_layers=scan)
  if not scan:
    params = layout.unstack_layers(params)
  tokens, mask, positions = _batch(length=12)
  ours = np.asarray(jax.jit(lambda p: T.CausalLM(cfg).apply(
      {"params": p}, tokens, positions, mask)[0])(params))
  theirs = _torch_out(model, tokens, mask, positions)
  assert np.abs(theirs[mask]).max() > 0.5  # logits of a size where errors show
  np.testing.assert_allclose(ours[mask], theirs[mask], atol=TOL, rtol=0)


@functools.lru_cache(maxsize=None)
def _reference_decode(name):
  tokens, mask, _ = _batch(length=10, seed=3, prefix=4)
  return tokens, mask, _torch_greedy(_hf_model(name)[0], tokens, mask)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_decode_matches_transformers(name):
  """32 greedy tokens equal transformers' for scanned and unrolled decode layers, from the
  full prompts and from a shared prefix held once for the batch (``split_shared_prefix``);
  the sliding window (4) is passed long before the 10 + 32 tokens end."""
  tokens, mask, want = _reference_decode(name)
  cfg, params = _load(name)
  module = T.CausalLM(cfg)
  config = SamplingConfig(NEW, stop_ids=(STOP,), pad_id=PAD, greedy=True)
  prefix, rest, rest_mask = sampling.split_shared_prefix(tokens, mask)
  assert prefix.size == 4
  for layers in ("scan", "unroll"):
    run = dataclasses.replace(config, layers=layers)
    out = generate(module, params, jnp.asarray(tokens), jnp.asarray(mask), jax.random.key(0),
                   run)
    np.testing.assert_array_equal(np.asarray(out.tokens), want, err_msg=layers)
    shared = generate(module, params, jnp.asarray(rest), jnp.asarray(rest_mask),
                      jax.random.key(0), run, prefix=jnp.asarray(prefix))
    np.testing.assert_array_equal(np.asarray(shared.tokens), want, err_msg=f"{layers}+prefix")
    np.testing.assert_allclose(np.asarray(shared.logprobs), np.asarray(out.logprobs), atol=1e-4)
  assert (want != PAD).sum(axis=1).max() > WINDOW


@pytest.mark.parametrize("name", NAMES)
def test_export_loads_in_transformers_and_decodes_the_same(name, tmp_path):
  model, _ = _hf_model(name)
  cfg, params = _load(name)
  hf.save_pretrained(tmp_path / "out", cfg, params)
  loaded = tf.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32,
                                                   attn_implementation="eager").eval()
  assert type(loaded).__name__ == FAMILIES[name][1]
  tokens, mask, want = _reference_decode(name)
  positions = np.asarray(C.positions_from_mask(jnp.asarray(mask)))
  np.testing.assert_array_equal(_torch_out(loaded, tokens, mask, positions),
                                _torch_out(model, tokens, mask, positions))
  np.testing.assert_array_equal(_torch_greedy(loaded, tokens, mask), want)
  # and the state dict goes round exactly
  again = hf.params_from_hf(cfg, hf.params_to_hf(cfg, params))
  for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", NAMES)
def test_value_head_matches_sequence_classification(name):
  model, _ = _hf_model(name, "value")
  cfg, params = _load(name, "value")
  tokens, mask, positions = _batch()  # left-padded: transformers pools the last slot
  values = np.asarray(T.ValueModel(cfg).apply({"params": params}, tokens, positions, mask)[0])
  per_position = _torch_out(model, tokens, mask, positions)  # pooled [B, 1]
  np.testing.assert_allclose(values[:, -1], per_position[:, 0], atol=TOL, rtol=0)
  assert np.abs(per_position).max() > 0.1


@pytest.mark.parametrize("name", NAMES)
def test_lora_peft_export_gives_the_adapted_logits(name, tmp_path):
  peft = pytest.importorskip("peft")
  base_cfg, base = _load(name)
  cfg = lora.adapted_config(base_cfg, rank=4, alpha=8, names=lora.ALL_LINEAR)
  adapters = lora.init_adapters(base, cfg, jax.random.PRNGKey(4))
  rng = np.random.RandomState(5)
  adapters = jax.tree.map(lambda x: x + 0.05 * rng.standard_normal(x.shape).astype(x.dtype),
                          adapters)  # B ≠ 0, as after training
  params = lora.combine(base, adapters)
  lora.save_peft(tmp_path / "adapters", adapters, cfg, base_model=str(_hf_model(name)[1]))
  net = peft.PeftModel.from_pretrained(hf.to_transformers(base_cfg, base),
                                       str(tmp_path / "adapters")).eval()
  tokens, mask, positions = _batch()
  theirs = _torch_out(net, tokens, mask, positions)
  ours = np.asarray(T.CausalLM(cfg).apply({"params": params}, tokens, positions, mask)[0])
  plain = np.asarray(T.CausalLM(base_cfg).apply({"params": base}, tokens, positions, mask)[0])
  assert np.abs(ours - plain)[mask].max() > 1e-3  # the adapters change the logits
  np.testing.assert_allclose(ours[mask], theirs[mask], atol=TOL, rtol=0)


def test_bfloat16_compute_stays_close():
  cfg, params = _load("gemma3", dtype="bfloat16")
  cfg32, _ = _load("gemma3")
  tokens, mask, positions = _batch()
  apply = lambda c: np.asarray(T.CausalLM(c).apply(  # noqa: E731
      {"params": params}, tokens, positions, mask)[0], np.float32)
  np.testing.assert_allclose(apply(cfg)[mask], apply(cfg32)[mask], atol=0.15)


@pytest.mark.parametrize("change,message", [
    ({"model_type": "qwen3_moe"}, r"'qwen3_moe' is not supported; ppojax supports .*qwen3"),
    ({"num_experts": 8}, r"field 'num_experts' marks a mixture-of-experts model.*gemma3_text"),
    ({"layer_types": ["linear_attention", "full_attention", "full_attention"]},
     r"layer_types holds 'linear_attention'.*supports the dense families"),
    ({"layer_types": ["full_attention"]}, r"layer_types has 1 entries for num_hidden_layers=3"),
    ({"model_type": "gemma3"}, r"multimodal.*text_config"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
     r"rope_type 'yarn' is not supported"),
])
def test_unsupported_checkpoints_stop_before_the_weights(change, message, tmp_path):
  """One error line naming the field and the supported families, from config.json alone: the
  directory holds no weights at all."""
  config = json.loads((_hf_model("qwen3")[1] / "config.json").read_text())
  config.update(change)
  (tmp_path / "config.json").write_text(json.dumps(config))
  with pytest.raises(hf.CheckpointError, match=message) as info:
    hf.load_config(tmp_path)
  assert "\n" not in str(info.value)
