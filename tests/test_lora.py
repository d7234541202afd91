"""LoRA (ppojax.models.lora, transformer.Linear's adapters): exact start at the base, merge = adapted
model, gradients only for adapters, the reference from the base, and peft's layout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppojax.models import cache as C
from ppojax.models import hf, lora
from ppojax.models import kernels as K
from ppojax.models import layers
from ppojax.models import transformer as T
from ppojax.models.config import ModelConfig
from ppojax.run import build as build_lib
from ppojax.learner import state as state_lib

V, D, I, L, H = 64, 32, 48, 3, 4


def _cfg(model_type="llama", **changes):
  base = dict(model_type=model_type, vocab_size=V, hidden_size=D, intermediate_size=I,
              num_layers=L, num_heads=H, num_kv_heads=2, head_dim=D // H,
              max_position_embeddings=64, norm_eps=1e-5, tie_word_embeddings=False,
              qkv_bias=model_type == "qwen2")
  return ModelConfig(**dict(base, **changes))


def _base_params(cfg, seed=0):
  """Random base params (test_models' helper: no init compiled, norm scales ≈ 1)."""
  from test_models import _random_params  # pylint: disable=import-outside-toplevel
  return _random_params(cfg, seed)


def _inputs(b=2, t=7, seed=1):
  tokens = jnp.asarray(np.random.RandomState(seed).randint(0, V, (b, t)), jnp.int32)
  mask = jnp.ones((b, t), jnp.bool_).at[0, :2].set(False)  # a left-padded row
  return tokens, C.positions_from_mask(mask), mask


def _logits(cfg, params):
  out, _ = T.CausalLM(cfg).apply({"params": params}, *_inputs())
  return out


def _trained(adapters, seed=3):
  """Adapters with B ≠ 0, as after some training."""
  rng = np.random.RandomState(seed)
  return jax.tree.map(lambda x: x + 0.05 * rng.standard_normal(x.shape).astype(x.dtype),
                      adapters)


@pytest.mark.parametrize("model_type,scan", [("llama", True), ("qwen2", False), ("gpt2", True)])
def test_adapters_at_init_give_exactly_the_base_logits(model_type, scan):
  base_cfg = _cfg(model_type, scan_layers=scan, tie_word_embeddings=model_type == "gpt2",
                  num_kv_heads=H if model_type == "gpt2" else 2, out_bias=model_type == "gpt2",
                  qkv_bias=model_type != "llama")
  names = ("q", "v", "fc", "proj") if model_type == "gpt2" else lora.ALL_LINEAR
  cfg = lora.adapted_config(base_cfg, rank=4, alpha=8, names=names)
  base = _base_params(base_cfg)
  adapters = lora.init_adapters(base, cfg, jax.random.PRNGKey(0))
  assert lora.count(adapters) > 0
  np.testing.assert_array_equal(_logits(cfg, lora.combine(base, adapters)),
                                _logits(base_cfg, base))
  # and after training, merging into the kernels computes what the adapted model computes
  params = lora.combine(base, _trained(adapters))
  adapted = _logits(cfg, params)
  assert np.abs(adapted - _logits(base_cfg, base)).max() > 1e-3
  np.testing.assert_allclose(_logits(base_cfg, lora.merge(params, cfg)), adapted, atol=2e-5)


def test_split_and_combine_are_inverse_and_the_adapters_are_the_only_lora_leaves():
  cfg = lora.adapted_config(_cfg(), rank=2, alpha=4, names="q,k,v,o")
  base = _base_params(lora.base_config(cfg))
  params = lora.combine(base, lora.init_adapters(base, cfg, jax.random.PRNGKey(1)))
  back_base, adapters = lora.split(params)
  assert jax.tree.structure(back_base) == jax.tree.structure(base)
  assert jax.tree.structure(lora.combine(back_base, adapters)) == jax.tree.structure(params)
  # exactly the module's own parameter tree: init of the adapted module has the same structure
  tokens = jnp.zeros((1, 4), jnp.int32)
  shapes = jax.eval_shape(lambda: T.CausalLM(cfg).init(
      jax.random.PRNGKey(0), tokens, tokens, tokens > -1)["params"])
  assert jax.tree.structure(shapes) == jax.tree.structure(params)
  assert jax.tree.map(lambda x: x.shape, shapes) == jax.tree.map(lambda x: x.shape, params)
  leaves = jax.tree_util.tree_leaves_with_path(adapters)
  assert len(leaves) == 2 * 4  # A and B of q, k, v, o (stacked over the layers)
  for path, x in leaves:
    name = path[-1].key
    assert name in ("lora_a", "lora_b") and x.dtype == jnp.float32 and x.shape[0] == L
  # A ~ U(±1/√in), B = 0
  a = adapters["model"]["layers"]["attn"]["q"]["lora_a"]
  assert a.shape == (L, D, 2) and 0 < np.abs(a).max() <= 1 / np.sqrt(D)
  assert not np.any(adapters["model"]["layers"]["attn"]["q"]["lora_b"])


def test_gradients_flow_to_the_adapters_only_and_the_reference_is_the_base():
  cfg = lora.adapted_config(_cfg(), rank=4, alpha=16, names="all-linear")
  base_cfg = lora.base_config(cfg)
  base = _base_params(base_cfg)
  adapters = lora.init_adapters(base, cfg, jax.random.PRNGKey(2))

  def loss(adapters):
    return jnp.mean(_logits(cfg, lora.combine(base, adapters)) ** 2)

  grads = jax.grad(loss)(adapters)
  assert jax.tree.structure(grads) == jax.tree.structure(adapters)
  # at init B = 0: dL/dA = 0 and dL/dB ≠ 0 (the standard LoRA start)
  q = grads["model"]["layers"]["attn"]["q"]
  assert not np.any(q["lora_a"]) and np.abs(q["lora_b"]).max() > 0
  grads = jax.grad(loss)(_trained(adapters))
  assert all(np.abs(g).max() > 0 for g in jax.tree.leaves(grads))
  # the reference: the base params through the module without adapters, = a separate base
  np.testing.assert_array_equal(_logits(base_cfg, lora.split(lora.combine(base, adapters))[0]),
                                _logits(base_cfg, base))


def test_bfloat16_base_with_float32_adapters():
  cfg = lora.adapted_config(_cfg(param_dtype="bfloat16", dtype="float32"), 4, 8, "q,v")
  base = _base_params(lora.base_config(cfg))
  assert jax.tree.leaves(base)[0].dtype == jnp.bfloat16
  adapters = lora.init_adapters(base, cfg, jax.random.PRNGKey(0))
  assert {x.dtype for x in jax.tree.leaves(adapters)} == {jnp.dtype(jnp.float32)}
  np.testing.assert_array_equal(_logits(cfg, lora.combine(base, adapters)),
                                _logits(lora.base_config(cfg), base))
  merged = lora.merge(lora.combine(base, _trained(adapters)), cfg)
  assert merged["model"]["layers"]["attn"]["q"]["kernel"].dtype == jnp.bfloat16


def test_targets_accept_peft_names_and_refuse_unknown_layers():
  assert lora.targets("q_proj, v_proj") == ("q", "v")
  assert lora.targets(["all-linear"]) == lora.ALL_LINEAR
  with pytest.raises(ValueError, match="'qkv'.*choose from"):
    lora.targets("qkv")
  with pytest.raises(ValueError, match="at least one target"):
    lora.targets("")
  with pytest.raises(ValueError, match="rank must be >= 1"):
    lora.adapted_config(_cfg(), 0, 8, "q")
  with pytest.raises(ValueError, match="fused_projections=False"):
    _cfg(lora_rank=4, lora_targets=("q",), fused_projections=True)


def test_peft_export_loads_in_peft_and_gives_the_adapted_logits(tmp_path):
  torch = pytest.importorskip("torch")
  peft = pytest.importorskip("peft")
  cfg = lora.adapted_config(_cfg("qwen2"), rank=4, alpha=8, names="q,k,v,o,gate,up,down")
  base_cfg = lora.base_config(cfg)
  base = _base_params(base_cfg)
  params = lora.combine(base, _trained(lora.init_adapters(base, cfg, jax.random.PRNGKey(4))))
  adapters = lora.split(params)[1]
  hf.save_pretrained(tmp_path / "base", base_cfg, base)
  lora.save_peft(tmp_path / "adapters", adapters, cfg, base_model=str(tmp_path / "base"))
  net = hf.to_transformers(base_cfg, base)
  net = peft.PeftModel.from_pretrained(net, str(tmp_path / "adapters")).eval()
  tokens, _, mask = _inputs()
  with torch.no_grad():
    theirs = net(input_ids=torch.from_numpy(np.asarray(tokens)).long(),
                 attention_mask=torch.from_numpy(np.asarray(mask)).long()).logits.numpy()
  ours = np.asarray(_logits(cfg, params))
  real = np.asarray(mask)
  assert np.abs(ours - np.asarray(_logits(base_cfg, base)))[real].max() > 1e-3  # B ≠ 0 shows
  np.testing.assert_allclose(theirs[real], ours[real], atol=1e-4)
  # and the merged export is the same model for transformers alone
  merged = hf.to_transformers(base_cfg, lora.merge(params, cfg))
  with torch.no_grad():
    plain = merged(input_ids=torch.from_numpy(np.asarray(tokens)).long(),
                   attention_mask=torch.from_numpy(np.asarray(mask)).long()).logits.numpy()
  np.testing.assert_allclose(plain[real], ours[real], atol=1e-4)


# ---------------------------------------------------------------------------------------------
# In the run: state, reference, step, checkpoints, export
# ---------------------------------------------------------------------------------------------


def _toy(**changes):
  import pathlib  # pylint: disable=import-outside-toplevel

  overrides = {"rl__batch_size": 16, "num_iterations": 4, "save_every": 2, "log_every": 1,
               "sample_every": 0, **{k.replace(".", "__"): v for k, v in changes.items()}}
  return build_lib.load_config(pathlib.Path(__file__).parent.parent / "configs" / "toy.py",
                            **overrides)


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_a_lora_run_trains_only_adapters_with_the_base_as_reference(algorithm):
  extra = {"sampling.num_samples_per_prompt": 4, "rl.batch_size": 4} if algorithm != "ppo" else {}
  r = build_lib.build(_toy(**{"lora.rank": 4, "lora.targets": "q,v,down", "algorithm": algorithm,
                           "rl.kl_coef": 0.1, **extra}))
  state = r.state
  assert r.frozen.reference is None and state.base is not None  # no copy: the base is the ref
  names = {path[-1].key for path, _ in jax.tree_util.tree_leaves_with_path(state.actor)}
  assert names == {"lora_a", "lora_b"}
  opt_leaves = [x for x in jax.tree.leaves(state.actor_opt) if x.ndim > 0]
  assert sum(x.size for x in opt_leaves) == 2 * lora.count(state.actor)  # Adam's two moments
  base0 = jax.tree.map(np.asarray, state.base)
  # the reference log-probs = a separately built base model's (no adapters, no LoRA path)
  plain = build_lib.build(_toy(**{"algorithm": algorithm, "rl.kl_coef": 0.1, **extra}))
  prompts = r.source.batch(0).prompts
  roll = jax.jit(r.step.rollout)(state, r.frozen, prompts)
  ref = jax.jit(plain.step.rollout)(plain.state, plain.frozen, prompts)
  np.testing.assert_array_equal(roll.responses, ref.responses)  # B = 0: the base samples
  np.testing.assert_allclose(roll.ref_logp, ref.ref_logp, atol=1e-6)
  state, metrics = r.step.learn(jax.tree.map(jnp.copy, state), roll,
                                jnp.asarray(np.linspace(0, 1, roll.mask.shape[0]), jnp.float32))
  assert metrics["policy/grad_norm_avg"] > 0
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state.base), base0)
  b = state.actor["model"]["layers"]["attn"]["q"]["lora_b"]
  assert np.abs(np.asarray(b)).max() > 0  # the adapters moved
  assert state_lib.policy_params(state.actor, state.base)["model"]["embed"] is state.base[
      "model"]["embed"]


def test_a_lora_run_resumes_exactly_saves_small_checkpoints_and_exports(tmp_path):
  """With LoRA dropout (0.1), whose masks come from the run's key: the resumed run equals the
  whole one, and the export names the dropout. (Without dropout the update holds no random
  bits, test_lora_dropout_0_compiles_the_update_without_random_bits; resuming it is resuming
  any run, tests/test_train.py.)"""
  import json  # pylint: disable=import-outside-toplevel

  from ppojax.models import load_model  # pylint: disable=import-outside-toplevel
  from ppojax.run import reporting, runner  # pylint: disable=import-outside-toplevel
  config = _toy(**{"lora.rank": 4, "lora.dropout": 0.1, "rl.kl_coef": 0.1})
  whole = runner.run(config, str(tmp_path / "whole")).history
  runner.run(config, str(tmp_path / "parts"), stop_after=2)
  runner.run(config, str(tmp_path / "parts"))
  volatile = ("time/", "eps", "memory/", "compile/")
  read = lambda d: [{k: v for k, v in row.items() if not k.startswith(volatile)}  # noqa: E731
                    for row in reporting.read_metrics(str(tmp_path / d / "metrics.jsonl"))]
  assert read("parts") == read("whole") and len(whole) == 4
  assert all(np.isfinite(row["loss/policy_avg"]) and row["skipped/nonfinite"] == 0
             for row in read("whole"))
  # without a critic, a checkpoint is the adapters and their Adam moments (and the small
  # rest of the state): no base, no reference
  grpo = {"algorithm": "grpo", "sampling.num_samples_per_prompt": 4, "rl.batch_size": 4,
          "num_iterations": 2}
  runner.run(_toy(**grpo, **{"lora.rank": 2}), str(tmp_path / "lora"))
  size = sum(f.stat().st_size
             for f in (tmp_path / "lora" / "checkpoints" / "2").rglob("*") if f.is_file())
  shapes = build_lib.build(_toy(**grpo), abstract=True).state.actor  # no weights needed
  base_bytes = sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(shapes))
  # orbax's metadata, 0.1-0.2 MB whatever the arrays (it varied between machines), is most of
  # this tiny model's LoRA checkpoint: the bound is the base's own bytes, which it must lack (a
  # full checkpoint holds them three times: weights and two Adam moments)
  assert size < base_bytes, (size, base_bytes)
  # the merged export is the trained policy as a plain model; the adapters in peft's layout
  r = build_lib.build(config, abstract=True)
  exported = load_model(str(tmp_path / "whole" / "policy"))
  assert not any("lora" in jax.tree_util.keystr(p)
                 for p, _ in jax.tree_util.tree_leaves_with_path(exported.params))
  adapter_config = json.loads((tmp_path / "whole" / "adapters" / "adapter_config.json").read_text())
  assert adapter_config["r"] == 4 and adapter_config["peft_type"] == "LORA"
  assert adapter_config["lora_dropout"] == 0.1
  assert (tmp_path / "whole" / "adapters" / "adapter_model.safetensors").exists()
  assert r.models.reference.cfg.lora_rank == 0


def test_a_lora_critic_shares_the_policy_base():
  r = build_lib.build(_toy(**{"lora.rank": 4, "lora.critic": True, "model.critic_init": "policy",
                           "rl.kl_coef": 0.1}))
  state = r.state
  names = {path[-1].key for path, _ in jax.tree_util.tree_leaves_with_path(state.critic)}
  assert names == {"lora_a", "lora_b", "kernel"}  # its adapters and the value head only
  assert set(state.critic) == {"model", "score"}
  # the whole state holds one copy of the base: every non-adapter weight is in state.base
  big = sum(x.size for x in jax.tree.leaves(state.base))
  trained = sum(x.size for x in jax.tree.leaves((state.actor, state.critic)))
  assert trained < 0.5 * big
  prompts = r.source.batch(0).prompts
  roll = jax.jit(r.step.rollout)(state, r.frozen, prompts)
  new, metrics = r.step.learn(jax.tree.map(jnp.copy, state), roll,
                              jnp.asarray(np.linspace(0, 1, roll.mask.shape[0]), jnp.float32))
  assert metrics["val/grad_norm_avg"] > 0 and np.isfinite(metrics["loss/value_avg"])
  moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()),
                       new.critic, state.critic)
  assert moved["score"]["kernel"] > 0
  with pytest.raises(ValueError, match="lora.critic=True.*needs lora.rank > 0"):
    build_lib.build(_toy(**{"lora.critic": True, "model.critic_init": "policy"}))


MESH_SCRIPT = """
import pathlib, jax, jax.numpy as jnp, numpy as np
from ppojax.run import runner
from ppojax.infra import sharding
from ppojax.learner import state as state_lib
from ppojax.run import build as build_lib
root = pathlib.Path("ROOT")
over = dict(rl__batch_size=16, lora__rank=4, lora__critic=True, model__critic_init="policy",
            rl__kl_coef=0.1, model__tiny__hidden_size=64, lora__dropout=DROPOUT)
one = build_lib.build(build_lib.load_config(root / "configs" / "toy.py", **over))
mesh = build_lib.build(build_lib.load_config(root / "configs" / "toy.py", mesh__shape=(2, 4, 1), **over))
q = mesh.state.base["model"]["layers"]["attn"]["q"]["kernel"]
assert len(q.sharding.device_set) == 8 and not q.sharding.is_fully_replicated, q.sharding
assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(mesh.state.actor))
rows = []
for run in (one, mesh):
  state = jax.tree.map(jnp.copy, run.state)
  prompts = sharding.place_prompts(run.source.batch(0).prompts, run.mesh)
  state, metrics, _, _ = runner.iteration(run, state, prompts)
  state, metrics, _, _ = runner.iteration(run, state, prompts)
  rows.append(metrics)
for k in ("objective/scores", "loss/policy_avg", "loss/value_avg"):
  np.testing.assert_allclose(rows[0][k], rows[1][k], rtol=2e-4, atol=2e-5, err_msg=k)
print("OK")
"""


def test_lora_on_a_mesh_shards_the_base_replicates_adapters_and_matches_one_device(
    run_on_8_cpu_devices):
  """With LoRA dropout (0.2): its masks are the same on a mesh, and every other part of the LoRA
  step runs as it does without dropout (whose program, without random bits, is
  test_lora_dropout_0_compiles_the_update_without_random_bits's)."""
  import pathlib  # pylint: disable=import-outside-toplevel
  root = pathlib.Path(__file__).resolve().parent.parent
  run_on_8_cpu_devices(MESH_SCRIPT.replace("ROOT", str(root)).replace("DROPOUT", "0.2"))


@pytest.mark.parametrize("transposed", [False, True])
def test_a_lora_layer_and_its_merge_scale_the_adapters_by_alpha_over_r(transposed):
  """Linear's output against y = x·W + (α/r)·(x·A)·B written out in float64 NumPy on the layer's
  own parameters, and ``lora.merge``'s kernel against W + (α/r)·A·B; B ≠ 0 (the adapter term
  counts) and α = 12 ≠ r = 4 (a scale of α or 1 instead of α/r = 3 gives another output)."""
  rank, alpha, d_in, d_out = 4, 12.0, 16, 8
  cfg = lora.adapted_config(_cfg(transposed_kernels=transposed), rank=rank, alpha=alpha,
                            names="q")
  rng = np.random.default_rng(0)
  w, a, b = (rng.standard_normal(s) for s in ((d_in, d_out), (d_in, rank), (rank, d_out)))
  x = rng.standard_normal((2, 3, d_in))
  f32 = lambda v: jnp.asarray(v, jnp.float32)  # noqa: E731
  params = {"kernel": f32(w.T if transposed else w), "lora_a": f32(a), "lora_b": f32(b)}
  y = layers.Linear(cfg, d_out, False, name="q").apply({"params": params}, f32(x))
  adapter = (x @ a) @ b
  np.testing.assert_allclose(y, x @ w + (alpha / rank) * adapter, rtol=1e-4, atol=1e-4)
  for wrong in (alpha, 1.0):  # the scales of a mistake are far from the output
    assert np.abs(y - (x @ w + wrong * adapter)).max() > 1.0
  merged = lora.merge({"q": params}, cfg)["q"]
  assert set(merged) == {"kernel"}
  want = w + (alpha / rank) * a @ b
  np.testing.assert_allclose(merged["kernel"], want.T if transposed else want, rtol=1e-5,
                             atol=1e-5)


@pytest.mark.parametrize("w_axis", [0, 1])
def test_lora_matmul_gradients_equal_autodiff_of_the_plain_formula(w_axis):
  rng = np.random.RandomState(0)
  x = jnp.asarray(rng.standard_normal((2, 5, 6)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((6, 7)), jnp.float32)
  a = jnp.asarray(rng.standard_normal((6, 3)), jnp.float32)
  b = jnp.asarray(rng.standard_normal((3, 7)), jnp.float32)
  dy = jnp.asarray(rng.standard_normal((2, 5, 7)), jnp.float32)
  kernel = w.T if w_axis else w

  def ours(x, a, b):
    return jnp.sum(K.lora_matmul(x, kernel, a, b, 0.5, w_axis) * dy)

  def plain(x, a, b):
    return jnp.sum((x @ w + 0.5 * (x @ a) @ b) * dy)

  np.testing.assert_allclose(ours(x, a, b), plain(x, a, b), rtol=1e-5)
  for got, want in zip(jax.grad(ours, (0, 1, 2))(x, a, b), jax.grad(plain, (0, 1, 2))(x, a, b)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  # the base kernel is frozen by construction
  g_w = jax.grad(lambda k: jnp.sum(K.lora_matmul(x, k, a, b, 0.5, w_axis) * dy))(kernel)
  assert not np.any(g_w)


# ---------------------------------------------------------------------------------------------
# LoRA dropout: on the adapters' input, in the update only
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("w_axis", [0, 1])
def test_lora_dropout_matmul_gradients_equal_autodiff_with_the_same_mask(w_axis):
  rng = np.random.RandomState(0)
  x = jnp.asarray(rng.standard_normal((2, 5, 6)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((6, 7)), jnp.float32)
  a = jnp.asarray(rng.standard_normal((6, 3)), jnp.float32)
  b = jnp.asarray(rng.standard_normal((3, 7)), jnp.float32)
  dy = jnp.asarray(rng.standard_normal((2, 5, 7)), jnp.float32)
  keep = jax.random.bernoulli(jax.random.key(0), 0.7, x.shape)
  kernel = w.T if w_axis else w

  def ours(x, a, b):
    return jnp.sum(K.lora_dropout_matmul(x, kernel, a, b, keep, 0.5, 0.3, w_axis) * dy)

  def plain(x, a, b):  # y = x·W + s·(x_d·A)·B, x_d = x ⊙ keep/(1 − p)
    return jnp.sum((x @ w + 0.5 * ((x * keep / 0.7) @ a) @ b) * dy)

  np.testing.assert_allclose(ours(x, a, b), plain(x, a, b), rtol=1e-5)
  for got, want in zip(jax.grad(ours, (0, 1, 2))(x, a, b), jax.grad(plain, (0, 1, 2))(x, a, b)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  g_w = jax.grad(lambda k: jnp.sum(K.lora_dropout_matmul(x, k, a, b, keep, 0.5, 0.3, w_axis)
                                   * dy))(kernel)
  assert not np.any(g_w)  # the base stays frozen


def test_lora_dropout_masks_keep_1_minus_p_scaled_and_differ_per_layer(monkeypatch):
  # y = x_d exactly: W = 0, A = B = I, α = r; x = 1, so y shows the scaled mask
  n, p = 256, 0.25
  cfg = lora.adapted_config(_cfg(hidden_size=n), rank=n, alpha=n, names="q", dropout=p)
  params = {"kernel": jnp.zeros((n, n)), "lora_a": jnp.eye(n), "lora_b": jnp.eye(n)}
  linear = layers.Linear(cfg, n, False, name="q")
  x = jnp.ones((4, 8, n))
  y = np.asarray(linear.apply({"params": params}, x, rngs={"dropout": jax.random.key(0)}))
  kept = y != 0
  assert abs(kept.mean() - (1 - p)) < 0.02  # 8,192 draws: σ ≈ 0.005
  np.testing.assert_allclose(y[kept], 1 / (1 - p), rtol=1e-6)  # inverted dropout
  np.testing.assert_array_equal(linear.apply({"params": params}, x), x)  # no rng: no dropout
  # in a model (scanned layers): every layer and projection draws its own mask
  masks = []
  plain = K.lora_dropout_matmul

  def spy(x, w, a, b, keep, *args):
    jax.debug.callback(lambda k: masks.append(np.asarray(k)), keep)
    return plain(x, w, a, b, keep, *args)

  monkeypatch.setattr(layers, "lora_dropout_matmul", spy)
  cfg = lora.adapted_config(_cfg(), rank=2, alpha=4, names="all-linear", dropout=0.5)
  base = _base_params(lora.base_config(cfg))
  params = lora.combine(base, lora.init_adapters(base, cfg, jax.random.PRNGKey(0)))
  T.CausalLM(cfg).apply({"params": params}, *_inputs(), rngs={"dropout": jax.random.key(1)})
  jax.effects_barrier()
  assert len(masks) == L * 7 and len({m.tobytes() for m in masks}) == L * 7


def test_lora_dropout_only_with_an_rng_and_p_0_is_the_path_without():
  cfg = lora.adapted_config(_cfg(), rank=4, alpha=8, names="all-linear", dropout=0.3)
  base = _base_params(lora.base_config(cfg))
  params = lora.combine(base, _trained(lora.init_adapters(base, cfg, jax.random.PRNGKey(0))))
  no_dropout = _logits(cfg.replace(lora_dropout=0.0), params)
  np.testing.assert_array_equal(_logits(cfg, params), no_dropout)  # no rng: deterministic
  with_rng = lambda c, k: T.CausalLM(c).apply(  # noqa: E731
      {"params": params}, *_inputs(), rngs={"dropout": jax.random.key(k)})[0]
  np.testing.assert_array_equal(with_rng(cfg, 1), with_rng(cfg, 1))
  assert np.abs(with_rng(cfg, 1) - with_rng(cfg, 2)).max() > 1e-3
  assert np.abs(with_rng(cfg, 1) - no_dropout).max() > 1e-3
  np.testing.assert_array_equal(with_rng(cfg.replace(lora_dropout=0.0), 1), no_dropout)
  # the reference (base_config) has no dropout to switch on
  assert lora.base_config(cfg).lora_dropout == 0.0
  with pytest.raises(ValueError, match="lora_dropout=1.0 must be in"):
    cfg.replace(lora_dropout=1.0)


def test_lora_dropout_0_compiles_the_update_without_random_bits():
  """p = 0 draws nothing (no random-bit operation in the update's gradient jaxpr); p > 0 draws
  in the gradient, and a module with p > 0 given no key traces the same jaxpr as p = 0; a
  one-step update is single-pass only without dropout."""
  import dataclasses  # pylint: disable=import-outside-toplevel

  from ppojax.core import algorithms
  from ppojax.learner import experience
  from ppojax.learner import update as update_lib  # pylint: disable=import-outside-toplevel
  r = build_lib.build(_toy(**{"lora.rank": 4, "lora.critic": True, "model.critic_init": "policy",
                           "rl.kl_coef": 0.1}))
  ppo = algorithms.resolve(r.config).rl
  roll = jax.eval_shape(r.step.rollout, r.state, r.frozen, r.source.batch(0).prompts)
  exp = jax.eval_shape(lambda roll: experience.make_experience(
      roll, jnp.zeros(roll.mask.shape[0]), 0.1, r.algorithm, ppo)[0], roll)
  dropped = dataclasses.replace(
      r.models, policy=T.CausalLM(r.models.policy.cfg.replace(lora_dropout=0.1)),
      critic=T.ValueModel(r.models.critic.cfg.replace(lora_dropout=0.1)))
  idx = jnp.arange(16).reshape(2, 8)
  params = (r.state.actor, r.state.critic)

  def grads_jaxpr(models, key):
    ctx = state_lib.Context(r.state.base, key)
    return str(jax.make_jaxpr(lambda p, e: update_lib._minibatch_grads(  # pylint: disable=W0212
        p, models, e, idx, r.algorithm, ppo, 1.0, ctx=ctx))(params, exp))

  random_ops = ("random_bits", "threefry2x32", "random_fold_in", "random_split")
  p0 = grads_jaxpr(r.models, None)
  assert not any(op in p0 for op in random_ops)
  assert grads_jaxpr(dropped, None) == p0  # p > 0 but no key: the same program
  assert "random_bits" in grads_jaxpr(dropped, jax.random.key(0))

  # a one-step update takes its old log-probs and values from a rollout forward with dropout
  one = ppo.copy_and_resolve_references()
  one.num_epochs = one.num_minibatches = one.grad_accum = 1
  assert update_lib.single_pass(one) and not update_lib.single_pass(one, 0.1)


def _same(a, b) -> bool:
  return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_lora_dropout_acts_in_the_update_only_and_is_reproducible():
  """Policy and LoRA critic: the rollout (samples, old and reference log-probs, old values) is
  bit for bit the one without dropout; the update is another, and the same for the same state."""
  runs = {p: build_lib.build(_toy(**{"lora.rank": 4, "lora.critic": True, "lora.dropout": p,
                                  "model.critic_init": "policy", "rl.kl_coef": 0.1}))
          for p in (0.0, 0.3)}
  prompts = runs[0.0].source.batch(0).prompts
  rolls = {p: r.step.rollout(r.state, r.frozen, prompts) for p, r in runs.items()}
  for field in ("responses", "old_logp", "ref_logp", "old_values"):
    np.testing.assert_array_equal(getattr(rolls[0.3], field), getattr(rolls[0.0], field))
  scores = jnp.asarray(np.linspace(0, 1, rolls[0.0].mask.shape[0]), jnp.float32)

  def learn(p):
    return runs[p].step.learn(jax.tree.map(jnp.copy, runs[p].state), rolls[p], scores)

  (once, m_once), (again, _), (without, _) = learn(0.3), learn(0.3), learn(0.0)
  assert _same(once.actor, again.actor) and _same(once.critic, again.critic)
  assert not _same(once.actor, without.actor) and not _same(once.critic, without.critic)
  assert np.isfinite(m_once["loss/policy_avg"]) and np.isfinite(m_once["loss/value_avg"])
