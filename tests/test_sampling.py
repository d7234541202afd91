"""The generation engine (``ppojax.rollout.sampling``, its token draw ``ppojax.rollout.draw``).

* greedy decoding equals transformers' ``generate(do_sample=False)`` on SmolLM2-135M-Instruct;
* sampled first-token frequencies pass a chi-square goodness-of-fit test against the model's
  temperature-scaled distribution, and against the renormalised top-k / top-p / min-p one;
* truncation never emits an excluded token, at any step; keys behave (greedy ignores them);
* stop / pad / mask / length conventions (also with pad_id == a stop id), the early exit, and
  ``min_new_tokens``;
* ``logprobs`` and ``sampling_logprobs`` against a full, non-cached forward pass;
* the same tokens with params and batch sharded over a simulated 8-device mesh;
* ``SamplingConfig`` validation.

Reference distributions and truncation sets are recomputed here independently of the engine
(NumPy, float64), from one full forward pass over prompt + response.
"""

import dataclasses
import functools
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppojax.core import logprobs, ops
from ppojax.models import CausalLM, ModelConfig, positions_from_mask
from ppojax.models.layout import transpose_kernels
from ppojax.rollout import draw as draw_lib
from ppojax.rollout import sampling
from ppojax.rollout.sampling import SamplingConfig, generate

# ---------------------------------------------------------------------------------------------
# A tiny random Llama. Its lm head is scaled up so that next-token distributions are far from
# uniform (top probability ~0.3 over 32 tokens): that gives the chi-square tests their power.
# Every SamplingConfig below is built once, and shapes are shared, so each jit compiles once.
# ---------------------------------------------------------------------------------------------

VOCAB = 32
TINY = ModelConfig(model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                   max_position_embeddings=64, norm_eps=1e-5, tie_word_embeddings=False)
MODEL = CausalLM(TINY)

# Distribution tests: N_ROWS rows with the same left-padded prompt, so every row draws its first
# token from one distribution.
N_ROWS, DIST_NEW = 2048, 6
DIST_PROMPT = np.array([0, 5, 9, 3, 17, 11], np.int32)
DIST_PROMPT_MASK = np.array([0, 1, 1, 1, 1, 1], bool)
T_LOW = 0.7
DIST_CONFIGS = {
    "t1": SamplingConfig(DIST_NEW, stop_ids=(1,), pad_id=0),
    "t07": SamplingConfig(DIST_NEW, stop_ids=(1,), pad_id=0, temperature=T_LOW),
    "top_k": SamplingConfig(DIST_NEW, stop_ids=(1,), pad_id=0, temperature=0.8, top_k=6),
    "top_p": SamplingConfig(DIST_NEW, stop_ids=(1,), pad_id=0, temperature=0.8, top_p=0.7),
    "min_p": SamplingConfig(DIST_NEW, stop_ids=(1,), pad_id=0, temperature=0.8, min_p=0.15),
    "all": SamplingConfig(DIST_NEW, stop_ids=(1,), pad_id=0, temperature=1.3, top_k=10,
                          top_p=0.9, min_p=0.08),
}
TRUNCATED = ("top_k", "top_p", "min_p", "all")
P_THRESHOLD = 1e-3  # fixed seeds: the tests are deterministic
MARGIN = 1e-4  # a reference truncation decision this close to its boundary is "ambiguous"

# Stop tests: a ragged batch (prompt lengths 1..8) on a model that forces stop token 2 from
# position FORCE_FROM on, so every row stops, at different steps, before RAGGED_NEW.
RAGGED_ROWS, RAGGED_PROMPT, RAGGED_NEW = 16, 8, 10
FORCED_STOP, FORCE_FROM = 2, 8
STOP_CONFIGS = {
    "pad_not_stop": SamplingConfig(RAGGED_NEW, stop_ids=(1, 2), pad_id=0),
    "pad_is_stop": SamplingConfig(RAGGED_NEW, stop_ids=(1, 2), pad_id=2, temperature=T_LOW,
                                  top_p=0.9),
}
MIN_NEW = SamplingConfig(RAGGED_NEW, stop_ids=(1, 2), pad_id=2, min_new_tokens=4)
GREEDY = SamplingConfig(RAGGED_NEW, stop_ids=(1,), pad_id=0, greedy=True, temperature=T_LOW)

_CALLS = [0]


def _count_call():
  _CALLS[0] += 1


class ForcedStop(CausalLM):
  """CausalLM whose logits at positions ≥ ``force_from`` make FORCED_STOP certain (logit 50 vs 0);
  counts its applications (prefill + one per decode step) in ``_CALLS``."""

  force_from: int = FORCE_FROM

  def __call__(self, tokens, positions, kv_mask, cache=None, cache_index=0, last_only=False,
               rope=None):
    logits, cache = super().__call__(tokens, positions, kv_mask, cache, cache_index, last_only,
                                     rope)
    jax.debug.callback(_count_call)
    positions = positions[:, -1:] if last_only else positions
    forced = jnp.where(jnp.arange(VOCAB) == FORCED_STOP, 50.0, 0.0).astype(logits.dtype)
    return jnp.where((positions >= self.force_from)[..., None], forced, logits), cache


FORCED = ForcedStop(TINY)


# ---------------------------------------------------------------------------------------------
# References
# ---------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=0)
def full_logits(module, params, prompts, prompt_mask, response):
  """Next-token logits [B, R, V] for each response token, from one non-cached forward pass over
  prompt + response (every response slot marked real; causality hides what follows a stop)."""
  tokens = jnp.concatenate([prompts, response], axis=1)
  mask = jnp.concatenate([prompt_mask, jnp.ones(response.shape, bool)], axis=1)
  logits, _ = module.apply({"params": params}, tokens, positions_from_mask(mask), mask)
  return logits[:, prompts.shape[1] - 1:-1]


def log_softmax_np(z, keep=None):
  z = np.where(keep, z, -np.inf) if keep is not None else z
  m = np.max(z, axis=-1, keepdims=True)
  return z - m - np.log(np.sum(np.exp(z - m), axis=-1, keepdims=True))


def reference_keep(z, config):
  """Hugging Face's warper semantics on float64 temperature-scaled logits z [..., V]: top-k, then
  top-p (smallest most-likely set with mass ≥ top_p), then min-p (p ≥ min_p·p_max), each on the
  renormalised survivors of the previous one. Returns (keep [..., V], ambiguous [...]): a row
  is ambiguous when a decision lies within MARGIN of its boundary (float32 noise could flip it)."""
  keep = np.ones(z.shape, bool)
  ambiguous = np.zeros(z.shape[:-1], bool)
  if config.top_k:
    desc = -np.sort(-z, axis=-1)
    kth = desc[..., config.top_k - 1:config.top_k]
    keep &= z >= kth
    ambiguous |= desc[..., config.top_k - 1] - desc[..., config.top_k] < MARGIN
  if config.top_p < 1:
    p = np.exp(log_softmax_np(z, keep))
    order = np.argsort(-p, axis=-1)
    p_sorted = np.take_along_axis(p, order, axis=-1)
    before = np.cumsum(p_sorted, axis=-1) - p_sorted  # mass strictly more likely than each
    keep_sorted = before < config.top_p
    ambiguous |= np.any((p_sorted > 0) & (np.abs(before - config.top_p) < MARGIN), axis=-1)
    kept = np.zeros(z.shape, bool)
    np.put_along_axis(kept, order, keep_sorted, axis=-1)
    keep &= kept
  if config.min_p > 0:
    p = np.exp(log_softmax_np(z, keep))
    threshold = config.min_p * np.max(p, axis=-1, keepdims=True)
    ambiguous |= np.any(keep & (np.abs(p - threshold) < MARGIN * threshold), axis=-1)
    keep &= p >= threshold
  return keep, ambiguous


def chi_square_pvalue(counts, probs):
  """Pearson's goodness-of-fit p-value; categories with expected count < 5 are pooled.
  P(χ²_df ≥ x) = Q(df/2, x/2), the regularised upper incomplete gamma function."""
  counts, probs = np.asarray(counts, np.float64), np.asarray(probs, np.float64)
  expected = counts.sum() * probs / probs.sum()
  small = expected < 5
  obs = list(counts[~small]) + ([counts[small].sum()] if small.any() else [])
  exp = list(expected[~small]) + ([expected[small].sum()] if small.any() else [])
  obs, exp = np.array(obs), np.array(exp)
  if exp[-1] < 5 and len(exp) > 2:  # a pooled bin still too small: merge it into the smallest
    i = int(np.argmin(exp[:-1]))
    obs[i] += obs[-1]
    exp[i] += exp[-1]
    obs, exp = obs[:-1], exp[:-1]
  stat = float(np.sum((obs - exp) ** 2 / exp))
  df = len(exp) - 1
  assert df >= 1, (obs, exp)
  return float(jax.scipy.special.gammaincc(df / 2, stat / 2)), stat, df


def check_conventions(out, config, vocab=VOCAB):
  """Stop / pad / mask / lengths / zero log-probs off the mask, recomputed in NumPy."""
  tokens, mask = np.asarray(out.tokens), np.asarray(out.mask)
  rows, length = tokens.shape
  assert tokens.dtype == np.int32 and length == config.max_new_tokens
  assert np.all((tokens >= 0) & (tokens < vocab))
  is_stop = np.isin(tokens, config.stop_ids)
  stopped = is_stop.any(axis=1)
  first = np.where(stopped, np.argmax(is_stop, axis=1), length)
  want_len = np.minimum(first + 1, length)
  np.testing.assert_array_equal(np.asarray(out.lengths), want_len)
  np.testing.assert_array_equal(mask, np.arange(length)[None] < want_len[:, None])
  np.testing.assert_array_equal(mask, np.asarray(ops.response_mask(out.tokens, config.stop_ids)))
  after = np.arange(length)[None] > first[:, None]
  assert np.all(tokens[after] == config.pad_id)  # padding after the first stop, whatever its id
  for lp in (out.logprobs, out.sampling_logprobs):
    lp = np.asarray(lp)
    assert lp.dtype == np.float32
    assert np.all(lp[~mask] == 0.0)
    assert np.all(np.isfinite(lp)) and np.all(lp[mask] <= 1e-6)
  return first, stopped


# ---------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_params():
  tokens = jnp.zeros((1, 4), jnp.int32)
  mask = jnp.ones((1, 4), bool)
  params = dict(MODEL.init(jax.random.key(0), tokens, positions_from_mask(mask), mask)["params"])
  params["lm_head"] = {"kernel": params["lm_head"]["kernel"] * 12.0}
  return params


@pytest.fixture(scope="module")
def dist_batch():
  return (jnp.asarray(np.tile(DIST_PROMPT, (N_ROWS, 1))),
          jnp.asarray(np.tile(DIST_PROMPT_MASK, (N_ROWS, 1))))


@pytest.fixture(scope="module")
def dist_outputs(tiny_params, dist_batch):
  """One generation (key 0) per DIST_CONFIGS entry, plus its full-forward next-token logits."""
  prompts, mask = dist_batch
  result = {}
  for name, config in DIST_CONFIGS.items():
    out = jax.device_get(generate(MODEL, tiny_params, prompts, mask, jax.random.key(0), config))
    logits = full_logits(MODEL, tiny_params, prompts, mask, jnp.asarray(out.tokens))
    result[name] = (out, np.asarray(logits, np.float64))
  return result


@pytest.fixture(scope="module")
def first_token_logits(tiny_params):
  prompt, mask = jnp.asarray(DIST_PROMPT[None]), jnp.asarray(DIST_PROMPT_MASK[None])
  logits, _ = MODEL.apply({"params": tiny_params}, prompt, positions_from_mask(mask), mask)
  return np.asarray(logits[0, -1], np.float64)


@pytest.fixture(scope="module")
def ragged_batch():
  lengths = 1 + np.arange(RAGGED_ROWS) % RAGGED_PROMPT
  mask = np.arange(RAGGED_PROMPT)[None] >= (RAGGED_PROMPT - lengths)[:, None]
  tokens = np.random.default_rng(0).integers(3, VOCAB, (RAGGED_ROWS, RAGGED_PROMPT))
  tokens = np.where(mask, tokens, 0).astype(np.int32)
  return jnp.asarray(tokens), jnp.asarray(mask), lengths


# ---------------------------------------------------------------------------------------------
# 1. Greedy parity with transformers on the real SmolLM2-135M-Instruct
# ---------------------------------------------------------------------------------------------

# Prompts the model answers at length, whose greedy paths have no near-ties: the top-2 logit gap
# along them is >= 0.03 in transformers (our logits differ from its by ~1e-4).
LONG_PROMPTS = [
    "Write a detailed recipe for chocolate chip cookies.",
    "Explain how a computer works to a child.",
    "List ten tips for staying healthy and explain each one.",
]
SMOL_NEW = 24


def test_greedy_matches_transformers_generate_on_smollm2(smollm2_path):
  torch = pytest.importorskip("torch")

  from ppojax.models import hf, load_model  # pylint: disable=import-outside-toplevel

  model = load_model(smollm2_path)
  tok = model.tokenizer
  eos = tok.eos_token_id
  assert tok.pad_token_id == eos  # SmolLM2's pad id == eos id: the case the conventions guard
  texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                   add_generation_prompt=True) for p in LONG_PROMPTS]
  rows = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
  width = max(map(len, rows))
  tokens = np.full((len(rows), width), eos, np.int32)
  mask = np.zeros((len(rows), width), bool)
  for i, row in enumerate(rows):  # left padding, pad id == eos id as SmolLM2 has it
    tokens[i, width - len(row):], mask[i, width - len(row):] = row, True
  assert len(set(map(len, rows))) > 1  # really ragged: left padding matters

  config = SamplingConfig(SMOL_NEW, stop_ids=(eos,), pad_id=eos, greedy=True)
  out = jax.device_get(generate(model.module, model.params, jnp.asarray(tokens),
                                jnp.asarray(mask), jax.random.key(0), config))
  check_conventions(out, config, model.cfg.vocab_size)
  # The prompts make the model answer at length: no row stops within the SMOL_NEW tokens.
  assert np.all(np.asarray(out.lengths) == SMOL_NEW), out.lengths

  # One intra-op thread: with two on this 2-core machine, torch's spinning worker threads make
  # generate 20x slower (4 s -> 70-100 s measured) as soon as any other process wants a core.
  threads = torch.get_num_threads()
  torch.set_num_threads(1)
  try:
    torch_model = hf.to_transformers(model.cfg, model.params)
    with torch.no_grad():
      ref = torch_model.generate(
          input_ids=torch.from_numpy(tokens).long(), attention_mask=torch.from_numpy(mask).long(),
          max_new_tokens=SMOL_NEW, do_sample=False, pad_token_id=eos, eos_token_id=eos,
          return_dict_in_generate=True, output_logits=True)
  finally:
    torch.set_num_threads(threads)
  ref_tokens = ref.sequences[:, width:].numpy()
  ref_tokens = np.pad(ref_tokens, ((0, 0), (0, SMOL_NEW - ref_tokens.shape[1])),
                      constant_values=eos)  # transformers stops early when every row is done
  np.testing.assert_array_equal(np.asarray(out.tokens), ref_tokens)
  # The chat template's system header, shared by every row, prefilled once for the batch; and
  # the decode's 30 layers as one scanned body (the default above, on a CPU, unrolls them).
  prefix, rest, rest_mask = sampling.split_shared_prefix(tokens, mask)
  assert prefix.size >= 20, prefix.size
  assert sampling.decode_layers(config.layers, model.params) == "unroll"
  shared = jax.device_get(generate(model.module, model.params, jnp.asarray(rest),
                                   jnp.asarray(rest_mask), jax.random.key(0),
                                   dataclasses.replace(config, layers="scan"),
                                   prefix=jnp.asarray(prefix)))
  np.testing.assert_array_equal(np.asarray(shared.tokens), ref_tokens)
  np.testing.assert_allclose(shared.logprobs, out.logprobs, atol=1e-4)

  # log π(token) at temperature 1 against transformers' per-step logits (which differ from ours
  # by ~1e-4 after 30 layers, see test_smollm2.py).
  ref_logits = torch.stack(ref.logits, dim=1).float()  # [B, steps, V]
  ref_logp = torch.log_softmax(ref_logits, -1).gather(
      -1, torch.from_numpy(ref_tokens[:, :ref_logits.shape[1], None]).long())[..., 0].numpy()
  steps = ref_logp.shape[1]
  m = np.asarray(out.mask)[:, :steps]
  np.testing.assert_allclose(np.asarray(out.logprobs)[:, :steps][m], ref_logp[m], atol=2e-3)
  np.testing.assert_array_equal(out.sampling_logprobs, out.logprobs)


# ---------------------------------------------------------------------------------------------
# 2. Sampled frequencies match the model's distribution (chi-square goodness of fit)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["t1", "t07"])
def test_first_token_frequencies_match_softmax(dist_outputs, first_token_logits, name):
  config = DIST_CONFIGS[name]
  out, _ = dist_outputs[name]
  probs = np.exp(log_softmax_np(first_token_logits / config.temperature))
  counts = np.bincount(np.asarray(out.tokens)[:, 0], minlength=VOCAB)
  pvalue, stat, df = chi_square_pvalue(counts, probs)
  assert pvalue > P_THRESHOLD, (name, stat, df, pvalue)


@pytest.mark.parametrize("name", ["t07", "all"])
def test_second_token_frequencies_match_conditional(dist_outputs, name):
  """Later steps draw fresh randomness: among the rows whose first token is the most common one
  (identical prefixes), the second token follows the model's conditional distribution."""
  config = DIST_CONFIGS[name]
  out, logits = dist_outputs[name]
  tokens = np.asarray(out.tokens)
  first = np.bincount(tokens[:, 0], minlength=VOCAB).argmax()
  rows = tokens[:, 0] == first
  assert rows.sum() > 400 and first not in config.stop_ids
  z = logits[np.argmax(rows), 1] / config.temperature
  keep, ambiguous = reference_keep(z, config)
  assert not ambiguous
  counts = np.bincount(tokens[rows, 1], minlength=VOCAB)
  assert counts[~keep].sum() == 0
  pvalue, stat, df = chi_square_pvalue(counts[keep], np.exp(log_softmax_np(z, keep))[keep])
  assert pvalue > P_THRESHOLD, (name, stat, df, pvalue)


def test_chi_square_detects_a_wrong_temperature(dist_outputs, first_token_logits):
  """The test above has power: samples at T=0.7 fail against the T=1 distribution and back."""
  for sampled, assumed in (("t07", 1.0), ("t1", T_LOW)):
    probs = np.exp(log_softmax_np(first_token_logits / assumed))
    counts = np.bincount(np.asarray(dist_outputs[sampled][0].tokens)[:, 0], minlength=VOCAB)
    assert chi_square_pvalue(counts, probs)[0] < 1e-6, sampled


@pytest.mark.parametrize("name", TRUNCATED)
def test_truncated_first_token_frequencies_match_renormalised(dist_outputs, first_token_logits,
                                                              name):
  config = DIST_CONFIGS[name]
  out, _ = dist_outputs[name]
  z = first_token_logits / config.temperature
  keep, ambiguous = reference_keep(z, config)
  assert not ambiguous
  assert 2 <= keep.sum() < VOCAB - 4, keep.sum()  # the truncation really truncates
  counts = np.bincount(np.asarray(out.tokens)[:, 0], minlength=VOCAB)
  assert counts[~keep].sum() == 0, np.nonzero(counts * ~keep)
  probs = np.exp(log_softmax_np(z, keep))
  pvalue, stat, df = chi_square_pvalue(counts[keep], probs[keep])
  assert pvalue > P_THRESHOLD, (name, stat, df, pvalue)
  # ... and the untruncated distribution is rejected.
  assert chi_square_pvalue(counts, np.exp(log_softmax_np(z)))[0] < 1e-6


# ---------------------------------------------------------------------------------------------
# 3. Truncation never emits excluded tokens; keys
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", TRUNCATED)
def test_truncation_never_emits_excluded_tokens(dist_outputs, name):
  config = DIST_CONFIGS[name]
  out, logits = dist_outputs[name]
  check_conventions(out, config)
  keep, ambiguous = reference_keep(logits / config.temperature, config)
  tokens, mask = np.asarray(out.tokens), np.asarray(out.mask)
  emitted_kept = np.take_along_axis(keep, tokens[..., None], axis=-1)[..., 0]
  checked = mask & ~ambiguous
  assert checked.sum() > 0.99 * mask.sum() and mask[:, 1:].sum() > 5000
  assert np.all(emitted_kept[checked]), np.argwhere(checked & ~emitted_kept)[:5]
  assert np.mean(keep.sum(-1)[mask]) < VOCAB / 2  # a real truncation at most steps


def test_same_key_same_sample_different_key_different_sample(tiny_params, dist_batch,
                                                             dist_outputs):
  prompts, mask = dist_batch
  config = DIST_CONFIGS["top_p"]
  first, _ = dist_outputs["top_p"]
  again = generate(MODEL, tiny_params, prompts, mask, jax.random.key(0), config)
  other = generate(MODEL, tiny_params, prompts, mask, jax.random.key(1), config)
  np.testing.assert_array_equal(again.tokens, first.tokens)
  np.testing.assert_array_equal(again.logprobs, first.logprobs)
  assert np.mean(np.asarray(other.tokens)[:, 0] != first.tokens[:, 0]) > 0.2
  # Rows of one batch are independent draws, not copies of one another.
  assert len({tuple(r) for r in np.asarray(first.tokens)}) > N_ROWS // 4


def test_greedy_ignores_key_and_takes_the_argmax(tiny_params, ragged_batch):
  prompts, mask, _ = ragged_batch
  out = jax.device_get(generate(MODEL, tiny_params, prompts, mask, jax.random.key(0), GREEDY))
  other = generate(MODEL, tiny_params, prompts, mask, jax.random.key(123), GREEDY)
  np.testing.assert_array_equal(other.tokens, out.tokens)
  check_conventions(out, GREEDY)
  logits = np.asarray(full_logits(MODEL, tiny_params, prompts, mask, jnp.asarray(out.tokens)))
  m = np.asarray(out.mask)
  picked = np.take_along_axis(logits, np.asarray(out.tokens)[..., None], axis=-1)[..., 0]
  assert np.all(picked[m] >= logits.max(-1)[m] - 1e-5)  # the argmax (up to float noise)
  assert np.all(np.asarray(out.lengths) > 1)  # several decode steps really were compared
  # log-probs still at the configured temperature
  want = logprobs.selective_log_softmax(jnp.asarray(logits), out.tokens, GREEDY.temperature)
  np.testing.assert_allclose(np.asarray(out.logprobs)[m], np.asarray(want)[m], atol=1e-5)
  np.testing.assert_array_equal(out.sampling_logprobs, out.logprobs)


# ---------------------------------------------------------------------------------------------
# 4. Stop tokens, padding, masks, lengths; early exit
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stop_outputs(tiny_params, ragged_batch):
  prompts, mask, _ = ragged_batch
  result = {}
  for name, config in STOP_CONFIGS.items():
    jax.effects_barrier()
    _CALLS[0] = 0
    out = jax.device_get(generate(FORCED, tiny_params, prompts, mask, jax.random.key(3), config))
    jax.effects_barrier()
    result[name] = (out, _CALLS[0])
  return result


@pytest.mark.parametrize("name", list(STOP_CONFIGS))
def test_stop_padding_mask_lengths_and_early_exit(stop_outputs, ragged_batch, name):
  config = STOP_CONFIGS[name]
  out, calls = stop_outputs[name]
  _, _, prompt_lengths = ragged_batch
  first, stopped = check_conventions(out, config)
  assert np.all(stopped)
  # Token j comes from the logits at position L − 1 + j: a forced stop from j = FORCE_FROM + 1 − L.
  lengths = np.asarray(out.lengths)
  assert np.all(lengths <= FORCE_FROM + 2 - prompt_lengths), (lengths, prompt_lengths)
  assert len(set(lengths.tolist())) >= 4 and lengths.max() < RAGGED_NEW  # ragged, early
  tokens = np.asarray(out.tokens)
  assert np.all(np.isin(tokens[np.arange(RAGGED_ROWS), first], config.stop_ids))
  if config.pad_id in config.stop_ids:  # the stop stays in the response, identical pads do not
    assert np.any(lengths < RAGGED_NEW - 1) and np.all(tokens[:, -1] == config.pad_id)
  # The loop exits as soon as every row has stopped: one prefill (which gives token 0), then
  # one decode step per further token of the longest response, instead of RAGGED_NEW steps; the
  # last token sampled is never fed back.
  assert calls == lengths.max(), (calls, lengths.max())


def test_min_new_tokens_bans_stops_and_changes_only_sampling_logprobs(tiny_params, ragged_batch):
  config = MIN_NEW
  prompts, mask, prompt_lengths = ragged_batch
  out = jax.device_get(generate(FORCED, tiny_params, prompts, mask, jax.random.key(5), config))
  first, stopped = check_conventions(out, config)
  forced_at = FORCE_FROM + 1 - prompt_lengths  # first step whose logits force the stop
  assert np.all(stopped) and np.all(first >= config.min_new_tokens)
  assert np.all(first <= np.maximum(forced_at, config.min_new_tokens))
  assert np.any(forced_at < config.min_new_tokens)  # some forced stops really were banned
  logits = np.asarray(full_logits(FORCED, tiny_params, prompts, mask, jnp.asarray(out.tokens)),
                      np.float64)
  m = np.asarray(out.mask)
  want = logprobs.selective_log_softmax(jnp.asarray(logits, jnp.float32), out.tokens)
  np.testing.assert_allclose(np.asarray(out.logprobs)[m], np.asarray(want)[m], atol=1e-5)
  keep = np.ones(logits.shape, bool)
  keep[:, :config.min_new_tokens, list(config.stop_ids)] = False
  ref = np.take_along_axis(log_softmax_np(logits, keep), np.asarray(out.tokens)[..., None],
                           axis=-1)[..., 0]
  np.testing.assert_allclose(np.asarray(out.sampling_logprobs)[m], ref[m], atol=1e-5)
  assert np.min(np.asarray(out.logprobs)[m]) < -40  # a banned forced stop: the two differ


# ---------------------------------------------------------------------------------------------
# 5. logprobs / sampling_logprobs against a full forward pass
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(DIST_CONFIGS))
def test_logprobs_match_full_forward(dist_outputs, name):
  config = DIST_CONFIGS[name]
  out, logits = dist_outputs[name]
  check_conventions(out, config)
  m = np.asarray(out.mask)
  want = logprobs.selective_log_softmax(jnp.asarray(logits, jnp.float32), out.tokens,
                                   config.temperature)
  np.testing.assert_allclose(np.asarray(out.logprobs)[m], np.asarray(want)[m], atol=1e-5)
  if not config.truncates:
    np.testing.assert_array_equal(out.sampling_logprobs, out.logprobs)
    return
  keep, ambiguous = reference_keep(logits / config.temperature, config)
  ref = np.take_along_axis(log_softmax_np(logits / config.temperature, keep),
                           np.asarray(out.tokens)[..., None], axis=-1)[..., 0]
  checked = m & ~ambiguous
  assert checked.sum() > 0.99 * m.sum()
  np.testing.assert_allclose(np.asarray(out.sampling_logprobs)[checked], ref[checked], atol=1e-5)
  assert np.all(np.asarray(out.sampling_logprobs)[m] >= np.asarray(out.logprobs)[m] - 1e-6)


@pytest.mark.parametrize("name", list(STOP_CONFIGS))
def test_logprobs_match_full_forward_ragged(tiny_params, ragged_batch, stop_outputs, name):
  """Ragged left padding, rows stopping at different steps, pad_id == a stop id."""
  config = STOP_CONFIGS[name]
  out, _ = stop_outputs[name]
  prompts, mask, _ = ragged_batch
  logits = np.asarray(full_logits(FORCED, tiny_params, prompts, mask, jnp.asarray(out.tokens)),
                      np.float64)
  m = np.asarray(out.mask)
  want = logprobs.selective_log_softmax(jnp.asarray(logits, jnp.float32), out.tokens,
                                   config.temperature)
  np.testing.assert_allclose(np.asarray(out.logprobs)[m], np.asarray(want)[m], atol=1e-5)
  keep, ambiguous = reference_keep(logits / config.temperature, config)
  ref = np.take_along_axis(log_softmax_np(logits / config.temperature, keep),
                           np.asarray(out.tokens)[..., None], axis=-1)[..., 0]
  assert not np.any(ambiguous[m])
  np.testing.assert_allclose(np.asarray(out.sampling_logprobs)[m], ref[m], atol=1e-5)


# ---------------------------------------------------------------------------------------------
# 6. Sharded params and batch on a simulated 8-device mesh
# ---------------------------------------------------------------------------------------------

SHARDED_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from ppojax.infra import sharding
    from ppojax.models import CausalLM, ModelConfig, partition_rules, positions_from_mask
    from ppojax.rollout.sampling import SamplingConfig, generate

    assert jax.device_count() == 8, jax.devices()
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                      max_position_embeddings=64, norm_eps=1e-5, tie_word_embeddings=False)
    module = CausalLM(cfg)
    rows, width = 16, 8
    prompts = jax.random.randint(jax.random.key(0), (rows, width), 3, 64)
    mask = jnp.arange(width)[None] >= (jnp.arange(rows) % 5)[:, None]  # ragged left padding
    prompts = jnp.where(mask, prompts, 2)
    params = module.init(jax.random.key(1), prompts, positions_from_mask(mask), mask)["params"]
    params = dict(params, lm_head={"kernel": params["lm_head"]["kernel"] * 12.0})
    key = jax.random.key(42)
    config = SamplingConfig(12, stop_ids=tuple(range(1, 9)), pad_id=2, temperature=0.9, top_k=20,
                            top_p=0.95, min_p=0.02)
    ref = jax.device_get(generate(module, params, prompts, mask, key, config))
    assert len(set(ref.lengths.tolist())) > 2, ref.lengths  # rows stop at different steps
    for shape in ((8, 1, 1), (2, 2, 2)):
      mesh = sharding.make_mesh(shape)
      placed = jax.device_put(params, sharding.param_shardings(params, mesh, partition_rules()))
      assert len(placed["lm_head"]["kernel"].sharding.device_set) == 8
      batch = jax.device_put((prompts, mask), sharding.batch_sharding(mesh))
      out = generate(module, placed, *batch, key, config)
      assert len(out.tokens.sharding.device_set) == 8
      out = jax.device_get(out)
      np.testing.assert_array_equal(out.tokens, ref.tokens, err_msg=str(shape))
      np.testing.assert_array_equal(out.lengths, ref.lengths, err_msg=str(shape))
      for a, b in ((out.logprobs, ref.logprobs), (out.sampling_logprobs, ref.sampling_logprobs)):
        np.testing.assert_allclose(a, b, atol=1e-5, err_msg=str(shape))
    # a prefix shared by every row: the same tokens as with it prepended to each prompt
    prefix = jnp.asarray([5, 9, 13], jnp.int32)
    lengths = mask.sum(1)
    full = jnp.full((rows, width + 3), 2, jnp.int32)
    for i in range(rows):
      row = jnp.concatenate([prefix, prompts[i, width - int(lengths[i]):]])
      full = full.at[i, width + 3 - row.size:].set(row)
    full_mask = jnp.arange(width + 3)[None] >= (width - lengths)[:, None]
    want = jax.device_get(generate(module, params, full, full_mask, key, config))
    mesh = sharding.make_mesh((2, 2, 2))
    placed = jax.device_put(params, sharding.param_shardings(params, mesh, partition_rules()))
    batch = jax.device_put((prompts, mask), sharding.batch_sharding(mesh))
    out = jax.device_get(generate(module, placed, *batch, key, config, prefix=prefix))
    np.testing.assert_array_equal(out.tokens, want.tokens)
    np.testing.assert_allclose(out.logprobs, want.logprobs, atol=1e-5)
    print("OK", ref.lengths.tolist())
""")


def test_sharded_generation_matches_single_device(run_on_8_cpu_devices):
  run_on_8_cpu_devices(SHARDED_SCRIPT)


# ---------------------------------------------------------------------------------------------
# 7. SamplingConfig validation
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    (dict(stop_ids=()), "stop_ids"),
    (dict(temperature=0.0), "temperature"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(min_p=1.0), "min_p"),
    (dict(min_p=-0.1), "min_p"),
    (dict(top_k=-1), "top_k"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(min_new_tokens=5), "min_new_tokens"),
    (dict(min_new_tokens=-1), "min_new_tokens"),
])
def test_config_validation(kwargs, match):
  base = dict(max_new_tokens=4, stop_ids=(1,), pad_id=0)
  with pytest.raises(ValueError, match=match):
    SamplingConfig(**{**base, **kwargs})


def test_config_is_a_hashable_static():
  a = SamplingConfig(4, stop_ids=(1, 2), pad_id=2, top_k=3)
  assert hash(a) == hash(SamplingConfig(4, stop_ids=(1, 2), pad_id=2, top_k=3))
  assert a.truncates and not SamplingConfig(4, stop_ids=(1,), pad_id=0, greedy=True).truncates


# ---------------------------------------------------------------------------------------------
# The draw itself: first_argmax and the two-level inverse CDF over a multi-block vocabulary
# ---------------------------------------------------------------------------------------------


def test_first_argmax_takes_the_first_of_tied_maxima():
  rng = np.random.default_rng(0)
  z = rng.integers(0, 4, (64, 300)).astype(np.float32)  # many ties
  z[5] = -np.inf
  z[6, 7] = np.inf
  got = draw_lib.first_argmax(jnp.asarray(z), jnp.max(jnp.asarray(z), -1, keepdims=True))
  np.testing.assert_array_equal(np.asarray(got), np.argmax(z, axis=-1))


def test_inverse_cdf_over_several_blocks_matches_the_probabilities():
  """V = 1000: four 250-token blocks (``draw.cdf_block``); frequencies of 40 000 draws from a
  peaked distribution with zero-probability tokens pass a chi-square test, and no zero-weight
  token is ever drawn."""
  rng = np.random.default_rng(1)
  weights = rng.gamma(0.3, size=1000).astype(np.float32)
  weights[rng.random(1000) < 0.3] = 0.0
  rows = 40_000
  draw = jax.jit(lambda k: draw_lib._inverse_cdf_sample(  # pylint: disable=protected-access
      k, jnp.broadcast_to(jnp.asarray(weights), (rows, 1000))))
  tokens = np.asarray(draw(jax.random.key(2)))
  assert np.all(weights[tokens] > 0)
  counts = np.bincount(tokens, minlength=1000)
  p_value, _, _ = chi_square_pvalue(counts[weights > 0], weights[weights > 0])
  assert p_value > 1e-3, p_value


def test_inverse_cdf_lands_on_positive_weights_at_both_ends():
  """u = 1 (the top of the CDF) and u = the smallest normal float, on 4096 rows of weights
  spanning twelve orders of magnitude whose blocks (of 250, ``draw.cdf_block``) start and end with
  zeros: every token is in range and of positive weight — the first positive one, and the last
  unless its weight is below float32 rounding of the total. (Without the clip to the block's positive weights, u = 1 sent 1592 rows past the vocabulary and
  u = tiny 72 rows to a zero weight.) Interior u agree with a float64 reference."""
  rng = np.random.default_rng(0)
  rows, vocab = 4096, 1000  # blocks of 250 (``draw.cdf_block``)
  weights = (rng.gamma(0.5, size=(rows, vocab)) * rng.lognormal(0, 3, (rows, 1))).astype(
      np.float32)
  weights[:, :3] = weights[:, 250:262] = weights[:, 990:] = 0.0
  positive = [np.flatnonzero(row) for row in weights]
  first, last = np.array([p[0] for p in positive]), np.array([p[-1] for p in positive])
  draw = jax.jit(draw_lib.inverse_cdf)
  edge = lambda u: np.asarray(draw(jnp.asarray(weights),  # noqa: E731
                                   jnp.full((rows, 1), u, jnp.float32)))
  np.testing.assert_array_equal(edge(np.finfo(np.float32).tiny), first)
  top = edge(1.0)
  assert np.all(top < vocab) and np.all(weights[np.arange(rows), np.minimum(top, vocab - 1)] > 0)
  resolved = weights[np.arange(rows), last] > 1e-5 * weights.sum(1)  # above float32 rounding
  np.testing.assert_array_equal(top[resolved], last[resolved])
  u = rng.uniform(0.01, 0.99, (rows, 1)).astype(np.float32)
  got = np.asarray(draw(jnp.asarray(weights), jnp.asarray(u)))
  cdf = np.cumsum(weights.astype(np.float64), axis=1)
  target = u.astype(np.float64) * cdf[:, -1:]
  want = np.sum(cdf < target, axis=1)  # the first i with CDF_i ≥ target
  lo = np.take_along_axis(cdf, np.maximum(want - 1, 0)[:, None], axis=1)
  clear = (target - lo)[:, 0] > 1e-5 * cdf[:, -1]  # not decided by float32 rounding
  assert np.all(weights[np.arange(rows), got] > 0) and np.mean(clear) > 0.9
  np.testing.assert_array_equal(got[clear], want[clear])


# ---------------------------------------------------------------------------------------------
# 8. A prompt prefix shared by every row (a chat template's header): prefilled once
# ---------------------------------------------------------------------------------------------

SHARED_PREFIX = np.array([7, 4, 19, 11], np.int32)


@pytest.fixture(scope="module")
def prefixed_batch(ragged_batch):
  """The ragged batch with SHARED_PREFIX before every row's own prompt, left-padded."""
  prompts, mask, _ = ragged_batch
  width = RAGGED_PROMPT + SHARED_PREFIX.size
  tokens = np.zeros((RAGGED_ROWS, width), np.int32)
  full_mask = np.zeros((RAGGED_ROWS, width), bool)
  for i, (row, keep) in enumerate(zip(np.asarray(prompts), np.asarray(mask))):
    full = np.concatenate([SHARED_PREFIX, row[keep]])
    tokens[i, width - full.size:], full_mask[i, width - full.size:] = full, True
  return tokens, full_mask


def test_split_shared_prefix_recovers_the_prefix_and_each_rows_rest(prefixed_batch):
  tokens, mask = prefixed_batch
  prefix, rest, rest_mask = sampling.split_shared_prefix(tokens, mask)
  np.testing.assert_array_equal(prefix, SHARED_PREFIX)
  assert rest.shape == rest_mask.shape == (RAGGED_ROWS, RAGGED_PROMPT)
  assert not (np.diff(rest_mask.astype(int), axis=1) < 0).any()  # still left-padded
  for i in range(RAGGED_ROWS):
    np.testing.assert_array_equal(np.concatenate([prefix, rest[i][rest_mask[i]]]),
                                  tokens[i][mask[i]])
  capped, rest2, mask2 = sampling.split_shared_prefix(tokens, mask, max_prefix=2)
  np.testing.assert_array_equal(capped, SHARED_PREFIX[:2])
  assert mask2.sum() == mask.sum() - 2 * RAGGED_ROWS and rest2.shape[1] == RAGGED_PROMPT + 2
  # identical rows: each keeps its last token, so the prefill still ends on it
  same = np.tile(np.array([[4, 5, 6]]), (3, 1))
  prefix, rest, rest_mask = sampling.split_shared_prefix(same, np.ones_like(same, bool))
  np.testing.assert_array_equal(prefix, [4, 5])
  np.testing.assert_array_equal(rest, [[6]] * 3)
  # nothing shared: an empty prefix, the prompts unchanged
  prefix, rest, rest_mask = sampling.split_shared_prefix([[1, 2], [3, 4]], [[1, 1], [1, 1]])
  assert prefix.size == 0 and rest.tolist() == [[1, 2], [3, 4]] and rest_mask.all()


@pytest.mark.parametrize("tokens, mask, match", [
    ([[1, 2], [3, 4]], [[1, 1], [0, 0]], "rows \\[1\\] have no prompt token"),
    ([[1, 2], [3, 4]], [[1, 1], [1, 0]], "left-padded"),
    ([1, 2], [1, 1], "both be \\[B, P\\]"),
])
def test_split_shared_prefix_rejects_bad_prompts(tokens, mask, match):
  with pytest.raises(ValueError, match=match):
    sampling.split_shared_prefix(tokens, mask)


@pytest.mark.parametrize("config", [GREEDY, STOP_CONFIGS["pad_is_stop"], MIN_NEW],
                         ids=["greedy", "sampled-top_p", "min_new_tokens"])
def test_shared_prefix_generation_equals_the_full_prompts(tiny_params, prefixed_batch, config):
  """The prefix prefilled once for the batch gives the tokens and log-probs of the prompts
  with the prefix prepended (the same key: the same uniforms, and log-probs equal to ~1e-6)."""
  tokens, mask = prefixed_batch
  key = jax.random.key(7)
  want = jax.device_get(generate(MODEL, tiny_params, jnp.asarray(tokens), jnp.asarray(mask),
                                 key, config))
  prefix, rest, rest_mask = sampling.split_shared_prefix(tokens, mask)
  got = jax.device_get(generate(MODEL, tiny_params, jnp.asarray(rest), jnp.asarray(rest_mask),
                                key, config, prefix=jnp.asarray(prefix)))
  check_conventions(got, config)
  assert np.asarray(got.mask).sum() > 3 * RAGGED_ROWS  # several tokens per row compared
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.lengths, want.lengths)
  for a, b in ((got.logprobs, want.logprobs), (got.sampling_logprobs, want.sampling_logprobs)):
    np.testing.assert_allclose(a, b, atol=1e-5)
  if config is GREEDY:  # a prefix given as a batch of rows is refused, not broadcast
    with pytest.raises(ValueError, match="one row of token ids"):
      generate(MODEL, tiny_params, jnp.asarray(rest), jnp.asarray(rest_mask), key, config,
               prefix=jnp.asarray(prefix)[None])


def test_shared_prefix_generation_runs_in_bfloat16(tiny_params, prefixed_batch):
  """In bfloat16 the prefix's products are bf16·bf16 → f32 dots too (XLA:CPU had no kernel for
  them with the batch axis inside an operand).

  1. Whole rows equal the bf16 generation of the full prompts: both round the same values to
     bf16 at the same points; the prefix only splits attention's float32 sums over the keys in
     two (prefix, then the row's own), which moves them by float32 ulps (1e-6 in the float32
     test above), so the tokens are the same and the log-probs agree to 1e-5.
  2. It ran in bf16: against the float32 generation the log-probs differ, within what bf16's
     8 significant bits allow: a logit z (a dot of a rounded hidden state and rounded weights)
     is off by ~2·2⁻⁹·|z|, and log p = z/T − lse(z/T) by at most twice the largest logit error:
     tol = 2⁻⁷·max|z|/T, max|z| from a float32 forward pass over prompts and responses."""
  tokens, mask = prefixed_batch
  module = MODEL.clone(cfg=MODEL.cfg.replace(dtype="bfloat16"))
  prefix, rest, rest_mask = sampling.split_shared_prefix(tokens, mask)
  got = jax.device_get(generate(module, tiny_params, jnp.asarray(rest), jnp.asarray(rest_mask),
                                jax.random.key(0), GREEDY, prefix=jnp.asarray(prefix)))
  want = jax.device_get(generate(module, tiny_params, jnp.asarray(tokens), jnp.asarray(mask),
                                 jax.random.key(0), GREEDY))
  check_conventions(got, GREEDY)
  assert np.asarray(got.mask).sum() > 3 * RAGGED_ROWS  # several tokens per row compared
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.lengths, want.lengths)
  for a, b in ((got.logprobs, want.logprobs), (got.sampling_logprobs, want.sampling_logprobs)):
    np.testing.assert_allclose(a, b, atol=1e-5)

  f32 = jax.device_get(generate(MODEL, tiny_params, jnp.asarray(tokens), jnp.asarray(mask),
                                jax.random.key(0), GREEDY))
  # positions up to each row's first token that differs from float32's (a near-tie bf16 may
  # flip; the contexts differ after it)
  differs = np.asarray(got.tokens) != np.asarray(f32.tokens)
  same_context = np.cumsum(differs, axis=1) == 0
  compared = same_context & np.asarray(got.mask) & np.asarray(f32.mask)
  assert compared.sum() >= 0.9 * np.asarray(f32.mask).sum(), compared.sum()
  seq = jnp.concatenate([jnp.asarray(tokens), f32.tokens], axis=1)
  seq_mask = jnp.concatenate([jnp.asarray(mask), f32.mask], axis=1)
  logits, _ = MODEL.apply({"params": tiny_params}, seq, positions_from_mask(seq_mask), seq_mask)
  max_logit = float(np.abs(np.asarray(logits))[np.asarray(seq_mask)].max())
  tol = 2.0 ** -7 * max_logit / GREEDY.temperature
  error = np.abs(np.asarray(got.logprobs) - np.asarray(f32.logprobs))[compared]
  assert 1e-4 < error.max() <= tol, (error.max(), tol)


def test_decode_layout_converted_once_gives_the_same_generation(tiny_params, ragged_batch):
  """Params put in ``decode_layout`` once (unrolled, fused, on CPU with [out, in] kernels: what
  ``generate`` converts to on every call) give the same tokens and log-probs, and converting
  again changes nothing."""
  prompts, mask, _ = ragged_batch
  config = STOP_CONFIGS["pad_is_stop"]
  want = jax.device_get(generate(MODEL, tiny_params, prompts, mask, jax.random.key(4), config))
  module, params = sampling.decode_layout(MODEL, tiny_params)
  assert not module.cfg.scan_layers and module.cfg.fused_projections
  assert module.cfg.transposed_kernels == (jax.default_backend() == "cpu")
  assert "layers_0" in params["model"] and "qkv" in params["model"]["layers_0"]["attn"]
  cfg = MODEL.cfg
  assert params["model"]["layers_0"]["mlp"]["down"]["kernel"].shape == (
      (cfg.hidden_size, cfg.intermediate_size) if module.cfg.transposed_kernels
      else (cfg.intermediate_size, cfg.hidden_size))
  again_module, again = sampling.decode_layout(module, params)
  assert again_module.cfg == module.cfg
  jax.tree.map(np.testing.assert_array_equal, again, params)
  # from [out, in] kernels that are not yet fused: the same layout
  t_module = MODEL.clone(cfg=MODEL.cfg.replace(transposed_kernels=True))
  t_module, t_params = sampling.decode_layout(t_module, transpose_kernels(tiny_params))
  assert t_module.cfg == module.cfg
  jax.tree.map(np.testing.assert_array_equal, t_params, params)
  got = jax.device_get(generate(module, params, prompts, mask, jax.random.key(4), config))
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-6)
