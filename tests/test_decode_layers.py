"""The decode's layer layout (``SamplingConfig.layers``): a scanned decode (one layer body in a
``lax.scan`` over stacked weights and a stacked KV cache) gives the unrolled decode's tokens
exactly and its log-probs within float32 rounding — greedy and sampled, with a shared prefix,
with several samples per prompt, with LoRA adapters — and compiles one layer body; "auto"
unrolls for the CPU and scans for TPU shardings, a deviceless compile's included.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppojax.models import CausalLM, LoadedModel, ModelConfig, init_params, lora
from ppojax.models.layout import unstack_layers
from ppojax.rollout import sampling
from ppojax.rollout.sampling import SamplingConfig, generate, split_shared_prefix
from ppojax.run import build as build_lib
from ppojax.run import checks
from ppojax.run.config import defaults

# |log-prob(scan) − log-prob(unroll)| at most this: the two layouts run the same float32
# arithmetic, fused differently by XLA (observed differences: below 1e-6)
LOGP_ATOL = 1e-5

TINY = ModelConfig(model_type="llama", vocab_size=48, hidden_size=32, intermediate_size=64,
                   num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
                   max_position_embeddings=64, norm_eps=1e-5, tie_word_embeddings=False)
ROWS, PROMPT, NEW, STOP = 6, 9, 10, 1


def _params(cfg: ModelConfig = TINY, seed: int = 0):
  """Random params whose next-token distributions are far from uniform (a scaled-up LM head),
  so that sampled tokens depend on the logits and not only on the noise."""
  params = init_params(CausalLM(cfg), jax.random.key(seed))
  head = params["lm_head"]["kernel"]
  return {**params, "lm_head": {"kernel": head * 20.0}}


def _prompts(shared: int = 0, seed: int = 0):
  """Left-padded prompts [ROWS, PROMPT] (lengths 4 … PROMPT), the first ``shared`` real tokens
  of every row the same."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(2, TINY.vocab_size, (ROWS, PROMPT)).astype(np.int32)
  lengths = np.linspace(4, PROMPT, ROWS).astype(int)
  mask = np.arange(PROMPT)[None, :] >= (PROMPT - lengths)[:, None]
  for row, length in enumerate(lengths):
    tokens[row, PROMPT - length:PROMPT - length + shared] = np.arange(shared) + 2
  return np.where(mask, tokens, 0), mask


def _both(module, params, tokens, mask, config: SamplingConfig, prefix=None, seed: int = 3):
  """The generations of the scanned and the unrolled decode (host arrays)."""
  out = {}
  for layers in ("scan", "unroll"):
    cfg = SamplingConfig(**{**config.__dict__, "layers": layers})
    out[layers] = jax.device_get(generate(
        module, params, jnp.asarray(tokens), jnp.asarray(mask), jax.random.key(seed), cfg,
        prefix=None if prefix is None else jnp.asarray(prefix)))
  return out["scan"], out["unroll"]


def _assert_same(scan, unroll):
  np.testing.assert_array_equal(scan.tokens, unroll.tokens)
  np.testing.assert_array_equal(scan.mask, unroll.mask)
  np.testing.assert_allclose(scan.logprobs, unroll.logprobs, rtol=0, atol=LOGP_ATOL)
  np.testing.assert_allclose(scan.sampling_logprobs, unroll.sampling_logprobs, rtol=0,
                             atol=LOGP_ATOL)
  assert scan.lengths.min() >= 2  # a non-trivial comparison: every row decoded some steps
  assert (scan.logprobs[scan.mask] < 0).all()


CASES = {
    "greedy": dict(greedy=True),
    "sampled": dict(temperature=0.9, top_k=12, top_p=0.95),
    "n_samples": dict(temperature=1.1, num_samples_per_prompt=3),
    "n_greedy_min_new": dict(greedy=True, num_samples_per_prompt=2, min_new_tokens=3),
}


@pytest.mark.parametrize("case,shared", [("greedy", 0), ("sampled", 0), ("n_samples", 0),
                                         ("greedy", 3), ("sampled", 3), ("n_samples", 3),
                                         ("n_greedy_min_new", 3)])
def test_scan_and_unroll_give_the_same_generation(case, shared):
  params = _params()
  tokens, mask = _prompts(shared)
  config = SamplingConfig(NEW, stop_ids=(STOP,), pad_id=0, **CASES[case])
  prefix = None
  if shared:
    prefix, tokens, mask = split_shared_prefix(tokens, mask)
    assert prefix.shape == (shared,)
  scan, unroll = _both(CausalLM(TINY), params, tokens, mask, config, prefix)
  _assert_same(scan, unroll)
  assert scan.tokens.shape == (ROWS * config.num_samples_per_prompt, NEW)
  if config.num_samples_per_prompt > 1 and not config.greedy:  # a group's samples differ
    groups = scan.tokens.reshape(ROWS, config.num_samples_per_prompt, NEW)
    assert (groups != groups[:, :1]).any(axis=(1, 2)).all()


def test_scan_and_unroll_agree_from_either_stored_layout():
  """Params stored unrolled (scan_layers=False) decode like the stacked ones, in both layouts."""
  params = _params()
  tokens, mask = _prompts()
  config = SamplingConfig(NEW, stop_ids=(STOP,), pad_id=0, temperature=0.8)
  stacked = _both(CausalLM(TINY), params, tokens, mask, config)
  unrolled = _both(CausalLM(TINY.replace(scan_layers=False)), unstack_layers(params), tokens,
                   mask, config)
  for a, b in zip(stacked, unrolled):
    _assert_same(a, b)


def test_scan_and_unroll_agree_with_lora_adapters_and_sample_the_adapted_model():
  """A LoRA model (adapters with B ≠ 0) decodes alike in both layouts, as its merged weights
  W + (α/r)·A·B do on the base model — and not as the base model alone does."""
  cfg = lora.adapted_config(TINY, rank=4, alpha=8.0, names=("q", "v", "down"))
  base = _params()
  adapters = lora.init_adapters(base, cfg, jax.random.key(7))
  adapters = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(jax.random.key(8), x.shape),
                          adapters)  # B = 0 at init: give them an effect
  params = lora.combine(base, adapters)
  tokens, mask = _prompts(seed=1)
  config = SamplingConfig(NEW, stop_ids=(STOP,), pad_id=0, temperature=0.9,
                          num_samples_per_prompt=2)
  scan, unroll = _both(CausalLM(cfg), params, tokens, mask, config)
  _assert_same(scan, unroll)
  merged = _both(CausalLM(TINY), lora.merge(params, cfg), tokens, mask, config)
  for ours, theirs in zip((scan, unroll), merged):
    _assert_same(ours, theirs)
  plain = _both(CausalLM(TINY), base, tokens, mask, config)[0]
  assert not np.array_equal(plain.tokens, scan.tokens)


def _dot_count(layers: str, num_layers: int) -> int:
  """The matmuls in the lowered ``generate`` of a ``num_layers``-layer model."""
  cfg = TINY.replace(num_layers=num_layers)
  params = jax.eval_shape(lambda: init_params(CausalLM(cfg), jax.random.key(0)))
  tokens = jax.ShapeDtypeStruct((2, 5), jnp.int32)
  config = SamplingConfig(4, stop_ids=(STOP,), pad_id=0, greedy=True, layers=layers)
  text = generate.lower(CausalLM(cfg), params, tokens, jax.ShapeDtypeStruct((2, 5), jnp.bool_),
                        jax.random.key(0), config).as_text()
  return text.count("dot_general")


def test_the_scanned_decode_holds_one_layer_body():
  """Scanned, the program's size does not grow with the depth; unrolled it does."""
  assert _dot_count("scan", 2) == _dot_count("scan", 5)
  assert _dot_count("unroll", 5) > _dot_count("unroll", 2)


def test_decode_layout_follows_the_choice():
  params = _params()
  for layers, scan in (("scan", True), ("unroll", False), ("auto", False)):  # auto: CPU here
    module, converted = sampling.decode_layout(CausalLM(TINY), params, layers)
    assert module.cfg.scan_layers is scan and module.cfg.fused_projections
    assert ("layers" in converted["model"]) is scan
    assert ("layers_0" in converted["model"]) is not scan


def test_auto_resolves_from_the_params_platform_on_cpu():
  params = _params()
  assert sampling.compile_platform(params) == "cpu"
  assert sampling.decode_layers("auto", params) == "unroll"
  assert sampling.decode_layers("scan", params) == "scan"
  assert sampling.decode_layers("unroll", params) == "unroll"
  abstract = jax.eval_shape(lambda: params)  # no sharding: the default backend's
  assert sampling.decode_layers("auto", abstract) == "unroll"
  seen = []
  jax.jit(lambda p: seen.append(sampling.decode_layers("auto", p)) or 0)(params)  # traced
  assert seen == ["unroll"]
  with pytest.raises(ValueError, match="layers must be one of"):
    sampling.decode_layers("stacked", params)
  with pytest.raises(ValueError, match="layers must be one of"):
    SamplingConfig(4, stop_ids=(1,), pad_id=0, layers="stacked")


def test_auto_unrolls_for_a_gpu(monkeypatch):
  """On a GPU, scanned layers copy each layer's weights out of the stacked arrays on every token
  (benchmarks/decode_hlo.py --target gpu): "auto" unrolls there as on a CPU."""
  monkeypatch.setattr(sampling, "compile_platform", lambda params=None: "gpu")
  assert sampling.decode_layers("auto", _params()) == "unroll"
  assert sampling.decode_layers("scan", _params()) == "scan"


# In a child process, so that libtpu never lives in a test worker (as tests/test_aot.py does).
TPU_RESOLVE = """
import json
import jax, jax.numpy as jnp, numpy as np
from ppojax.rollout import sampling
from ppojax.run import aot
try:
  devices = aot.topology_devices("v5e:2x2")
except aot.AotError as e:
  print(json.dumps({"skip": str(e)}))
  raise SystemExit(0)
mesh = jax.sharding.Mesh(np.array(devices).reshape(4, 1, 1), ("data", "fsdp", "tensor"))
spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
params = {"w": jax.ShapeDtypeStruct((4, 4), jnp.float32, sharding=spec)}
out = {"abstract": sampling.decode_layers("auto", params)}
def traced(p):
  out["traced"] = sampling.decode_layers("auto", p)
  return p["w"] * 2
jax.jit(traced).lower(params)
def under_mesh(w):
  out["under_mesh"] = sampling.decode_layers("auto", {"w": w})
  return w
with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
  jax.jit(under_mesh).lower(jax.ShapeDtypeStruct((4, 4), jnp.float32))
out["backend"] = jax.default_backend()
print(json.dumps(out))
"""


def test_auto_scans_for_tpu_shardings_compiled_on_a_cpu_host():
  """A deviceless TPU compile traces on the CPU host: "auto" follows the TPU devices of the
  params' shardings (abstract and traced) or of the abstract mesh traced under."""
  done = subprocess.run([sys.executable, "-c", TPU_RESOLVE], capture_output=True, text=True,
                        timeout=300, check=False,
                        env=dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1"))
  assert done.returncode == 0, done.stderr[-3000:]
  out = json.loads(done.stdout.strip().splitlines()[-1])
  if "skip" in out:
    pytest.skip(f"no TPU compiler here: {out['skip']}")
  assert out == {"abstract": "scan", "traced": "scan", "under_mesh": "scan", "backend": "cpu"}


def test_the_config_option_reaches_the_sampling_config():
  config = defaults()
  assert config.sampling.decode_layers == "auto"
  config.sampling.decode_layers = "scan"
  policy = LoadedModel(TINY.replace(eos_token_id=STOP), None, None, "lm")
  assert build_lib.sampling_config(config, policy).layers == "scan"
  config.sampling.decode_layers = "stacked"
  with pytest.raises(checks.ConfigError, match="sampling.decode_layers"):
    checks.check_choices(config)
