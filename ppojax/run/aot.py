"""Compile the PPO step for a TPU topology that is not here, and say whether it fits.

    python -m ppojax.run.aot --config configs/scale.py:qwen2_5_0_5b --topology v5e:2x4 \\
        [--config.section.field=value ...]

The step is the one a training run compiles: ``build_lib.build(config, devices=...,
abstract=True)`` builds a run's models, optimizers, partition rules and ``make_step``, with
parameters and optimizer states as ``jax.ShapeDtypeStruct``s (no weights read) on a mesh over
the topology's devices (``jax.experimental.topologies``; needs ``pip install -e ".[tpu]"``). The
fused iteration is compiled for them here; ``memory_analysis()`` gives each device's bytes:

    per device = arguments + outputs + temporaries − aliased (outputs written over donated inputs)

``fits`` compares that with the chip's HBM per device (``HBM_GIB``). The last line: one JSON object.
"""

from __future__ import annotations

import os

# Deviceless, where unset: JAX's own backend stays the CPU (an installed libtpu would probe for a
# TPU on import); several processes may load libtpu at once (its lock file); libtpu is told a TPU
# host of its own (else it warns and logs "unexpected worker hostname"; the program is the same).
DEVICELESS_ENV = {"JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
                  "TPU_ACCELERATOR_TYPE": "v5litepod-4", "TPU_WORKER_HOSTNAMES": "localhost"}
for _name, _value in DEVICELESS_ENV.items():
  os.environ.setdefault(_name, _value)

import math  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
from typing import Any, NamedTuple  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from ppojax.core import selection  # noqa: E402
from ppojax.data import encoding  # noqa: E402
from ppojax.data.batch import Prompts  # noqa: E402
from ppojax.infra import flops
from ppojax.infra import sharding as sharding_lib  # noqa: E402
from ppojax.learner import update as update_lib
from ppojax.run import build as build_lib
from ppojax.run import checks as checks_lib
from ppojax.run import models as models_lib
from ppojax.tasks import sources

TPU_INSTALL = 'pip install -e ".[tpu]"  (jax[tpu]: the libtpu that matches the installed jax)'

# Per chip: HBM in GiB and peak dense bfloat16 TFLOP/s (Google Cloud TPU documentation); a chip
# whose cores are separate JAX devices (v4) splits both. v5e: the 15.75 GiB XLA:TPU reports.
CHIPS = {
    "TPU v4": (32, 275.0),
    "TPU v5 lite": (15.75, 197.0),  # v5e
    "TPU v5": (95, 459.0),  # v5p
    "TPU v6 lite": (32, 918.0),  # v6e (Trillium)
}


class AotError(RuntimeError):
  """The topology cannot be had here (unknown name, no libtpu) or the config has no fused step."""


def topology_devices(name: str) -> list:
  """The devices of a TPU topology such as "v5e:2x4", without the TPUs (libtpu compiles)."""
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  try:
    import libtpu  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  except ImportError as e:
    raise AotError(f"compiling for TPU topology {name!r} needs libtpu, which is not installed: "
                   f"{TPU_INSTALL}") from e
  # a single chip is smaller than libtpu's default host (2x2): say the host is one chip
  one_chip = {"chips_per_host_bounds": [1, 1, 1]} if name.endswith(":1x1") else {}
  try:
    return list(topologies.get_topology_desc(platform="tpu", topology_name=name,
                                             **one_chip).devices)
  except Exception as e:  # libtpu raises plain RuntimeErrors / XlaRuntimeErrors
    raise AotError(f"libtpu could not describe the TPU topology {name!r} ({type(e).__name__}: "
                   f"{str(e).splitlines()[0] if str(e) else ''}); topology names look like "
                   "v5e:2x2, v5e:2x4, v5e:4x4, v4:2x2x2, v5p:2x2x1, v5p:2x2x2, v6e:2x4") from e


def chip_of(devices) -> dict[str, Any]:
  """HBM bytes and peak bf16 FLOP/s per device, from the device kind and the cores per chip."""
  kind = devices[0].device_kind
  cores = len({getattr(d, "core_on_chip", 0) for d in devices})
  if kind not in CHIPS:
    return {"kind": kind, "cores_per_chip": cores, "hbm_bytes": None, "peak_flops": None}
  hbm_gib, tflops = CHIPS[kind]
  return {"kind": kind, "cores_per_chip": cores, "hbm_bytes": int(hbm_gib * 2**30 / cores),
          "peak_flops": tflops * 1e12 / cores}


class Compiled(NamedTuple):
  compiled: Any  # jax.stages.Compiled, or None when the compiler ran out of HBM
  run: build_lib.Run
  seconds: float
  # when out of HBM: what the compiler's message named (``OutOfMemory``)
  out_of_memory: OutOfMemory | None = None
  prefix_len: int = 0  # the shared prefix compiled with (``abstract_prompts``)
  # where that length came from: "training run" (``training_prefix_len``), "given", or
  # "unknown" (a training run's prefix only its tokenizer, not here, can measure: 0 used)
  prefix_from: str = "given"


class OutOfMemory(NamedTuple):
  """What XLA:TPU's out-of-memory error names, in bytes: the program's temporaries, the
  device's HBM, and (second message only) the total it would have used."""

  temp: int
  hbm: int
  used: int | None = None


# XLA:TPU's two out-of-memory messages: temporaries and HBM from either, the total from one
_OOM_TEMPS = re.compile(r"HLO temporaries \(([\d.]+)([KMGT])\) exceeds available HBM "
                        r"\(([\d.]+)([KMGT])\)")
_OOM_USED = re.compile(r"Used ([\d.]+)([KMGT]) of ([\d.]+)([KMGT]) hbm")
_OOM_TEMP = re.compile(r"HLO temp\s+([\d.]+)([KMGT])")


def parse_out_of_memory(message: str) -> OutOfMemory | None:
  """What XLA:TPU's out-of-memory error names (``OutOfMemory``), or None if it is not one:
  "... HLO temporaries (18.04G) exceeds available HBM (15.75G)" (temporaries alone too big) or
  "Ran out of memory in memory space hbm. Used 15.84G of 15.75G hbm. ... HLO temp 5.26G ..."
  (arguments and program together)."""
  found = _OOM_TEMPS.search(message)
  if found:
    return OutOfMemory(_bytes(*found.group(1, 2)), _bytes(*found.group(3, 4)))
  used, temp = _OOM_USED.search(message), _OOM_TEMP.search(message)
  if used and temp:
    return OutOfMemory(_bytes(*temp.group(1, 2)), _bytes(*used.group(3, 4)),
                       _bytes(*used.group(1, 2)))
  return None


def _bytes(number: str, unit: str) -> int:
  return int(float(number) * 1024 ** "KMGT".index(unit) * 1024)


def abstract_prompts(config, mesh, prefix_len: int = 0) -> Prompts:
  """The shapes of a batch of prompts, [B, P], placed over the mesh's batch axes, and with
  ``prefix_len`` > 0 the [C] ids of the prefix they share (``Prompts.prefix``), replicated."""
  b, p = sources.prompts_per_batch(config), checks_lib.prompt_length(config)
  rows = sharding_lib.batch_sharding(mesh)
  prefix = None
  if prefix_len:
    if not 0 < prefix_len < p:
      raise AotError(f"prefix_len={prefix_len}: a shared prefix is 1 to {p - 1} tokens long "
                     f"(prompts of {p} tokens keep at least one of their own)")
    prefix = jax.ShapeDtypeStruct((prefix_len,), jnp.int32,
                                  sharding=jax.sharding.NamedSharding(mesh, P()))
  return Prompts(jax.ShapeDtypeStruct((b, p), jnp.int32, sharding=rows),
                 jax.ShapeDtypeStruct((b, p), jnp.bool_, sharding=rows), prefix)


def local_tokenizer(config):
  """The tokenizer a training run of ``config`` reads, where it is here: ``model.tokenizer``,
  else ``model.policy`` when that is a local path; None otherwise (a public model name)."""
  name = config.model.tokenizer or config.model.policy
  if not name or not os.path.exists(str(name)):
    return None
  return models_lib.load_tokenizer(name)


def training_prefix_len(config, tokenizer) -> int | None:
  """How many tokens the shared prefix of a training run of ``config`` has (``data.
  shared_prefix``: ``tasks.sources.make_source``): 0 without one, None where only the
  tokenizer, not here, could tell (a public model name: its chat template's header)."""
  d = config.data
  if not d.get("shared_prefix", True):
    return 0
  if d.task == "count":
    return 1  # its BOS
  if tokenizer is None:
    return None
  return len(encoding.template_prefix(tokenizer, system=d.system or None, chat_template=(
      d.chat_template), chat_template_kwargs=d.get("chat_template_kwargs")))


PROGRAMS = ("step", "rollout", "learn")  # the fused iteration, or one of its two halves


def compile_step(config, devices, program: str = "step", prefix_len: int | None = None
                 ) -> Compiled:
  """``program`` of ``config``'s iteration, built abstractly on ``devices`` and compiled: the
  fused "step", or its halves "rollout" (sampling and the rollout's forward passes) and "learn"
  (experience and update), as a run with a host reward compiles them. ``prefix_len``: the
  shared prefix's length; None: a training run's (``training_prefix_len``), 0 where unknown."""
  if program not in PROGRAMS:
    raise AotError(f"program={program!r}: choose one of {', '.join(PROGRAMS)}")
  if config.reward.kind not in ("model", "jax"):
    raise AotError(f"reward.kind={config.reward.kind!r} runs on the host between two compiled "
                   "halves; compile the fused step with reward.kind='model' (a reward model of "
                   "the same shapes) or 'jax'")
  run = build_lib.build(config, devices=devices, abstract=True)
  prefix_from = "given"
  if prefix_len is None:
    known = training_prefix_len(config, local_tokenizer(config))
    prefix_from = "training run" if known is not None else "unknown"
    prefix_len = known or 0
  t0 = time.perf_counter()
  lowered = _lower(run, config, program, prefix_len)
  try:
    compiled = lowered.compile()
  except jax.errors.JaxRuntimeError as e:
    out_of_memory = parse_out_of_memory(str(e))
    if out_of_memory is None:
      raise
    return Compiled(None, run, time.perf_counter() - t0, out_of_memory, prefix_len, prefix_from)
  return Compiled(compiled, run, time.perf_counter() - t0, None, prefix_len, prefix_from)


def _lower(run, config, program: str, prefix_len: int):
  """The lowered ``program``; "learn" takes the rollout's output shapes and shardings."""
  prompts = abstract_prompts(config, run.mesh, prefix_len)
  if program == "step":
    return run.step.fused.lower(run.state, run.frozen, prompts)
  rollout = run.step.rollout.lower(run.state, run.frozen, prompts)
  if program == "rollout":
    return rollout
  r = jax.tree.map(lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=o.sharding),
                   rollout.out_info)
  rows = jax.ShapeDtypeStruct(r.responses.shape[:1], jnp.float32,
                              sharding=sharding_lib.batch_sharding(run.mesh, ndim=1))
  return run.step.learn.lower(run.state, r, rows)


def _param_bytes(trees) -> tuple[int, int, int]:
  """(parameters, bytes in all, bytes on one device) of ShapeDtypeStructs with shardings (the
  partition rules split evenly, so every device holds one shard of each leaf)."""
  leaves = jax.tree.leaves(trees)
  count = sum(math.prod(x.shape) for x in leaves)
  total = sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves)
  device = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in leaves)
  return count, total, device


def iteration_flops(run, prefix_len: int = 0) -> float:
  """Model FLOPs of one iteration (``ppojax.infra.flops``; XLA's ``cost_analysis`` counts a loop's
  body once, so it cannot give them for a scanned, decoding step): the rollout's over the
  prompts sampled (× ``rl.oversample``), the update's over ``rl.batch_size``, rows padded
  (packed rows, ``rl.pack_fractions``, lower the update's share by what the lengths allow)."""
  config = run.config
  one_pass = update_lib.single_pass(config.rl, config.lora.dropout)

  def parts(prompts: int) -> dict[str, float]:
    return flops.model_flops(
        run.policy.cfg, prompts, checks_lib.prompt_length(config),
        config.sampling.max_new_tokens, old_logp_fwd=not one_pass and
        config.rl.old_logprobs == "recompute", critic_fwd=not one_pass,
        epochs=config.rl.num_epochs, samples=config.sampling.num_samples_per_prompt,
        critic=run.models.critic is not None, reference=run.frozen.reference is not None,
        reward_model=run.models.reward is not None, shared=prefix_len)

  sampled = parts(selection.sampled_prompts(config.rl.batch_size, config.rl.oversample))
  learned = parts(config.rl.batch_size)
  return sum(learned[k] if k.endswith("fwd+bwd") else v for k, v in sampled.items())


def report(config, topology: str, result: Compiled) -> dict[str, Any]:
  """The figures of one deviceless compile (the JSON line of the CLI)."""
  run, devices = result.run, list(result.run.mesh.devices.flat)
  chip = chip_of(devices)
  models = (run.state.actor, run.state.critic, run.state.base, run.frozen.reference,
            run.frozen.reward)  # base: LoRA's frozen base (None otherwise)
  _, total_bytes, device_bytes = _param_bytes(models)
  count = lambda tree: int(sum(np.prod(x.shape) for x in jax.tree.leaves(tree)))  # noqa: E731
  trained = count(run.state.actor)  # with LoRA: the adapters
  params = trained + count(run.state.base)  # the policy's own: the frozen base's too
  if result.out_of_memory is None:
    mem = result.compiled.memory_analysis()
    sizes = (mem.argument_size_in_bytes, mem.output_size_in_bytes, mem.temp_size_in_bytes,
             mem.alias_size_in_bytes)
    hbm = chip["hbm_bytes"]
    per_device = sizes[0] + sizes[1] + sizes[2] - sizes[3]
  else:  # the compiler stopped: arguments from the shapes, temporaries from its message
    oom = result.out_of_memory
    hbm = oom.hbm
    sizes = (_param_bytes((run.state, run.frozen))[2], None, oom.temp, None)
    # the compiler's own total where its message names one
    per_device = oom.used if oom.used is not None else sizes[0] + oom.temp
  total_flops = iteration_flops(run, result.prefix_len)
  seconds_40 = None if not chip["peak_flops"] else (
      total_flops / (0.4 * chip["peak_flops"] * len(devices)))
  return {
      "topology": topology, "device_kind": chip["kind"], "devices": len(devices),
      "mesh": dict(run.mesh.shape), "model": str(config.model.policy), "params": params,
      "trained_params": trained,
      "batch": config.rl.batch_size, "prompt_len": checks_lib.prompt_length(config),
      "response_len": config.sampling.max_new_tokens, "dtype": config.model.dtype,
      "remat": bool(config.model.remat), "compile_seconds": round(result.seconds, 1),
      "prefix_len": result.prefix_len, "prefix_from": result.prefix_from,
      "argument_bytes": sizes[0], "output_bytes": sizes[1], "temp_bytes": sizes[2],
      "alias_bytes": sizes[3], "per_device_bytes": per_device, "hbm_bytes_per_device": hbm,
      # a program the compiler refused does not fit, whatever the estimate below says
      "fits": None if hbm is None else (result.out_of_memory is None and per_device <= hbm),
      # out of memory: the compiler stopped; per_device_bytes is then the total it named, or
      # where it named only its temporaries, the state's shards plus those (outputs and
      # aliasing unknown)
      "compiler_out_of_memory": result.out_of_memory is not None,
      "param_bytes_total": total_bytes, "param_bytes_per_device": device_bytes,
      "param_shard_ratio": round(device_bytes / (total_bytes / len(devices)), 3),
      "flops_per_iteration": total_flops,
      "seconds_per_iteration_at_40pct": None if seconds_40 is None else round(seconds_40, 2),
  }


def _trained(r: dict[str, Any]) -> str:
  """", 0.04B of them trained" where only part of the policy trains (LoRA)."""
  trained = r.get("trained_params", r["params"])
  return "" if trained == r["params"] else f", {trained / 1e9:.2f}B of them trained"


def _prefix(r: dict[str, Any]) -> str:
  """How the prompts' shared prefix was compiled, for the report's first line."""
  if r.get("prefix_from") == "unknown":
    return ("; compiled without the shared prefix a training run has (its length needs the "
            "tokenizer: --prefix_len=N)")
  return f", a shared prefix of {r['prefix_len']} tokens" if r.get("prefix_len") else ""


def format_report(r: dict[str, Any]) -> str:
  gib = lambda b: "?" if b is None else f"{b / 2**30:.2f} GiB"  # noqa: E731
  verdict = {True: "fits", False: "DOES NOT FIT", None: "unknown HBM"}[r["fits"]]
  lines = [
      f"{r['model']} ({r['params'] / 1e9:.2f}B params{_trained(r)}), {r['batch']} x "
      f"({r['prompt_len']} + {r['response_len']}) tokens, {r['dtype']}"
      f"{', remat' if r['remat'] else ''}{_prefix(r)}",
      f"{r['topology']}: {r['devices']} x {r['device_kind']}, mesh {r['mesh']}, "
      f"compiled in {r['compile_seconds']:.0f} s",
      f"  per device  {gib(r['per_device_bytes'])} of {gib(r['hbm_bytes_per_device'])}: {verdict}",
      f"    arguments {gib(r['argument_bytes'])}, outputs {gib(r['output_bytes'])}, "
      f"temporaries {gib(r['temp_bytes'])}, aliased {gib(r['alias_bytes'])}",
      f"  parameters (every model) {gib(r['param_bytes_total'])} in all, "
      f"{gib(r['param_bytes_per_device'])} on a device ({r['param_shard_ratio']:.2f} x "
      f"total/devices)",
  ]
  if r["flops_per_iteration"]:
    at40 = r["seconds_per_iteration_at_40pct"]
    lines.append(f"  {r['flops_per_iteration'] / 1e12:.1f} TFLOP per iteration"
                 + (f": {at40:.2f} s at 40% of the chips' bf16 peak" if at40 else ""))
  return "\n".join(lines)


if __name__ == "__main__":  # the command line is ppojax.aot (ppojax/aot.py)
  import runpy  # pylint: disable=import-outside-toplevel
  runpy.run_module("ppojax.aot", run_name="__main__", alter_sys=True)
