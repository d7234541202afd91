"""The padding-free learn phase (models/packing.py, ``rl.pack_fractions``): first-fit decreasing
against a plain NumPy loop, the packed layout read back token by token, and the packed rows'
log-probs, entropies, values and gradients equal to the padded rows' (float32 and bfloat16,
with a shared prefix, learned positions, a sliding window and LoRA); then whole iterations with
packing on equal those without, on both update paths, and a batch that does not fit runs padded."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppojax.models import lora, packing, passes
from ppojax.models import transformer as T
from ppojax.models.config import ModelConfig

V, D, I, L, H = 64, 32, 48, 2, 4
P, R = 6, 8  # prompt columns, response columns


def _cfg(model_type="llama", **changes):
  gpt2 = model_type == "gpt2"
  return ModelConfig(**{
      "model_type": model_type, "vocab_size": V, "hidden_size": D, "intermediate_size": I,
      "num_layers": L, "num_heads": H, "num_kv_heads": H if gpt2 else 2, "head_dim": D // H,
      "max_position_embeddings": 64, "norm_eps": 1e-5, "tie_word_embeddings": gpt2,
      "qkv_bias": gpt2, "out_bias": gpt2, **changes})


def _params(cfg, seed=0):
  from test_models import _random_params  # pylint: disable=import-outside-toplevel
  return _random_params(cfg, seed)


def _ffd_reference(lengths, rows, row_len):
  """First-fit decreasing as a plain loop: longest first (ties by index), each into the first
  row with room."""
  fill, row, offset = [0] * rows, [None] * len(lengths), [None] * len(lengths)
  for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
    for k in range(rows):
      if fill[k] + lengths[i] <= row_len:
        row[i], offset[i] = k, fill[k]
        fill[k] += lengths[i]
        break
    else:
      return None
  return row, offset


@pytest.mark.parametrize("seed", range(6))
def test_first_fit_decreasing_matches_a_plain_loop(seed):
  rng = np.random.RandomState(seed)
  b, row_len = rng.randint(1, 12), rng.randint(4, 20)
  lengths = rng.randint(1, row_len + 1, b)
  rows = rng.randint(1, b + 1)
  row, offset, fits = jax.jit(packing.first_fit, static_argnums=(1, 2))(
      jnp.asarray(lengths), rows, row_len)
  expected = _ffd_reference(list(lengths), rows, row_len)
  assert bool(fits) == (expected is not None)
  if expected is not None:
    np.testing.assert_array_equal(row, expected[0])
    np.testing.assert_array_equal(offset, expected[1])
    # no two sequences share a slot, and every one ends inside its row
    slots = {(int(k), int(o) + j) for k, o, n in zip(row, offset, lengths) for j in range(n)}
    assert len(slots) == lengths.sum() and max(s[1] for s in slots) < row_len


def test_the_ladder_runs_the_fewest_rows_that_hold_the_batch():
  """``loss.packed_or_padded`` with ``rl.pack_fractions`` (0.25, 0.5, 0.75) on batches of 8
  whose sequences grow with the seed: the branch that runs is the first fraction whose ⌈f·n⌉
  rows hold every sequence by the plain first-fit loop, else the padded one (all four seen);
  its metrics say which, and the fill is of the slots that ran."""
  from ppojax.learner.loss import packed_or_padded  # pylint: disable=import-outside-toplevel
  from ppojax.rollout.rollout import Rollout  # pylint: disable=import-outside-toplevel
  b, fractions, seen = 8, (0.25, 0.5, 0.75), set()
  counts = [packing.packed_rows(b, f) for f in fractions]
  fn = lambda p: jnp.int32(b if p is None else p.tokens.shape[0])  # noqa: E731
  run = jax.jit(lambda r: packed_or_padded(fn, r, {"pack_fractions": fractions}))
  for seed in range(12):
    rng, top = np.random.RandomState(seed), (2, 4, 6, 8)[seed % 4]
    prompt_lens = np.minimum(rng.randint(1, max(top - 1, 2), b) + 3 * (top == 8), P)
    prompts, prompt_mask, responses, mask = _batch(seed, b, prompt_lens,
                                                   rng.randint(1, top + 1, b))
    lengths = [int(n) for n in prompt_mask.sum(1) + mask.sum(1)]
    expected = next((c for c in counts if _ffd_reference(lengths, c, P + R) is not None), b)
    seen.add(expected)
    rows_run, metrics = run(Rollout(prompts, prompt_mask, responses, mask, None, None, None,
                                    None))
    assert int(rows_run) == expected, (seed, lengths)
    assert float(metrics["update/packed"]) == (expected < b)
    np.testing.assert_allclose(metrics["update/pack_rows"], expected / b)
    np.testing.assert_allclose(metrics["update/pack_fill"],
                               sum(lengths) / (expected * (P + R)), rtol=1e-6)
  assert seen == {*counts, b}


def _batch(seed=0, b=6, prompt_lens=None, response_lens=None):
  """Left-padded prompts [b, P] and responses [b, R] of the given real lengths (pad 0)."""
  rng = np.random.RandomState(seed)
  prompt_lens = rng.randint(1, P + 1, b) if prompt_lens is None else np.asarray(prompt_lens)
  response_lens = rng.randint(1, R + 1, b) if response_lens is None else np.asarray(response_lens)
  prompt_mask = np.arange(P)[None] >= P - prompt_lens[:, None]
  mask = np.arange(R)[None] < response_lens[:, None]
  prompts = np.where(prompt_mask, rng.randint(1, V, (b, P)), 0)
  responses = np.where(mask, rng.randint(1, V, (b, R)), 0)
  return tuple(jnp.asarray(x) for x in (prompts, prompt_mask, responses, mask))


def test_the_packed_layout_holds_each_sequence_in_order_and_reads_back_each_prediction():
  prompts, prompt_mask, responses, mask = _batch(seed=1)
  tokens, seq_mask, positions = passes.sequence(prompts, prompt_mask, responses, mask)
  rows = 4
  p = packing.pack(tokens, seq_mask, positions, R, rows)
  assert bool(p.fits)
  packed, segments, pos = (np.asarray(x) for x in (p.tokens, p.segments, p.positions))
  for i in range(prompts.shape[0]):
    real = np.asarray(tokens[i])[np.asarray(seq_mask[i])]
    where = np.nonzero(segments == i + 1)
    np.testing.assert_array_equal(packed[where], real)  # row-major order: the sequence's order
    np.testing.assert_array_equal(pos[where], np.arange(real.size))
    assert len(set(where[0])) == 1  # one row per sequence
  # the head at each read slot predicts that response token (its target is the token)
  targets = np.asarray(p.targets).reshape(-1)[np.asarray(p.read)]
  np.testing.assert_array_equal(np.where(mask, targets, 0), responses)
  assert float(packing.fill(p)) == pytest.approx(float(seq_mask.sum()) / (rows * (P + R)))
  assert not bool(packing.pack(tokens, seq_mask, positions, R, 1).fits)


CASES = {
    "llama-f32": (_cfg(), {}, 1e-5),
    "gpt2-f32": (_cfg("gpt2"), {}, 1e-5),
    "llama-prefix-f32": (_cfg(), {"prefix": 3}, 1e-5),
    "mistral-window-f32": (_cfg("mistral", layer_windows=(3, 0)), {}, 1e-5),
    "llama-lora-f32": (lora.adapted_config(_cfg(), rank=4, alpha=8, names=lora.ALL_LINEAR),
                       {"lora": True}, 1e-5),
    "llama-lora-bf16": (lora.adapted_config(_cfg(dtype="bfloat16"), rank=4, alpha=8,
                                            names=lora.ALL_LINEAR), {"lora": True}, 3e-2),
}


def _setup(cfg, prefix_len):
  """(params, batch, shared prefix or None); LoRA: adapters with B ≠ 0, as after training."""
  params = _params(lora.base_config(cfg) if cfg.lora_rank else cfg)
  if cfg.lora_rank:
    adapters = lora.init_adapters(params, cfg, jax.random.PRNGKey(0))
    noise = lambda x: x + 0.05 * jax.random.normal(jax.random.PRNGKey(4), x.shape)  # noqa: E731
    params = lora.combine(params, jax.tree.map(noise, adapters))
  lens = np.array([6, 4, 5, 4, 4, 5])
  prompts, prompt_mask, responses, mask = _batch(seed=2, prompt_lens=lens,
                                                 response_lens=[2, 8, 1, 3, 5, 2])
  prefix = None
  if prefix_len:  # every row's first prefix_len real tokens are the same
    prefix = np.arange(1, prefix_len + 1)
    prompts = np.asarray(prompts).copy()
    for i, n in enumerate(lens):
      prompts[i, P - n:P - n + prefix_len] = prefix
    prompts, prefix = jnp.asarray(prompts), jnp.asarray(prefix, jnp.int32)
  return params, (prompts, prompt_mask, responses, mask), prefix


def _outputs(cfg, params, batch, prefix, packed_rows):
  """(log π_T, H) from the policy and V from a value model with the same body, [B, R] each, 0
  off the mask; packed into ``packed_rows`` rows (or as the ``Packing`` given), or padded
  (None)."""
  responses, mask = batch[2:]
  lm, vm = T.CausalLM(cfg), T.ValueModel(cfg)
  vparams = {"model": params["model"],
             "score": {"kernel": jnp.linspace(-0.5, 0.5, D, dtype=jnp.float32)[:, None]}}
  if packed_rows is None:
    hidden = passes.response_hidden(lm, params, *batch, prefix)
    logp, ent = passes.head_logprobs(lm, params, hidden, responses, 0.7, entropy=True,
                                     chunk_size=None)
    values = passes.response_values(vm, vparams, *batch, prefix)
    return jnp.where(mask, logp, 0), jnp.where(mask, ent, 0), values, True
  p = packed_rows
  if not isinstance(p, packing.Packing):
    p = packing.pack(*passes.sequence(*batch, prefix), R, packed_rows)
  hidden = passes.packed_hidden(lm, params, p, prefix)
  logp, ent = passes.head_logprobs(lm, params, hidden, p.targets, 0.7, entropy=True,
                                   chunk_size=None)
  return (packing.unpack(logp, p, mask), packing.unpack(ent, p, mask),
          passes.packed_values(vm, vparams, p, mask, prefix), p.fits)


@pytest.mark.parametrize("case", CASES)
def test_packed_rows_give_the_padded_rows_outputs_and_gradients(case):
  cfg, opts, tol = CASES[case]
  params, batch, prefix = _setup(cfg, opts.get("prefix", 0))
  mask = batch[3]
  base, trainable = lora.split(params) if opts.get("lora") else (None, params)

  def loss(train, rows):  # Σ a_t·log π + 0.1·H + 0.3·V² over the mask: every output in the grads
    full = lora.combine(base, train) if opts.get("lora") else train
    logp, ent, values, fits = _outputs(cfg, full, batch, prefix, rows)
    weights = jnp.sin(jnp.arange(mask.size, dtype=jnp.float32)).reshape(mask.shape)
    return jnp.sum(jnp.where(mask, weights * logp + 0.1 * ent + 0.3 * values ** 2, 0)), (
        logp, ent, values, fits)

  (l_pad, out_pad), g_pad = jax.jit(jax.value_and_grad(lambda t: loss(t, None), has_aux=True))(
      trainable)
  (l_pack, out_pack), g_pack = jax.jit(jax.value_and_grad(lambda t: loss(t, 4), has_aux=True))(
      trainable)
  assert bool(out_pack[-1])  # the 6 sequences fit in 4 rows, some two to a row
  for a, b in zip(out_pad[:-1], out_pack[:-1]):
    np.testing.assert_allclose(np.asarray(b, np.float32), np.asarray(a, np.float32),
                               rtol=tol, atol=tol)
  np.testing.assert_allclose(float(l_pack), float(l_pad), rtol=tol, atol=tol)
  scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(g_pad))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(
      np.asarray(b, np.float32), np.asarray(a, np.float32), rtol=tol, atol=tol * scale),
      g_pad, g_pack)


def test_sequences_out_of_the_loss_take_no_slot():
  """``packed_or_padded`` given the loss mask: sequences 1 and 4 (12 and 9 of the 49 tokens)
  have no token in the loss, and the other four (8 + 7 + 7 + 6 = 28) fill two rows of 14
  exactly, where all six need four. The outputs of the four equal the padded rows'; the two
  left out give 0."""
  from ppojax.learner.loss import packed_or_padded  # pylint: disable=import-outside-toplevel
  from ppojax.rollout.rollout import Rollout  # pylint: disable=import-outside-toplevel
  cfg = _cfg()
  params, batch, _ = _setup(cfg, 0)
  left_out = np.array([False, True, False, False, True, False])
  loss_mask = batch[3] & jnp.asarray(~left_out)[:, None]
  r = Rollout(*batch, None, None, None, None)
  fn = lambda p: _outputs(cfg, params, batch, None, p)[:3]  # noqa: E731
  run = jax.jit(lambda m: packed_or_padded(fn, r, {"pack_fractions": (0.3,)}, m))
  outputs, metrics = run(loss_mask)
  assert float(metrics["update/packed"]) == 1.0
  assert float(metrics["update/pack_rows"]) == pytest.approx(2 / 6)  # ⌈0.3·6⌉ rows
  assert float(metrics["update/pack_fill"]) == pytest.approx(28 / (2 * (P + R)))
  padded = _outputs(cfg, params, batch, None, None)[:3]
  for got, want in zip(outputs, padded):
    np.testing.assert_allclose(np.asarray(got)[~left_out], np.asarray(want)[~left_out],
                               rtol=1e-5, atol=1e-5)
    assert not np.asarray(got)[left_out].any()
  _, metrics = run(batch[3])  # every sequence in the loss: two rows hold 28 of 49 tokens
  assert float(metrics["update/packed"]) == 0.0


@pytest.mark.parametrize("path,ladder", [("minibatches", (1.0,)), ("single_pass", (0.05, 1.0))])
def test_iterations_with_packing_equal_iterations_without(path, ladder):
  """configs/toy.py (PPO with a critic): 2 epochs × 2 minibatches, or one step whose forward
  pass gives the old log-probs and values. ``rl.pack_fractions`` (1,) packs every micro-batch
  (it always fits: a row per sequence at worst); (0.05, 1) tries one row, then a row per
  sequence, and runs the second (the ``lax.switch`` of ``loss.packed_or_padded``, the same on
  both paths; the padded branch where no fraction fits:
  test_the_ladder_runs_the_fewest_rows_that_hold_the_batch). Either way the states and
  metrics equal the padded run's."""
  from test_step import _assert_close, _iterate, toy_config  # pylint: disable=import-outside-toplevel

  from ppojax.run import build as build_lib  # pylint: disable=import-outside-toplevel
  single = {"rl.num_epochs": 1, "rl.num_minibatches": 1} if path == "single_pass" else {}
  state, rows = _iterate(build_lib.build(toy_config(**single)), 2)[:2]
  run = build_lib.build(toy_config(**single, **{"rl.pack_fractions": ladder}))
  other_state, other_rows = _iterate(run, 2)[:2]
  _assert_close((state.actor, state.critic), (other_state.actor, other_state.critic),
                rtol=2e-5, atol=2e-6)
  for a, b in zip(rows, other_rows):
    assert b.pop("update/packed_avg") == 1.0
    assert b.pop("update/pack_rows_avg") == 1.0  # a row per sequence
    assert 0 < b.pop("update/pack_fill_avg") <= 1
    _assert_close(a, b, rtol=2e-5, atol=2e-6)
