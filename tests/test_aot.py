"""Deviceless compiles of the PPO step for TPU topologies (``ppojax.run.aot``), the abstract build
they rest on, the public model shapes, the activation-row constraint and the FLOP count."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppojax.infra import flops
from ppojax.infra.sharding import shard_rows
from ppojax.models import abstract_model, model_config, public
from ppojax.run import aot
from ppojax.run import build as build_lib

ROOT = pathlib.Path(__file__).parents[1]
SCALE = str(ROOT / "configs" / "scale.py")


# The deviceless compiles run in a child process, so that libtpu (its runtime and thread pools)
# never lives in a test worker that goes on to compute on the CPU.
DEVICELESS = """
import json, sys
from ppojax.run import aot
from ppojax.run import build as build_lib
try:
  devices = aot.topology_devices("v5e:2x2")
except aot.AotError as e:
  print(json.dumps({"skip": str(e)}))
  sys.exit(0)
out = {}
for name, overrides in json.loads(sys.argv[1]).items():
  config = build_lib.load_config(sys.argv[2] + ":tiny", **overrides)
  result = aot.compile_step(config, devices)
  mem = result.compiled.memory_analysis()
  out[name] = dict(
      report=aot.report(config, "v5e:2x2", result), iteration_flops=aot.iteration_flops(result.run),
      critic=result.run.state.critic is not None,
      memory=[mem.argument_size_in_bytes, mem.output_size_in_bytes, mem.temp_size_in_bytes,
              mem.alias_size_in_bytes])
print(json.dumps(out))
"""


def _compile_deviceless(**configs) -> dict:
  """``configs/scale.py:tiny`` with each set of overrides, compiled for v5e 2x2 in a child
  process: its report, model FLOPs, whether a critic exists and ``memory_analysis()``."""
  done = subprocess.run([sys.executable, "-c", DEVICELESS, json.dumps(configs), SCALE],
                        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert done.returncode == 0, done.stderr[-3000:]
  out = json.loads(done.stdout.strip().splitlines()[-1])
  if "skip" in out:
    pytest.skip(f"no TPU compiler here: {out['skip']}")
  return out


@pytest.mark.parametrize("name, billions", [
    ("Qwen/Qwen2.5-0.5B-Instruct", 0.494), ("Qwen/Qwen2.5-1.5B-Instruct", 1.544),
    ("Qwen/Qwen2.5-7B-Instruct", 7.616), ("meta-llama/Llama-3.2-1B-Instruct", 1.236),
    ("meta-llama/Llama-3.2-3B-Instruct", 3.213), ("meta-llama/Llama-3.1-8B-Instruct", 8.030),
])
def test_public_shapes_give_the_published_parameter_counts(name, billions):
  model = abstract_model(model_config(name))
  count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(model.params))
  assert count / 1e9 == pytest.approx(billions, abs=0.001)
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(model.params))
  assert public.lookup(name.lower().removesuffix("-instruct")) == public.CONFIGS[name]


def test_abstract_build_matches_the_real_one():
  """Same state tree, shapes, dtypes and shardings as a run's; no weights, no data."""
  config = build_lib.load_config(SCALE + ":tiny")
  real = build_lib.build(build_lib.load_config(SCALE + ":tiny", data__task="count"))
  fake = build_lib.build(config, abstract=True)
  assert fake.source is None
  shapes = lambda t: jax.tree.map(lambda x: (x.shape, str(x.dtype), x.sharding.spec), t)  # noqa
  assert shapes(fake.state) == shapes(real.state)
  assert shapes(fake.frozen) == shapes(real.frozen)


def test_shard_rows_constrains_only_under_a_mesh_that_divides_the_rows():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1),
                           ("data", "fsdp", "tensor"))
  x = jnp.ones((4, 3))
  assert "sharding_constraint" not in str(jax.make_jaxpr(shard_rows)(x))
  abstract = jax.sharding.AbstractMesh((2, 2, 1), ("data", "fsdp", "tensor"))
  with jax.sharding.use_abstract_mesh(abstract):
    assert "sharding_constraint" in str(jax.make_jaxpr(shard_rows)(x))
    assert "sharding_constraint" not in str(jax.make_jaxpr(shard_rows)(jnp.ones((3, 3))))
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # one device: nothing to split
    assert "sharding_constraint" not in str(jax.make_jaxpr(shard_rows)(x))


GRPO_OVERRIDES = {"algorithm": "grpo", "rl__batch_size": 4, "sampling__num_samples_per_prompt": 4}
LORA_OVERRIDES = {"lora__rank": 4, "lora__critic": True, "model__critic_init": "policy"}


@pytest.fixture(scope="module")
def deviceless():
  """The three programs the tests below read, compiled in one child process (one libtpu start):
  PPO with its critic initialised from the policy (the config's default, from the reward
  model, compiles in test_cli_prints_a_table_...), GRPO on the same rows, and LoRA PPO."""
  return _compile_deviceless(ppo={"model__critic_init": "policy"}, grpo=GRPO_OVERRIDES,
                             lora=LORA_OVERRIDES)


def test_tiny_step_compiles_for_a_tpu_topology_and_shards_its_parameters(deviceless):
  out = deviceless["ppo"]
  r, (arguments, outputs, temporaries, aliased) = out["report"], out["memory"]
  assert r["devices"] == 4 and r["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}
  assert r["per_device_bytes"] == arguments + outputs + temporaries - aliased
  assert r["fits"] is (r["per_device_bytes"] <= r["hbm_bytes_per_device"]) is True
  assert r["hbm_bytes_per_device"] == 15.75 * 2**30
  # the parameters are split four ways, not replicated (a few replicated norms and biases)
  assert 1.0 <= r["param_shard_ratio"] < 1.1, r
  assert r["param_bytes_per_device"] < r["param_bytes_total"] / 3
  assert r["flops_per_iteration"] == out["iteration_flops"] > 0


def test_critic_free_step_compiles_deviceless_without_critic_memory_or_flops(deviceless):
  """GRPO on the same rows (4 prompts × 4 samples = 16): no critic or critic optimizer state
  among the arguments, no critic FLOPs, the prefill over 4 prompts."""
  out = deviceless
  ppo, grpo = out["ppo"]["report"], out["grpo"]["report"]
  assert out["ppo"]["critic"] and not out["grpo"]["critic"] and grpo["fits"] is True
  assert grpo["argument_bytes"] < 0.75 * ppo["argument_bytes"]
  assert grpo["flops_per_iteration"] < 0.8 * ppo["flops_per_iteration"]
  cfg = build_lib.build(build_lib.load_config(SCALE + ":tiny", **GRPO_OVERRIDES),
                     abstract=True).policy.cfg
  per_prompt = flops.model_flops(cfg, 4, 32, 16, samples=4)["generation (prefill)"]
  assert per_prompt == pytest.approx(flops.model_flops(cfg, 16, 32, 16)["generation (prefill)"] / 4)


def test_cli_prints_a_table_and_a_json_line_and_names_bad_topologies():
  if importlib.util.find_spec("libtpu") is None:  # found, not loaded: see DEVICELESS
    pytest.skip("no TPU compiler here: libtpu is not installed (pip install -e '.[tpu]')")
  command = [sys.executable, "-m", "ppojax.aot", f"--config={SCALE}:tiny", "--topology"]
  ok = subprocess.run(command + ["v5e:2x2"], capture_output=True, text=True, timeout=600,
                      cwd=ROOT)
  assert ok.returncode == 0, ok.stderr[-3000:]
  last = json.loads(ok.stdout.strip().splitlines()[-1])
  assert last["topology"] == "v5e:2x2" and last["fits"] is True and "per device" in ok.stdout
  # libtpu's complaints that this machine is no TPU host (ppojax.aot tells it a host of its own)
  assert "could not determine TPU" not in ok.stderr, ok.stderr[-2000:]
  assert "unexpected worker hostname" not in ok.stderr, ok.stderr[-2000:]
  bad = subprocess.run(command + ["v9x:3x3"], capture_output=True, text=True, timeout=600,
                       cwd=ROOT)
  assert bad.returncode == 2 and "could not describe the TPU topology 'v9x:3x3'" in bad.stderr


def test_a_python_reward_has_no_fused_step_to_compile():
  config = build_lib.load_config(SCALE + ":tiny", reward__kind="text")
  with pytest.raises(aot.AotError, match="reward.kind='text' runs on the host"):
    aot.compile_step(config, jax.devices())


def test_both_out_of_memory_messages_parse():
  """XLA:TPU stops a compile that does not fit with one of two messages; the report takes the
  temporaries and the HBM from either, and nothing from another error."""
  from ppojax.run import aot  # pylint: disable=import-outside-toplevel
  g = 2**30
  temps = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
           "temporaries (18.04G) exceeds available HBM (15.75G).")
  assert aot.parse_out_of_memory(temps) == (int(18.04 * g), int(15.75 * g), None)
  used = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: XLA:TPU compile permanent error. Ran "
          "out of memory in memory space hbm. Used 15.84G of 15.75G hbm. Exceeded hbm capacity "
          "by 91.46M.\n\nTotal hbm usage >= 16.09G:\n    reserved        258.00M \n    program"
          "           5.36G \n    arguments        10.48G \n\nProgram hbm requirement 5.36G:\n"
          "    global            4.66M\n    HLO temp          5.26G (100.0% utilization)")
  assert aot.parse_out_of_memory(used) == (int(5.26 * g), int(15.75 * g), int(15.84 * g))
  assert aot.parse_out_of_memory("INVALID_ARGUMENT: something else") is None


def test_a_refused_compile_never_fits():
  """When XLA:TPU refuses the program, the report says it does not fit, whatever the estimate
  from the shapes says, and takes the compiler's own total where its message names one."""
  config = build_lib.load_config(SCALE + ":tiny")
  run = build_lib.build(config, devices=jax.devices()[:1], abstract=True)
  g = 2**30
  for oom, per_device in ((aot.OutOfMemory(1, 16 * g, 16 * g + 1), 16 * g + 1),
                          (aot.OutOfMemory(1, 16 * g), None)):
    r = aot.report(config, "v5e:2x4", aot.Compiled(None, run, 1.0, oom))
    assert r["compiler_out_of_memory"] and r["fits"] is False  # the estimate alone would fit
    assert r["per_device_bytes"] == (per_device or r["argument_bytes"] + 1)


def test_lora_step_compiles_deviceless_with_one_base_and_counts_it(deviceless):
  """LoRA on policy and critic: the report counts the frozen base among the parameters (and
  the adapters as the trained ones), and the arguments hold less than full PPO's."""
  full, r = deviceless["ppo"]["report"], deviceless["lora"]["report"]
  # the policy's parameters: the base's (full fine-tuning's) and the adapters'
  assert r["params"] == full["params"] + r["trained_params"]
  assert 0 < r["trained_params"] < r["params"] / 10
  assert full["trained_params"] == full["params"]
  # one base (float32) instead of policy, critic and their Adam moments
  assert r["argument_bytes"] < 0.6 * full["argument_bytes"]
  assert r["param_bytes_total"] > 0.3 * full["param_bytes_total"]  # the base is counted
