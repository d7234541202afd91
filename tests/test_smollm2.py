"""The Flax model on the real SmolLM2-135M-Instruct weights: logits parity with transformers'
PyTorch Llama on a left-padded batch of chat prompts, cached decoding, and export."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import transformers  # noqa: E402

from ppojax.models import hf, init_cache, load_model, positions_from_mask, save_model  # noqa: E402

PROMPTS = ["What is 7 + 5?", "Name a colour.", "Write one short sentence about the sea, please."]


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
  return load_model(smollm2_path)


@pytest.fixture(scope="module")
def batch(smollm2):
  tok = smollm2.tokenizer
  texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                   add_generation_prompt=True) for p in PROMPTS]
  rows = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
  width = max(map(len, rows))
  tokens = np.full((len(rows), width), tok.pad_token_id, np.int32)
  mask = np.zeros((len(rows), width), bool)
  for i, row in enumerate(rows):  # left padding
    tokens[i, width - len(row):], mask[i, width - len(row):] = row, True
  assert mask.sum(1).min() < width  # the batch really is ragged
  return tokens, mask


def _ours(model, tokens, mask):
  logits, _ = model.module.apply({"params": model.params}, jnp.asarray(tokens),
                                 positions_from_mask(jnp.asarray(mask)), jnp.asarray(mask))
  return np.asarray(logits)


def test_logits_match_transformers(smollm2, batch):
  """Against transformers in float64 (the exact function) our float32 logits are within 2.5 times
  transformers' own float32 error, whose max is 9.3e-5 at logits up to 39 (~25 float32 ulps after
  30 layers) on the CPUs measured. Ours depends on XLA:CPU's code generation: at XLA's default
  optimisation 1.1e-4 (1.2x) on AVX-512 CPUs and 1.5e-4 (1.6x) on an AVX2-only one; at the
  suite's -O0 (conftest.py) 2.04e-4 (2.2x) on an AVX-512 AMD EPYC (family 25 model 17); the
  figure moves by ±3e-5 with the attention's summation order. Against transformers in float32
  the two roundings add up (measured 1.0e-4 to 1.6e-4)."""
  tokens, mask = batch
  model = hf.to_transformers(smollm2.cfg, smollm2.params)
  args = dict(input_ids=torch.from_numpy(tokens).long(),
              attention_mask=torch.from_numpy(mask).long(),
              position_ids=torch.from_numpy(np.array(positions_from_mask(jnp.asarray(mask)))))
  with torch.no_grad():
    ref32 = model(**args).logits.numpy()
    ref64 = model.double()(**args).logits.numpy()
  ours = _ours(smollm2, tokens, mask)
  err64, err32 = (np.abs(ours - ref)[mask].max() for ref in (ref64, ref32))
  torch_err = np.abs(ref32 - ref64)[mask].max()  # transformers' own float32 rounding
  print(f"max |ours - f64| {err64:.2e}, |ours - f32| {err32:.2e}, |torch f32 - f64| {torch_err:.2e}")
  assert err64 <= 2.5 * torch_err  # as exact as the reference implementation, within 2.5x
  assert err32 <= 2e-4


def test_cached_decoding_matches_full_forward(smollm2, batch):
  tokens, mask = batch
  extra = np.asarray(jax.random.randint(jax.random.key(0), (tokens.shape[0], 4), 0, 1000),
                     np.int32)
  full_tokens = np.concatenate([tokens, extra], 1)
  full_mask = np.concatenate([mask, np.ones_like(extra, bool)], 1)
  full = _ours(smollm2, full_tokens, full_mask)

  apply = jax.jit(smollm2.module.apply)
  positions = positions_from_mask(jnp.asarray(full_mask))
  p = tokens.shape[1]
  kv_mask = jnp.zeros(full_mask.shape, bool).at[:, :p].set(mask)
  cache = init_cache(smollm2.cfg, tokens.shape[0], full_mask.shape[1])
  logits, cache = apply({"params": smollm2.params}, jnp.asarray(tokens), positions[:, :p],
                        kv_mask, cache, 0)
  steps = [np.asarray(logits)]
  for t in range(p, full_mask.shape[1]):
    kv_mask = kv_mask.at[:, t].set(True)
    logits, cache = apply({"params": smollm2.params}, jnp.asarray(full_tokens[:, t:t + 1]),
                          positions[:, t:t + 1], kv_mask, cache, t)
    steps.append(np.asarray(logits))
  err = np.abs(np.concatenate(steps, 1) - full)[full_mask].max()
  assert err <= 1e-4, err


def test_export_loads_in_transformers(smollm2, batch, tmp_path):
  tokens, mask = batch
  out = save_model(tmp_path / "smollm2", smollm2)
  loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  tokenizer = transformers.AutoTokenizer.from_pretrained(out)
  assert tokenizer.pad_token_id == tokenizer.eos_token_id == smollm2.tokenizer.eos_token_id
  assert tokenizer.chat_template == smollm2.tokenizer.chat_template
  with torch.no_grad():
    ref = loaded(input_ids=torch.from_numpy(tokens).long(),
                 attention_mask=torch.from_numpy(mask).long(),
                 position_ids=torch.from_numpy(np.array(positions_from_mask(jnp.asarray(mask))))
                 ).logits.numpy()
  assert np.abs(_ours(smollm2, tokens, mask) - ref)[mask].max() <= 2e-4  # see the test above
  again = load_model(out)  # and back into ppojax
  jax.tree.map(np.testing.assert_array_equal, again.params, smollm2.params)
