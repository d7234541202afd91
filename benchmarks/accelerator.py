"""Every accelerator figure in one command: calibration, decode, PPO (the verl anchor), MFU, GRPO
and compile seconds, on random bfloat16 weights at real shapes (nothing is downloaded).

Table: docs/performance/gpu.md, "The accelerator suite: `benchmarks/accelerator.py`" (its figures:
"Figures: one H200").

    python benchmarks/accelerator.py [--small] [--out FILE] [--only SECTION[,SECTION...]]
        [--budget SECONDS]

Sections (``--only`` takes any of them, or a unit name below; the default is all):

  calibration  the device's bfloat16 matmul rate (n × n matrices, n = 8192: 2·n³ FLOPs per
               product, timed over a run of products) and its copy bandwidth (``x + 1`` over a
               1 GiB array: bytes read + bytes written per second). Measured, never assumed;
               the roofline and MFU figures below divide by these.
  decode       ``rollout.sampling.generate`` of Qwen2.5-0.5B and -1.5B shapes, 128 random prompt
               tokens, 512 new tokens forced (``min_new_tokens = max_new_tokens``), batch 64 and
               256, params in the decode layout (``decode_layout``, bfloat16). tokens/s =
               B·R / seconds (prefill included). The roofline time is
                   max(bytes_pre / bandwidth, FLOPs_pre / peak)
                   + Σ_{k<R−1} max((W + kv·(P + k + 1)) / bandwidth, FLOPs_k / peak)
               with W the decode-layout weight bytes, kv = B·L·2·H_kv·D·2 bytes per cached
               position, FLOPs from ``ppojax.infra.flops.model_flops`` (prefill; one decode step
               attending to P + k + 1 positions); ``roofline_fraction`` = roofline / measured.
               ``roofline_fraction_full_cache`` charges every step the whole cache (P + R − 1
               slots), which the einsum decode attention reads (the fused kernel, a GPU's
               default in bf16: ``model.decode_attention``, reads the visible slots only).
  ppo          Qwen2.5-0.5B full PPO as verl's GSM8K quickstart runs it: actor, critic,
               reference and a reward MODEL (all of the policy's shape, random), 256 prompts of
               128 tokens, responses of 264 and of 512 tokens (forced), 1 epoch of 4
               minibatches, remat, frozen models in bfloat16. ``phase_timing=True``: rollout
               (generation plus the old / reference log-prob and value passes) / scoring (the
               reward model) / update, each a timed call; ``generation_s`` times ``generate``
               alone on the same params, prompts and sampling config, and ``rollout_passes_s``
               is the rest of the rollout. tokens/s = B·(P + R) / (s/step); the device's peak
               bytes in use (``memory_stats``); the first iteration with its compiles.
  mfu          the update phase's model FLOPs (``flops.model_flops``: policy and critic
               fwd+bwd, no remat recompute) / its seconds / the measured bfloat16 peak, and / the
               datasheet peak where the device is in ``DATASHEET_BF16_TFLOPS``; 0.5B from the
               PPO run with 512-token responses, 1.5B from the GRPO run.
  grpo         Qwen2.5-1.5B GRPO (a JAX reward, a reference for the KL term), 64 prompts × 8
               samples, 128 + 512 tokens, 8 micro-batches (64 rows: the update's bfloat16
               logits [rows, R, V] and their gradient fit beside the 1.5B model's float32
               params and Adam state); s/step, tokens/s/device = rows·(P + R) / (s/step) / devices
               and 6·N·tokens/s/device / the measured peak (N: every parameter of the policy).
  compile      backend compile seconds of every program (``jax.monitoring``'s
               ``/jax/core/compile/backend_compile_duration``), per unit, by the phase that
               compiled it (build, rollout, score, learn, generation; decode: MODEL/init and
               MODEL/bB) and function name; persistent-cache hits are counted (``cache_hits``).

The models are ``model.policy = "tiny"`` at the Qwen2.5 shapes (vocabulary, width, MLP, layers,
heads, KV heads, tied embeddings); unlike Qwen2.5 they have no q/k/v biases (H·D + 2·H_kv·D
numbers per layer) and RoPE θ = 10⁴ instead of 10⁶: the same FLOPs and bytes to within 0.01%.
The reward model is ``model.reward = "tiny"``: the same shape with a zero score head. Prompts
are random tokens with a full mask (no tokenizer, no padding).

Each unit runs in a child process of its own (its own device peak; a crash or a hang loses that
unit only), under a timeout from ``--budget`` (default 480 s for the whole command), and writes
each figure as soon as it has it. Every part sits in try/except: an error is recorded and the
rest goes on. Progress goes to stderr with timestamps; stdout gets a Markdown table and, last,
one JSON line (``figures``: name → number or null, ``null_reasons`` for each null, ``errors``,
``environment``, ``settings``, the raw ``units``); both are also written to ``--out`` (default
``accelerator_results.md``) and the same name with ``.json``. ``--small`` runs the same code at
toy shapes (2–3 layers, width 64–96, a few rows and tokens), fit for a CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import types

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from ppojax.data.batch import Prompts
from ppojax.infra import sharding as sharding_lib
from ppojax.infra.flops import model_flops
from ppojax.models import CausalLM
from ppojax.rollout import sampling as sampling_lib
from ppojax.run import build as build_lib
from ppojax.run import models as models_lib
from ppojax.run import runner
from ppojax.run.config import defaults

T0 = time.time()
UNITS = ("calibration", "ppo_short", "ppo_long", "grpo", "decode")  # run in this order
SECTIONS = {"calibration": ("calibration",), "decode": ("decode",),
            "ppo": ("ppo_short", "ppo_long"), "mfu": ("ppo_long", "grpo"), "grpo": ("grpo",),
            "compile": UNITS}
# each unit's timeout at --budget 480 (scaled with it), and the time kept for each later unit
CAPS = {"calibration": 60, "ppo_short": 150, "ppo_long": 150, "grpo": 150, "decode": 200}
RESERVE_S = 20
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
LOWER_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                "/jax/core/compile/jaxpr_to_mlir_module_duration")
# dense bfloat16 TFLOP/s from the vendors' datasheets, by a substring of ``device_kind``
DATASHEET_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.4), ("H200", 989.4),
                         ("A100", 312.0), ("TPU v4", 275.0), ("TPU v5 lite", 197.0),
                         ("TPU v5p", 459.0), ("TPU v6 lite", 918.0))
# Qwen2.5's config.json shapes (tied embeddings both); "small": stand-ins for a CPU
QWEN = {"0.5b": {"vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
                 "num_layers": 24, "num_heads": 14, "num_kv_heads": 2,
                 "max_position_embeddings": 32768},
        "1.5b": {"vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960,
                 "num_layers": 28, "num_heads": 12, "num_kv_heads": 2,
                 "max_position_embeddings": 32768}}
TOY = {"0.5b": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2,
                "num_heads": 4, "num_kv_heads": 2, "max_position_embeddings": 256},
       "1.5b": {"vocab_size": 512, "hidden_size": 96, "intermediate_size": 192, "num_layers": 3,
                "num_heads": 4, "num_kv_heads": 2, "max_position_embeddings": 256}}
FULL_SIZES = dict(
    models=QWEN, matmul_n=8192, matmul_reps=20, copy_mib=1024, copy_reps=20,
    decode_batches=(64, 256), prompt_len=128, decode_new=512,
    ppo_prompts=256, ppo_responses=(264, 512), ppo_minibatches=4,  # verl: mini-batches of 64
    grpo_prompts=64, grpo_samples=8, grpo_response=512, grpo_micro=8, timed=2)
SMALL_SIZES = dict(
    models=TOY, matmul_n=256, matmul_reps=4, copy_mib=16, copy_reps=4,
    decode_batches=(4, 8), prompt_len=8, decode_new=8,
    ppo_prompts=8, ppo_responses=(6, 10), ppo_minibatches=2,
    grpo_prompts=4, grpo_samples=2, grpo_response=8, grpo_micro=2, timed=2)


def log(msg: str) -> None:
  print(f"[{time.strftime('%H:%M:%S')} +{time.time() - T0:6.1f}s] {msg}", file=sys.stderr,
        flush=True)


def error_text(e: BaseException) -> str:
  return f"{type(e).__name__}: {e}"[:2000]


# ---------------------------------------------------------------------------------------------
# Child side: one unit in its own process, each figure written as soon as it is taken
# ---------------------------------------------------------------------------------------------


class Recorder:
  """Figures of one unit, appended to a JSON-lines file as they come ({key: value} per line),
  so a unit that is killed keeps what it had; compile seconds by "label/function name" (the
  label: what the unit was doing, ``Labelled``), and the persistent cache's hits."""

  def __init__(self, path: str):
    self.path, self.label = path, ""
    self.compiles, self.lowering, self.cache_hits = {}, {}, 0
    jax.monitoring.register_event_duration_secs_listener(self._on_duration)
    jax.monitoring.register_event_listener(self._on_event)

  def _on_duration(self, event: str, duration: float, **kwargs) -> None:
    name = "/".join(filter(None, (self.label, str(kwargs.get("fun_name", "?")))))
    if event == COMPILE_EVENT:
      self.compiles[name] = self.compiles.get(name, 0.0) + duration
    elif event in LOWER_EVENTS:
      self.lowering[name] = self.lowering.get(name, 0.0) + duration

  def _on_event(self, event: str, **kwargs) -> None:
    del kwargs
    if event == "/jax/compilation_cache/cache_hits":
      self.cache_hits += 1

  def put(self, key: str, value) -> None:
    with open(self.path, "a", encoding="utf-8") as f:
      f.write(json.dumps({key: value}) + "\n")
      f.write(json.dumps({"compile": self.compiles, "lowering": self.lowering,
                          "cache_hits": self.cache_hits}) + "\n")

  def attempt(self, what: str, fn, *args):
    """``fn(*args)``, or None with the error recorded under ``errors/what``."""
    try:
      return fn(*args)
    except Exception as e:  # noqa: BLE001  pylint: disable=broad-except
      log(f"{what} failed: {error_text(e)}\n{traceback.format_exc()}")
      self.put(f"errors/{what}", error_text(e))
      return None


class Labelled:
  """A jitted step function that names its compiles after its phase (the step's three are all
  ``jit(traced)``): ``lower`` and calls set ``rec.label``; ``hostmem.compiled_call`` sees a
  jitted function (it has ``lower``) and compiles it apart as for the unwrapped one."""

  def __init__(self, fn, label: str, rec: Recorder):
    self.fn, self.label, self.rec = fn, label, rec

  def lower(self, *args):
    self.rec.label = self.label
    return self.fn.lower(*args)

  def __call__(self, *args):
    self.rec.label = self.label
    return self.fn(*args)


def timed_calls(fn, timed: int) -> tuple[float, list[float], object]:
  """(seconds of the first call, compile included; seconds of the next ``timed`` calls, each
  waited for; the last call's result)."""
  times, out = [], None
  for _ in range(1 + timed):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return times[0], times[1:], out


def device_peak_bytes() -> int | None:
  try:
    stats = jax.local_devices()[0].memory_stats() or {}
  except (NotImplementedError, RuntimeError):
    stats = {}
  return stats.get("peak_bytes_in_use")


def environment() -> dict:
  """The device, its driver and CUDA versions where there are any, jax, jaxlib and plugins."""
  from importlib import metadata  # pylint: disable=import-outside-toplevel
  dev = jax.devices()[0]
  env = {"device_kind": dev.device_kind, "platform": dev.platform,
         "device_count": jax.device_count(), "jax": jax.__version__,
         "jaxlib": metadata.version("jaxlib"), "python": sys.version.split()[0],
         "plugins": {d.metadata["Name"]: d.version for d in metadata.distributions()
                     if any(s in (d.metadata["Name"] or "").lower().replace("_", "-")
                            for s in ("jax-cuda", "jax-rocm", "libtpu"))},
         "jax_flags": {k: v for k, v in os.environ.items() if k.startswith(("JAX_", "XLA_"))},
         "compilation_cache_dir": jax.config.jax_compilation_cache_dir}
  env.update(nvidia_smi())
  env["cuda"] = cuda_versions()
  return env


def nvidia_smi() -> dict:
  """The driver version and the driver's CUDA version from nvidia-smi; None where it is absent."""
  out = {"driver_version": None, "driver_cuda_version": None}
  try:
    query = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30, check=True)
    out["driver_version"] = query.stdout.strip().splitlines()[0]
    head = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30,
                          check=False).stdout
    if "CUDA Version:" in head:
      out["driver_cuda_version"] = head.split("CUDA Version:")[1].split()[0]
  except (OSError, subprocess.SubprocessError, IndexError):
    pass
  return out


def cuda_versions() -> dict | None:
  """CUDA runtime, driver and cuDNN versions as jax's CUDA plugin reports them (None: no plugin)."""
  try:
    from jax._src.lib import cuda_versions as cv  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  if cv is None:
    return None
  names = ("cuda_runtime_get_version", "cuda_driver_get_version", "cudnn_get_version",
           "cublas_get_version", "cufft_get_version", "cusolver_get_version")
  out = {}
  for name in names:
    try:
      out[name.replace("_get_version", "")] = getattr(cv, name)()
    except Exception:  # noqa: BLE001, S110  pylint: disable=broad-except
      pass  # a version this plugin does not report
  return out


def unit_calibration(sizes: dict, rec: Recorder) -> None:
  rec.put("environment", environment())
  rec.attempt("matmul", lambda: rec.put("matmul_tflops", matmul_tflops(
      sizes["matmul_n"], sizes["matmul_reps"])))
  rec.attempt("copy", lambda: rec.put("copy_gb_s", copy_gb_s(sizes["copy_mib"],
                                                              sizes["copy_reps"])))


def best_seconds_per_call(fn, args, reps: int, repeats: int = 3) -> float:
  """The fastest of ``repeats`` runs of ``reps`` back-to-back calls, per call (compiled first)."""
  jax.block_until_ready(fn(*args))
  best = math.inf
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready([fn(*args) for _ in range(reps)])
    best = min(best, (time.perf_counter() - t0) / reps)
  return best


def matmul_tflops(n: int, reps: int) -> float:
  """bfloat16 [n, n] @ [n, n]: 2·n³ FLOPs per product, in TFLOP/s."""
  ka, kb = jax.random.split(jax.random.key(0))
  a = jax.random.normal(ka, (n, n), jnp.bfloat16)
  b = jax.random.normal(kb, (n, n), jnp.bfloat16)
  seconds = best_seconds_per_call(jax.jit(jnp.matmul), (a, b), reps)
  log(f"matmul {n}² bf16: {seconds * 1e3:.3f} ms per product")
  return 2 * n**3 / seconds / 1e12


def copy_gb_s(mib: int, reps: int) -> float:
  """``x + 1`` over a bfloat16 array of ``mib`` MiB: (bytes read + bytes written) / s, in GB/s."""
  x = jnp.ones((mib * 2**20 // 2,), jnp.bfloat16)
  seconds = best_seconds_per_call(jax.jit(lambda v: v + 1), (x,), reps)
  log(f"copy {mib} MiB: {seconds * 1e3:.3f} ms per pass")
  return 2 * x.nbytes / seconds / 1e9


def rl_config(sizes: dict, model: str, algorithm: str, prompts: int, response: int,
              samples: int = 1, minibatches: int = 1, micro: int = 1,
              reward_model: bool = True) -> ml_collections.ConfigDict:
  """``defaults()`` with a random ``model`` of the Qwen2.5 shape as policy (and as reward model,
  critic and reference where the algorithm has them), bfloat16 compute, remat, frozen models in
  bfloat16, ``response`` tokens forced, the three phases timed apart."""
  c = defaults()
  c.algorithm = algorithm
  c.num_iterations = 1000  # only sizes the learning-rate schedules
  c.sample_every = 0
  c.phase_timing = True
  c.model.policy = "tiny"
  c.model.tiny = ml_collections.ConfigDict(sizes["models"][model])
  c.model.dtype = "bfloat16"
  c.model.remat = True
  c.model.frozen_dtype = "bfloat16"
  c.data.task = "count"  # only for build's first batch: the benchmark passes its own prompts
  c.data.prompt_len = c.data.max_prompt_len = sizes["prompt_len"]
  c.data.shared_prefix = False
  if reward_model:
    c.reward.kind, c.model.reward, c.model.critic_init = "model", "tiny", "reward"
  else:
    c.reward.kind, c.reward.fn = "jax", "ppojax.tasks.count:count_reward"
  c.sampling.max_new_tokens = c.sampling.min_new_tokens = response  # every row R tokens long
  c.sampling.stop_ids, c.sampling.pad_id = (0,), 0
  c.sampling.temperature = 1.0
  c.sampling.num_samples_per_prompt = samples
  c.rl.batch_size = prompts
  c.rl.num_minibatches, c.rl.grad_accum = minibatches, micro
  return c


def random_prompts(rows: int, length: int, vocab: int, seed: int = 0) -> Prompts:
  """[rows, length] random tokens (ids 2 … min(vocab, 1000) − 1: neither stop nor BOS), all
  real (a full mask)."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(2, min(vocab, 1000), size=(rows, length), dtype=np.int32)
  return Prompts(tokens, np.ones((rows, length), bool))


def unit_decode(sizes: dict, rec: Recorder) -> None:
  for model in sizes["models"]:
    rec.attempt(f"decode/{model}", decode_model, sizes, model, rec)


def decode_model(sizes: dict, model: str, rec: Recorder) -> None:
  """``generate`` at each decode batch, on params laid out for decoding once."""
  new = sizes["decode_new"]
  config = rl_config(sizes, model, "grpo", max(sizes["decode_batches"]), new,
                     reward_model=False)
  rec.label = f"{model}/init"
  policy = models_lib.load_policy(config, jax.random.key(0))
  sampling = build_lib.sampling_config(config, policy)
  module, params = sampling_lib.decode_layout(CausalLM(policy.cfg), policy.params)
  del policy
  weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  for batch in sizes["decode_batches"]:
    name, rec.label = f"decode/{model}/b{batch}", f"{model}/b{batch}"
    log(f"{name}: {sizes['prompt_len']} + {new} tokens")
    rec.attempt(name, decode_batch, module, params, sampling, batch, sizes, name, rec,
                weight_bytes)


def decode_batch(module, params, sampling, batch: int, sizes: dict, name: str, rec: Recorder,
                 weight_bytes: int) -> None:
  cfg = module.cfg
  prompts = random_prompts(batch, sizes["prompt_len"], cfg.vocab_size, seed=batch)
  tokens, mask = jnp.asarray(prompts.tokens), jnp.asarray(prompts.mask)
  key = jax.random.key(1)
  call = lambda: sampling_lib.generate(module, params, tokens, mask, key, sampling)
  first, times, out = timed_calls(call, sizes["timed"])
  made = int(jnp.sum(out.mask))
  if made != batch * sampling.max_new_tokens:
    raise RuntimeError(f"{name}: {made} tokens, not {batch} × {sampling.max_new_tokens}")
  rec.put(name, {"batch": batch, "prompt_len": sizes["prompt_len"],
                 "new_tokens": sampling.max_new_tokens, "first_call_s": first, "seconds": times,
                 "weight_bytes": weight_bytes,
                 "kv_itemsize": jnp.dtype(cfg.compute_dtype).itemsize, "dims": dims(cfg),
                 "layers": "scan" if cfg.scan_layers else "unroll",  # as decode_layout made it
                 "stop_check_every": sampling_lib.stop_check_steps(sampling.stop_check_every,
                                                                   jax.tree.leaves(params)[0])})
  log(f"{name}: {statistics.median(times):.3f} s (first call {first:.1f} s)")


def dims(cfg) -> dict:
  keys = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_layers",
          "num_heads", "num_kv_heads", "head_dim")
  return {k: getattr(cfg, k) for k in keys}


def unit_ppo(sizes: dict, rec: Recorder, which: int) -> None:
  config = rl_config(sizes, "0.5b", "ppo", sizes["ppo_prompts"], sizes["ppo_responses"][which],
                     minibatches=sizes["ppo_minibatches"])
  rl_unit(config, sizes, rec)


def unit_grpo(sizes: dict, rec: Recorder) -> None:
  config = rl_config(sizes, "1.5b", "grpo", sizes["grpo_prompts"], sizes["grpo_response"],
                     samples=sizes["grpo_samples"], micro=sizes["grpo_micro"],
                     reward_model=False)
  rl_unit(config, sizes, rec)


def rl_unit(config, sizes: dict, rec: Recorder) -> None:
  """Build as training does, then 1 + ``timed`` phase-timed iterations on the same random
  prompts (each written as it ends), the device peak, model FLOPs, and ``generate`` alone."""
  t0, rec.label = time.perf_counter(), "build"
  run = build_lib.build(config)
  rec.put("build_s", time.perf_counter() - t0)
  run = run._replace(step=run.step._replace(**{
      phase: Labelled(getattr(run.step, phase), phase, rec)
      for phase in ("rollout", "score", "learn")}))
  rows, n = config.rl.batch_size, config.sampling.num_samples_per_prompt
  prompt_len, response = sizes["prompt_len"], config.sampling.max_new_tokens
  rec.put("shape", {"prompts": rows, "samples": n, "prompt_len": prompt_len,
                    "response_len": response, "dims": dims(run.models.policy.cfg),
                    "params": int(sum(x.size for x in jax.tree.leaves(run.state.actor))),
                    "devices": jax.device_count()})
  rec.attempt("flops", lambda: rec.put("flops", iteration_flops(run, prompt_len, response)))
  prompts = sharding_lib.place_prompts(
      random_prompts(rows, prompt_len, run.models.policy.cfg.vocab_size), run.mesh)
  state = run.state
  for i in range(1 + sizes["timed"]):
    log(f"iteration {i} ({'compiles' if i == 0 else 'timed'})")
    state, metrics, r, _ = runner.iteration(run, state, prompts, None, phase_timing=True)
    if i == 0:
      made = int(np.sum(np.asarray(r.mask)))
      if made != rows * n * response:
        raise RuntimeError(f"{made} response tokens, not {rows} × {n} × {response}")
    rec.put(f"iteration_{i}", {k: v for k, v in metrics.items() if k.startswith("time/")})
    rec.put("device_peak_bytes", device_peak_bytes())
    log(f"iteration {i}: " + ", ".join(f"{k[5:]} {v:.2f} s" for k, v in metrics.items()
                                       if k.startswith("time/")))
  rec.attempt("generation", time_generation, run, state, prompts, sizes["timed"], rec)


def iteration_flops(run, prompt_len: int, response: int) -> dict:
  """``flops.model_flops`` of this run's iteration, by part."""
  rl = run.config.rl
  reuse = rl.num_epochs * rl.num_minibatches * rl.grad_accum == 1 and rl.reuse_update_forward
  return model_flops(
      run.models.policy.cfg, rl.batch_size, prompt_len, response,
      old_logp_fwd=not reuse and rl.old_logprobs == "recompute", critic_fwd=not reuse,
      epochs=rl.num_epochs, samples=run.sampling.num_samples_per_prompt,
      critic=run.models.critic is not None, reference=run.frozen.reference is not None,
      reward_model=run.models.reward is not None)


def time_generation(run, state, prompts: Prompts, timed: int, rec: Recorder) -> None:
  """``generate`` alone, as the rollout calls it: the run's sampler and sampling config, the
  actor's params as the state holds them (laid out for decoding inside the call)."""
  module = run.models.sampler or run.models.policy
  key, rec.label = jax.random.key(2), "generation"
  call = lambda: sampling_lib.generate(module, state.actor, prompts.tokens,
                                       prompts.mask, key, run.sampling)
  first, times, _ = timed_calls(call, timed)
  rec.put("generation", {"first_call_s": first, "seconds": times})
  log(f"generate alone: {statistics.median(times):.3f} s (first call {first:.1f} s)")


CHILDREN = {"calibration": unit_calibration, "decode": unit_decode,
            "ppo_short": lambda sizes, rec: unit_ppo(sizes, rec, 0),
            "ppo_long": lambda sizes, rec: unit_ppo(sizes, rec, 1), "grpo": unit_grpo}


def child(unit: str, result: str, small: bool) -> None:
  """One unit in this process; its figures go to ``result`` (JSON lines)."""
  rec = Recorder(result)
  log(f"unit {unit} on {jax.devices()[0].device_kind} ({jax.devices()[0].platform})")
  rec.attempt("unit", CHILDREN[unit], SMALL_SIZES if small else FULL_SIZES, rec)
  rec.put("done", True)


# ---------------------------------------------------------------------------------------------
# Parent side: the units one after another under the budget, then the figures
# ---------------------------------------------------------------------------------------------


def plan(only: str) -> list[str]:
  """The units to run, in ``UNITS`` order; calibration always (the ratios divide by it, and it
  records the environment)."""
  wanted = {"calibration"}
  for part in filter(None, (p.strip() for p in only.split(","))):
    if part not in SECTIONS and part not in UNITS:
      raise SystemExit(f"--only {part!r}: choose from the sections {', '.join(SECTIONS)} or the "
                       f"units {', '.join(UNITS)}")
    wanted.update(SECTIONS.get(part, (part,)))
  return [u for u in UNITS if u in wanted] if only else list(UNITS)


def run_units(units: list[str], small: bool, budget: float) -> dict[str, dict]:
  """Each unit in a child process, under min(its cap, what the budget leaves after keeping
  ``RESERVE_S`` for each later unit); a unit with under 15 s is skipped."""
  results = {}
  for i, unit in enumerate(units):
    remaining = budget - (time.time() - T0)
    timeout = remaining - RESERVE_S * (len(units) - i - 1)
    timeout = min(CAPS[unit] * budget / 480, timeout) if not small else remaining
    if timeout < 15:
      results[unit] = {"errors/unit": f"skipped: {max(remaining, 0):.0f} s of the --budget of "
                                      f"{budget:.0f} s left"}
      log(f"unit {unit}: {results[unit]['errors/unit']}")
      continue
    results[unit] = run_unit(unit, small, timeout)
  return results


def run_unit(unit: str, small: bool, timeout: float) -> dict:
  """The unit's figures as its child wrote them (the last value of each key), with its wall
  seconds, and ``errors/unit`` where the child did not end normally."""
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "result.jsonl")
    cmd = [sys.executable, os.path.abspath(__file__), "--unit", unit, "--result", path]
    log(f"unit {unit}: starting (timeout {timeout:.0f} s)")
    t0, status = time.time(), None
    try:
      proc = subprocess.run(cmd + (["--small"] if small else []), timeout=timeout, check=False,
                            stdout=sys.stderr, env=child_env())
      if proc.returncode:
        status = f"the unit's process exited with code {proc.returncode}"
    except subprocess.TimeoutExpired:
      status = f"killed at its timeout of {timeout:.0f} s (--budget)"
    out = {}
    if os.path.exists(path):
      with open(path, encoding="utf-8") as f:
        for line in f:
          out.update(json.loads(line))
  out["wall_s"] = time.time() - t0
  if status and "errors/unit" not in out:
    out["errors/unit"] = status
  log(f"unit {unit}: {out.get('errors/unit', 'done')} after {out['wall_s']:.0f} s")
  return out


def child_env() -> dict:
  """This environment, with JAX's GPU memory pool at 90% of the device (default 75%): each
  unit has the device to itself."""
  return {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.90", **os.environ}


def median(values) -> float | None:
  values = [v for v in values if v is not None]
  return statistics.median(values) if values else None


def decode_roofline(raw: dict, peak_tflops: float, gb_s: float, full_cache: bool = False
                    ) -> float:
  """Seconds of ``generate`` at the roofline (module docstring): the prefill and each of the
  R − 1 decode steps at max(bytes / bandwidth, FLOPs / peak)."""
  d = raw["dims"]
  cfg = types.SimpleNamespace(**d)
  batch, p, r = raw["batch"], raw["prompt_len"], raw["new_tokens"]
  peak, bandwidth, weights = peak_tflops * 1e12, gb_s * 1e9, raw["weight_bytes"]
  kv = batch * d["num_layers"] * 2 * d["num_kv_heads"] * d["head_dim"] * raw["kv_itemsize"]
  prefill = model_flops(cfg, batch, p, r)["generation (prefill)"]
  # one decode step attending to c positions: a + b·c FLOPs (weights, then attention)
  one, two = (model_flops(cfg, batch, c - 1, 2)["generation (decode)"] for c in (1, 2))
  a, b = 2 * one - two, two - one
  total = max((weights + kv * p) / bandwidth, prefill / peak)
  for k in range(r - 1):
    context = p + k + 1  # the positions step k attends to (its own included)
    read = kv * ((p + r - 1) if full_cache else context)
    total += max((weights + read) / bandwidth, (a + b * context) / peak)
  return total


def datasheet_tflops(device_kind: str) -> float | None:
  for name, tflops in DATASHEET_BF16_TFLOPS:
    if name.lower() in device_kind.lower():
      return tflops
  return None


class Figures:
  """Named figures: a positive finite number, or None with the reason in ``reasons``."""

  def __init__(self):
    self.values, self.reasons = {}, {}

  def put(self, name: str, value, reason: str = "") -> None:
    ok = isinstance(value, (int, float)) and math.isfinite(value) and value > 0
    self.values[name] = float(value) if ok else None
    if not ok:
      self.reasons[name] = (reason or "not measured") if value is None else (
          f"{value!r} is not a positive finite number" + (f" ({reason})" if reason else ""))


def why(units: dict, unit: str, *parts: str) -> str:
  """Why a figure of ``unit`` is missing: the error of its part, of the unit, or its end."""
  if unit not in units:
    return f"unit {unit} not run (--only)"
  u = units[unit]
  for part in parts + ("unit",):
    if f"errors/{part}" in u:
      return f"{unit}: {u[f'errors/{part}']}"
  return f"{unit}: not measured (the unit ended first; see its log)"


def calibration_figures(fig: Figures, units: dict) -> tuple:
  u = units.get("calibration", {})
  peak, bandwidth = u.get("matmul_tflops"), u.get("copy_gb_s")
  fig.put("calibration/bf16_matmul_tflops", peak, why(units, "calibration", "matmul"))
  fig.put("calibration/copy_gb_s", bandwidth, why(units, "calibration", "copy"))
  kind = u.get("environment", {}).get("device_kind")
  sheet = datasheet_tflops(kind) if kind else None
  fig.put("calibration/datasheet_bf16_tflops", sheet,
          f"no datasheet figure for the device kind {kind!r}" if kind else why(units,
                                                                               "calibration"))
  return peak, bandwidth, sheet


def decode_figures(fig: Figures, units: dict, sizes: dict, peak, bandwidth) -> None:
  u = units.get("decode", {})
  for model in sizes["models"]:
    for batch in sizes["decode_batches"]:
      name = f"decode/{model}/b{batch}"
      raw, reason = u.get(name), why(units, "decode", name, f"decode/{model}")
      seconds = median(raw["seconds"]) if raw else None
      fig.put(f"{name}/seconds", seconds, reason)
      fig.put(f"{name}/tokens_per_s",
              batch * sizes["decode_new"] / seconds if seconds else None, reason)
      roof = full = None
      if seconds and peak and bandwidth:
        roof, full = (decode_roofline(raw, peak, bandwidth, c) for c in (False, True))
      elif seconds:
        reason = "needs the calibration figures: " + why(units, "calibration", "matmul", "copy")
      fig.put(f"{name}/roofline_s", roof, reason)
      fig.put(f"{name}/roofline_fraction", roof / seconds if roof else None, reason)
      fig.put(f"{name}/roofline_fraction_full_cache", full / seconds if full else None, reason)


def rl_figures(fig: Figures, units: dict, unit: str, prefix: str, timed: int) -> dict:
  """The figures every RL unit has; returns its medians, shape and FLOPs for the rest."""
  u, reason = units.get(unit, {}), why(units, unit)
  its = [u[f"iteration_{i}"] for i in range(1, timed + 1) if f"iteration_{i}" in u]
  med = {k: median(it.get(f"time/{k}") for it in its)
         for k in ("iteration", "sampling", "scoring", "update")}
  shape, flops = u.get("shape"), u.get("flops")
  gen = median(u["generation"]["seconds"]) if "generation" in u else None
  step = med["iteration"]
  rows = shape["prompts"] * shape["samples"] if shape else 0
  tokens = rows * (shape["prompt_len"] + shape["response_len"]) if shape else 0
  fig.put(f"{prefix}/s_per_step", step, reason)
  fig.put(f"{prefix}/rollout_s", med["sampling"], reason)
  fig.put(f"{prefix}/scoring_s", med["scoring"], reason)
  fig.put(f"{prefix}/update_s", med["update"], reason)
  fig.put(f"{prefix}/generation_s", gen, why(units, unit, "generation"))
  rest = med["sampling"] - gen if gen and med["sampling"] else None
  fig.put(f"{prefix}/rollout_passes_s", rest, "rollout_s − generation_s (timing noise)"
          if rest is not None else why(units, unit, "generation"))
  fig.put(f"{prefix}/tokens_per_s", tokens / step if step and tokens else None, reason)
  fig.put(f"{prefix}/tokens_per_s_per_device",
          tokens / step / shape["devices"] if step and tokens else None, reason)
  peak = u.get("device_peak_bytes")
  platform = units.get("calibration", {}).get("environment", {}).get("platform", "?")
  fig.put(f"{prefix}/device_peak_gb", peak / 1e9 if peak else None,
          f"the device ({platform}) reports no memory statistics" if its else reason)
  first = u.get("iteration_0", {}).get("time/iteration")
  fig.put(f"{prefix}/first_iteration_s", first, reason)
  fig.put(f"{prefix}/model_tflop_per_step", sum(flops.values()) / 1e12 if flops else None,
          why(units, unit, "flops"))
  return {"update_s": med["update"], "shape": shape, "flops": flops, "step": step,
          "tokens": tokens}


def mfu_figures(fig: Figures, units: dict, model: str, unit: str, got: dict, peak,
                sheet) -> None:
  flops, update_s, shape = got["flops"], got["update_s"], got["shape"]
  learn = None
  if flops and update_s:
    learn = (flops["policy fwd+bwd"] + flops["critic fwd+bwd"]) / update_s / 1e12 / (
        shape["devices"])
  reason = why(units, unit, "flops")
  fig.put(f"mfu/{model}/learn_tflops", learn, reason)
  fig.put(f"mfu/{model}/fraction_of_measured_peak", learn / peak if learn and peak else None,
          reason if not learn else "needs calibration/bf16_matmul_tflops")
  fig.put(f"mfu/{model}/fraction_of_datasheet_peak", learn / sheet if learn and sheet else None,
          reason if not learn else "no datasheet figure for this device")


def compile_figures(fig: Figures, units: dict) -> None:
  total = 0.0
  for unit, u in units.items():
    compiles = u.get("compile") or {}
    for fun, seconds in sorted(compiles.items()):
      fig.put(f"compile/{unit}/{fun}", seconds, "a compile of no measurable time")
    if compiles:
      fig.put(f"compile/{unit}/total_s", sum(compiles.values()))
      total += sum(compiles.values())
  fig.put("compile/total_s", total or None, "no unit recorded a compile")


def all_figures(units: dict, sizes: dict) -> Figures:
  fig = Figures()
  peak, bandwidth, sheet = calibration_figures(fig, units)
  if "decode" in units:
    decode_figures(fig, units, sizes, peak, bandwidth)
  for unit, response in zip(("ppo_short", "ppo_long"), sizes["ppo_responses"]):
    if unit in units:
      got = rl_figures(fig, units, unit, f"ppo/r{response}", sizes["timed"])
      if unit == "ppo_long":
        mfu_figures(fig, units, "0.5b", unit, got, peak, sheet)
  if "grpo" in units:
    got = rl_figures(fig, units, "grpo", "grpo/1.5b", sizes["timed"])
    mfu_figures(fig, units, "1.5b", "grpo", got, peak, sheet)
    six_n = None
    if got["step"] and got["shape"] and peak:
      per_device = got["tokens"] / got["step"] / got["shape"]["devices"]
      six_n = 6 * got["shape"]["params"] * per_device / (peak * 1e12)
    fig.put("grpo/1.5b/six_n_fraction_of_peak", six_n,
            why(units, "grpo") if not got["step"] else "needs calibration/bf16_matmul_tflops")
  compile_figures(fig, units)
  return fig


def settings(sizes: dict, budget: float) -> dict:
  return {
      "sizes": sizes, "budget_s": budget,
      "iterations": f"1 compiling + {sizes['timed']} timed (medians)",
      "models": "model.policy='tiny' at the shapes in sizes.models (Qwen2.5's config.json): no "
                "q/k/v biases, RoPE theta 1e4 (Qwen2.5: biases, 1e6); random init",
      "ppo": "actor, critic (from the reward model), reference, reward model (tiny, zero score "
             "head); 1 epoch, ppo_minibatches minibatches, remat, frozen bfloat16, compute "
             "bfloat16, float32 params and Adam",
      "grpo": "reward.kind='jax' (count_reward), reference for the KL loss, grpo_micro "
              "micro-batches, remat, compute bfloat16",
      "prompts": "random tokens, full mask (no padding, no shared prefix)",
      "phases": "rollout = generation + old/reference log-probs + values; scoring = reward "
                "model (GRPO: the JAX reward); update = experience + optimizer steps"}


def unit_label(name: str) -> str:
  for suffix, label in (("_tflops", "TFLOP/s"), ("_gb_s", "GB/s"), ("tokens_per_s", "tokens/s"),
                        ("tokens_per_s_per_device", "tokens/s"), ("_gb", "GB"),
                        ("tflop_per_step", "TFLOP"), ("fraction", ""), ("_of_peak", "")):
    if name.endswith(suffix) or suffix in name.rsplit("/", 1)[-1]:
      return label
  return "s"


def markdown(report: dict) -> str:
  env = report["environment"]
  cuda = env.get("cuda") or {}
  lines = [
      "# Accelerator suite", "",
      (f"- device: {env.get('device_kind')} ({env.get('platform')}, "
       f"{env.get('device_count')} device(s)); driver {env.get('driver_version')} (CUDA "
       f"{env.get('driver_cuda_version')}); CUDA runtime {cuda.get('cuda_runtime')}, cuDNN "
       f"{cuda.get('cudnn')}"),
      f"- jax {env.get('jax')}, jaxlib {env.get('jaxlib')}, plugins {env.get('plugins')}",
      f"- command: `{report['command']}` ({report['date']}, {report['wall_s']:.0f} s)", "",
      "| figure | value | unit | note |", "| --- | --- | --- | --- |"]
  hidden = [n for n, v in report["figures"].items() if n.startswith("compile/") and v
            and v < 0.5 and not n.endswith("total_s")]
  for name, value in report["figures"].items():
    if name in hidden:
      continue
    shown = "null" if value is None else f"{value:.4g}"
    note = report["null_reasons"].get(name, "").replace("|", "/").replace("\n", " ")[:200]
    lines.append(f"| {name} | {shown} | {unit_label(name)} | {note} |")
  hits = sum(u.get("cache_hits", 0) for u in report["units"].values())
  lines += ["", (f"{len(hidden)} compiles under 0.5 s are in the JSON only; persistent-cache "
                 f"hits: {hits}.")]
  if report["errors"]:
    lines += ["", "Errors:", ""] + [f"- {k}: {v[:300]}" for k, v in report["errors"].items()]
  return "\n".join(lines) + "\n"


def report_of(units: dict, sizes: dict, args, wall: float) -> dict:
  fig = all_figures(units, sizes)
  env = units.get("calibration", {}).get("environment", {})
  errors = {f"{unit}/{k[7:]}": v for unit, u in units.items() for k, v in u.items()
            if k.startswith("errors/")}
  raw = {unit: {k: v for k, v in u.items() if k != "environment"} for unit, u in units.items()}
  return {"command": shlex.join(["python"] + sys.argv),
          "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(T0)), "small": args.small,
          "wall_s": wall, "budget_s": args.budget, "environment": env,
          "settings": settings(sizes, args.budget), "figures": fig.values,
          "null_reasons": fig.reasons, "errors": errors, "units": raw}


def output_paths(out: str) -> tuple[pathlib.Path, pathlib.Path]:
  path = pathlib.Path(out)
  if path.suffix == ".json":
    return path.with_suffix(".md"), path
  return path, path.with_name(path.name + ".json") if path.suffix != ".md" else (
      path.with_suffix(".json"))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--small", action="store_true", help="toy shapes, fit for a CPU")
  parser.add_argument("--out", default="accelerator_results.md",
                      help="the Markdown file; the JSON goes beside it with .json")
  parser.add_argument("--only", default="", help="comma-separated sections or units: "
                      f"{', '.join(SECTIONS)} / {', '.join(UNITS)} (calibration always runs)")
  parser.add_argument("--budget", type=float, default=480.0,
                      help="seconds for the whole command; units that do not fit are skipped")
  parser.add_argument("--unit", choices=UNITS, help=argparse.SUPPRESS)
  parser.add_argument("--result", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.unit:
    child(args.unit, args.result, args.small)
    return
  units = plan(args.only)
  sizes = SMALL_SIZES if args.small else FULL_SIZES
  log(f"units {', '.join(units)}; budget {args.budget:.0f} s"
      + ("; small shapes" if args.small else ""))
  results = run_units(units, args.small, args.budget)
  report = report_of(results, sizes, args, time.time() - T0)
  text = markdown(report)
  md_path, json_path = output_paths(args.out)
  md_path.write_text(text, encoding="utf-8")
  json_path.write_text(json.dumps(report) + "\n", encoding="utf-8")
  log(f"wrote {md_path} and {json_path}")
  print(text, flush=True)
  print(json.dumps(report), flush=True)


if __name__ == "__main__":
  main()
