"""LoRA's tree and array functions (ppojax.models.lora) on small hand-built parameter trees, each
against an independent NumPy reference: merge's W + (α/r)·A·B (stacked, transposed, bfloat16),
init_adapters' shapes and bounds, peft's names and [r, in] / [out, r] layouts, split/combine,
targets, the rank check and the dropout rngs. No model is built: these run in seconds."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppojax.models import lora
from ppojax.models.config import ModelConfig

L, D_IN, D_OUT, R = 2, 5, 3, 2


def _cfg(**changes):
  base = {"model_type": "llama", "vocab_size": 16, "hidden_size": 8, "intermediate_size": 12,
          "num_layers": L, "num_heads": 2, "num_kv_heads": 2, "head_dim": 4,
          "max_position_embeddings": 16, "norm_eps": 1e-5, "tie_word_embeddings": False,
          "lora_rank": R, "lora_alpha": 6.0, "lora_targets": ("q", "up")}
  return ModelConfig(**{**base, **changes})


def _rand(rng, *shape):
  return rng.standard_normal(shape).astype(np.float32)


def _params(rng, transposed=False):
  """A stacked tree: q and up adapted, v and the embedding not."""
  w_shape = (L, D_OUT, D_IN) if transposed else (L, D_IN, D_OUT)
  return {
      "model": {
          "embed": {"embedding": _rand(rng, 16, 8)},
          "layers": {
              "attn": {"q": {"kernel": _rand(rng, *w_shape), "lora_a": _rand(rng, L, D_IN, R),
                             "lora_b": _rand(rng, L, R, D_OUT)},
                       "v": {"kernel": _rand(rng, *w_shape)}},
              "mlp": {"up": {"kernel": _rand(rng, *w_shape), "bias": _rand(rng, L, D_OUT),
                             "lora_a": _rand(rng, L, D_IN, R),
                             "lora_b": _rand(rng, L, R, D_OUT)}},
          },
      }
  }


def _merged_numpy(node, scale, transposed):
  """W + scale·A·B in float64, by loops over the layers."""
  out = np.array(node["kernel"], np.float64)
  for i in range(L):
    delta = np.asarray(node["lora_a"][i], np.float64) @ np.asarray(node["lora_b"][i], np.float64)
    out[i] += scale * (delta.T if transposed else delta)
  return out


@pytest.mark.parametrize("transposed", [False, True])
def test_merge_adds_alpha_over_r_times_a_b_per_layer_and_drops_the_adapters(transposed):
  cfg = _cfg(transposed_kernels=transposed)
  params = _params(np.random.default_rng(0), transposed)
  merged = lora.merge(params, cfg)
  scale = 6.0 / R
  for group, name in (("attn", "q"), ("mlp", "up")):
    node = params["model"]["layers"][group][name]
    out = merged["model"]["layers"][group][name]
    assert set(out) == set(node) - {"lora_a", "lora_b"}
    np.testing.assert_allclose(out["kernel"], _merged_numpy(node, scale, transposed), rtol=1e-5,
                               atol=1e-5)
  # leaves without adapters are unchanged
  np.testing.assert_array_equal(merged["model"]["layers"]["attn"]["v"]["kernel"],
                                params["model"]["layers"]["attn"]["v"]["kernel"])
  np.testing.assert_array_equal(merged["model"]["layers"]["mlp"]["up"]["bias"],
                                params["model"]["layers"]["mlp"]["up"]["bias"])
  np.testing.assert_array_equal(merged["model"]["embed"]["embedding"],
                                params["model"]["embed"]["embedding"])


def test_merge_of_a_bfloat16_kernel_stays_bfloat16_and_adds_the_product():
  rng = np.random.default_rng(1)
  params = _params(rng)
  q = params["model"]["layers"]["attn"]["q"]
  q["kernel"] = jnp.asarray(q["kernel"], jnp.bfloat16)
  merged = lora.merge(params, _cfg())["model"]["layers"]["attn"]["q"]["kernel"]
  assert merged.dtype == jnp.bfloat16
  expected = _merged_numpy(dict(q, kernel=np.asarray(q["kernel"], np.float32)), 6.0 / R, False)
  np.testing.assert_allclose(np.asarray(merged, np.float32), expected, rtol=8e-3, atol=1e-2)


def test_init_adapters_give_bounded_a_and_zero_b_on_the_targeted_kernels_only():
  base, _ = lora.split(_params(np.random.default_rng(2)))
  adapters = lora.init_adapters(base, _cfg(), jax.random.PRNGKey(0))
  layers = adapters["model"]["layers"]
  assert set(adapters["model"]) == {"layers"}
  assert set(layers["attn"]) == {"q"} and set(layers["mlp"]) == {"up"}
  for node in (layers["attn"]["q"], layers["mlp"]["up"]):
    assert set(node) == {"lora_a", "lora_b"}
    a, b = np.asarray(node["lora_a"]), np.asarray(node["lora_b"])
    assert a.shape == (L, D_IN, R) and b.shape == (L, R, D_OUT)
    assert a.dtype == np.float32 and b.dtype == np.float32
    assert np.all(b == 0.0)
    assert 0 < np.abs(a).max() <= 1 / np.sqrt(D_IN)
  # each kernel's A from its own key
  assert not np.allclose(layers["attn"]["q"]["lora_a"], layers["mlp"]["up"]["lora_a"])
  assert lora.count(adapters) == 2 * L * (D_IN * R + R * D_OUT)


def test_init_adapters_on_an_unstacked_kernel_and_the_refusals():
  base = {"q": {"kernel": np.zeros((D_IN, D_OUT), np.float32)},
          "kernel": np.zeros((D_IN, D_OUT), np.float32)}  # a top-level kernel: no layer name
  adapters = lora.init_adapters(base, _cfg(lora_targets=("q",)), jax.random.PRNGKey(1))
  assert set(adapters) == {"q"}
  assert adapters["q"]["lora_a"].shape == (D_IN, R) and adapters["q"]["lora_b"].shape == (R, D_OUT)
  with pytest.raises(ValueError, match="no kernel of the model matches"):
    lora.init_adapters(base, _cfg(lora_targets=("down",)), jax.random.PRNGKey(1))
  with pytest.raises(ValueError, match="checkpoint layout"):
    lora.init_adapters(base, _cfg(transposed_kernels=True), jax.random.PRNGKey(1))


def test_split_puts_every_adapter_leaf_apart_and_drops_emptied_subtrees():
  params = {"a": {"lora_a": 1.0, "lora_b": 2.0}, "b": {"kernel": 3.0, "lora_a": 4.0},
            "c": {"d": {"kernel": 5.0}}, "e": 6.0}
  base, adapters = lora.split(params)
  assert base == {"b": {"kernel": 3.0}, "c": {"d": {"kernel": 5.0}}, "e": 6.0}
  assert adapters == {"a": {"lora_a": 1.0, "lora_b": 2.0}, "b": {"lora_a": 4.0}}
  assert lora.combine(base, adapters) == params
  assert lora.combine(base, {}) == base


def test_peft_state_dict_names_each_layer_and_transposes_a_and_b():
  rng = np.random.default_rng(3)
  params = _params(rng)
  _, adapters = lora.split(params)
  sd = lora.peft_state_dict(adapters, _cfg())
  layers = params["model"]["layers"]
  expected = {}
  for i in range(L):
    for hf_group, group, name, hf_name in (("self_attn", "attn", "q", "q_proj"),
                                           ("mlp", "mlp", "up", "up_proj")):
      stem = f"base_model.model.model.layers.{i}.{hf_group}.{hf_name}"
      a, b = layers[group][name]["lora_a"][i], layers[group][name]["lora_b"][i]
      expected[stem + ".lora_A.weight"] = np.array([[a[k, j] for k in range(D_IN)]
                                                    for j in range(R)])  # [r, in]
      expected[stem + ".lora_B.weight"] = np.array([[b[k, j] for k in range(R)]
                                                    for j in range(D_OUT)])  # [out, r]
  assert sorted(sd) == sorted(expected)
  for key, value in expected.items():
    np.testing.assert_array_equal(sd[key], value, err_msg=key)


def test_peft_config_names_peft_targets_rank_and_alpha():
  config = lora.peft_config(_cfg(), "base/model", dropout=0.1)
  assert config["r"] == R and config["lora_alpha"] == 6.0 and config["lora_dropout"] == 0.1
  assert config["target_modules"] == ["q_proj", "up_proj"]
  assert config["base_model_name_or_path"] == "base/model"
  assert config["fan_in_fan_out"] is False and config["use_rslora"] is False
  assert config["use_dora"] is False and config["inference_mode"] is True


def test_targets_expand_all_linear_strip_proj_and_drop_repeats():
  assert lora.targets(" q , k_proj,q,q_proj ") == ("q", "k")
  assert lora.targets("all-linear,q") == lora.ALL_LINEAR
  assert lora.targets(["fc", "proj"]) == ("fc", "proj")


def test_adapted_config_takes_rank_1_and_base_config_removes_the_adapters():
  cfg = lora.adapted_config(_cfg(lora_rank=0, lora_targets=()), 1, 2, "q", dropout=0.25)
  assert (cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets, cfg.lora_dropout) == (1, 2.0, ("q",),
                                                                                0.25)
  base = lora.base_config(cfg)
  assert (base.lora_rank, base.lora_targets, base.lora_dropout) == (0, (), 0.0)


class _Module:
  def __init__(self, cfg):
    self.cfg = cfg


def test_dropout_rngs_only_with_a_key_and_a_dropout_and_one_stream_each():
  key = jax.random.PRNGKey(7)
  dropping = _Module(_cfg(lora_dropout=0.1))
  assert lora.dropout_rngs(dropping, None, 0) is None
  assert lora.dropout_rngs(_Module(_cfg()), key, 0) is None
  policy, critic = (lora.dropout_rngs(dropping, key, s)["dropout"] for s in (0, 1))
  assert not np.array_equal(policy, critic)
  assert not np.array_equal(policy, key)
  keys = lora.dropout_keys(key, 3)
  assert keys.shape[0] == 3
  assert len({tuple(np.asarray(k).ravel()) for k in keys}) == 3


def test_save_peft_creates_nested_directories_overwrites_and_reads_back(tmp_path):
  from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel
  _, adapters = lora.split(_params(np.random.default_rng(4)))
  directory = tmp_path / "new" / "nested"
  for _ in range(2):  # a second save into the same directory replaces the first
    out = lora.save_peft(directory, adapters, _cfg(), base_model="base/model", dropout=0.05)
  assert out == directory
  assert sorted(p.name for p in directory.iterdir()) == ["adapter_config.json",
                                                         "adapter_model.safetensors"]
  config = json.loads((directory / "adapter_config.json").read_text())
  assert config["r"] == R and config["lora_dropout"] == 0.05
  assert config["target_modules"] == ["q_proj", "up_proj"]
  sd = load_file(str(directory / "adapter_model.safetensors"))
  a = np.asarray(adapters["model"]["layers"]["attn"]["q"]["lora_a"])
  for i in range(L):
    np.testing.assert_array_equal(
        sd[f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight"],
        np.array([[a[i, k, j] for k in range(D_IN)] for j in range(R)]))
