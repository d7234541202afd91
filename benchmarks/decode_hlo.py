"""What the decode loop copies per token: ``sampling.generate`` compiled (never run) at a real
shape for a back end's decode layout, its optimized HLO read for the token loop's data movement
(issue 62, item 5). Table: docs/performance/decode.md, "The decode loop's copies:
`benchmarks/decode_hlo.py`".

    python benchmarks/decode_hlo.py [--target cpu|gpu|tpu] [--layers auto|scan|unroll]
        [--model qwen2.5-0.5b] [--batch 256 --prompt 128 --new 512] [--dtype bfloat16]
        [--top-p P] [--top-k K] [--temperature T] [--greedy] [--min-new-tokens N] [--small]
        [--check]

Targets, all compiled on this machine without an accelerator (the weights stay abstract:
``jax.eval_shape`` of the init, then ``lower(ShapeDtypeStruct...)``):
  * ``cpu`` (default, what the test suite runs): this CPU's XLA in the GPU's decode layout. The
    script replaces ``compile_platform`` in ``ppojax.rollout.sampling`` and ``.draw`` by one
    that answers "gpu", so ``decode_layout`` keeps the kernels [in, out], "auto" resolves and
    the draw reads its weights as on a GPU (``draw._weights``); the loop structure, slices and
    copies come from passes XLA's CPU and GPU back ends share, but XLA:CPU
    also copies slices XLA:GPU reads in place (the KV cache) and casts the LM head's output
    through float32 (vocabulary-sized arrays XLA:GPU does not write).
  * ``gpu``: XLA:GPU itself, for an H100 described by ``H100_TARGET`` (deviceless: no GPU, no
    autotuning; needs JAX's CUDA plugin, ``CUDA_INSTALL``). The prefill's attention takes the
    einsum path (cuDNN's needs its library); a decode step's attention takes it anyway.
  * ``tpu``: XLA:TPU for one v5e chip (libtpu, as ``python -m ppojax.aot``).

Defaults: the accelerator suite's decode (``benchmarks/accelerator.py``: Qwen2.5-0.5B,
bfloat16, 256 rows, 128 + 512 tokens, every row forced to 512, temperature 1), its params in
the decode layout, the layers as ``SamplingConfig.layers="auto"`` resolves them for the target.
``--small``: ``decode_compile.py``'s 2-layer, width-64 model (its 49152-token embedding is most
of its weights).

Reading the HLO:
  * the token loop: the ``while`` whose loop state carries the s32[batch, new] token buffer
    (``_LoopState.tokens``: no layer loop or RNG loop carries it); if several do, the one whose
    body reaches the most instructions (the outermost), then, where its body holds another
    that carries it (N steps per stop check: ``SamplingConfig.stop_check_every``), that one:
    its body is one decode step.
  * per decode step: its body and every computation it reaches: a nested ``while`` (the layer
    loop; the RNG's loops) counts ``known_trip_count`` times (backend_config; 1 and a note where
    unknown), a ``call`` once, a ``conditional`` its largest branch (and, for the
    ``..._common_path`` figures, its smallest: the draw's top-p takes a sort only where its
    candidates fall short, ``draw.top_threshold``).
  * data movement, in bytes written: ``copy``, ``dynamic-slice``, ``slice``, ``transpose``,
    ``reshape`` (a layout-preserving one is a ``bitcast`` in optimized HLO), ``concatenate``,
    ``pad``, ``gather``, ``broadcast``; and fusions whose fused computation holds only those,
    parameters, constants, bitcasts, tuples and ``convert`` (XLA:CPU wraps bf16 slices in
    converts), at least one of them moving data. Not counted: a fusion that only converts (a
    cast of computed values, such as the logits' to float32), and a ``dynamic-update-slice`` (or
    a fusion whose root is one): XLA updates the buffer in place and writes only the update
    (where it cannot, copy insertion adds a ``copy``, which counts).
  * each copy is put down to the KV cache where its dimensions (1s dropped) are those of one
    layer's K or V ([B, H_kv, D, S] or [B, H_kv, S, D]), to the weights where they are those of
    a params leaf or of one layer of a stacked one, else to "other".
  * vocabulary-sized arrays: instructions of the token loop outside nested loops (the layer
    loop) whose outputs hold at least batch × vocab elements, each element of a multi-output
    fusion's tuple apart; bitcasts, tuples, parameters and in-place updates write none.

Prints one JSON line: bytes per decode step copied (total, KV cache, weights, other), the top
10 copies, vocabulary-sized arrays per step, all bytes the step writes (outputs of every
instruction but in-place updates, bitcasts and tuples; the 8 largest by shape), of those the
attention's scores and probabilities (``score_bytes_per_step``: none where the fused decode
kernel runs, ``decode_attention`` "pallas"), the weight and KV-cache bytes of the shape, the
copy fractions of those and the compile seconds. ``--check`` exits 1 where the KV-cache and
weight copies exceed ``GOAL_FRACTION`` of the weight + KV-cache bytes or more than
``GOAL_VOCAB_ARRAYS`` vocabulary-sized arrays are written per step (issue 62's goals).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import pathlib
import re
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ppojax.models import CausalLM, init_params
from ppojax.models.cache import cache_length, init_cache, keys_transposed
from ppojax.rollout import draw, sampling

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from decode_compile import MODELS

GOAL_FRACTION, GOAL_VOCAB_ARRAYS = 0.05, 2
MOVES = {"copy", "dynamic-slice", "slice", "transpose", "reshape", "concatenate", "pad",
         "gather", "broadcast"}
FUSED_MOVES = MOVES | {"parameter", "constant", "bitcast", "convert", "tuple",
                       "get-tuple-element"}
WRITES_NOTHING = {"parameter", "constant", "bitcast", "tuple", "get-tuple-element", "while",
                  "call", "conditional", "dynamic-update-slice"}
ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
            "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_HEADER = re.compile(r"^(?:ENTRY )?%(\S+) .*\{$")
_INSTR = re.compile(r"^\s+(?:ROOT )?%(\S+) = (.*)$")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9]\w*)?)\[([0-9,]*)\]")
_CALLED = re.compile(r"\b(calls|body|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


class Instr(NamedTuple):
  name: str
  type: str  # the output's shape, "(…)" for a tuple
  opcode: str
  rest: str  # operands and attributes


def parse_hlo(text: str) -> dict[str, list[Instr]]:
  """{computation name: its instructions, in the printed order with the root moved last}."""
  comps, roots, current = {}, {}, None
  for line in text.splitlines():
    header = _HEADER.match(line)
    if header:
      current = comps.setdefault(header.group(1), [])
      continue
    found = _INSTR.match(line) if current is not None else None
    if not found:
      continue
    name, rest = found.groups()
    if rest.startswith("("):  # a tuple type: up to its closing parenthesis
      depth, end = 0, 0
      for end, ch in enumerate(rest):
        depth += (ch == "(") - (ch == ")")
        if depth == 0:
          break
      type_, rest = rest[:end + 1], rest[end + 1:].lstrip()
    else:
      type_, _, rest = rest.partition(" ")
    opcode = rest.split("(", 1)[0]
    current.append(Instr(name, type_, opcode, rest[len(opcode):]))
    if line.lstrip().startswith("ROOT"):
      roots[id(current)] = current[-1]
  for body in comps.values():
    if id(body) in roots:
      body.remove(roots[id(body)])
      body.append(roots[id(body)])
  return comps


def arrays(type_: str) -> list[tuple[str, int]]:
  """(dtype, elements) of each array in an HLO shape (a tuple's elements apart)."""
  return [(dt, math.prod(int(d) for d in dims.split(",") if d))
          for dt, dims in _ARRAY.findall(type_)]


def nbytes(type_: str) -> int:
  return sum(ITEMSIZE.get(dt, 1) * n for dt, n in arrays(type_))


def called(ins: Instr) -> list[str]:
  names = [name for _, name in _CALLED.findall(ins.rest)]
  branches = re.search(r"branch_computations=\{([^}]*)\}", ins.rest)
  return names + (re.findall(r"%([\w.\-]+)", branches.group(1)) if branches else [])


def is_in_place(comps, ins: Instr) -> bool:
  """A dynamic-update-slice, or a fusion whose root is one (or a tuple of them)."""
  if ins.opcode == "dynamic-update-slice":
    return True
  if ins.opcode != "fusion":
    return False
  fused = {i.name: i.opcode for i in comps[called(ins)[0]]}
  root = comps[called(ins)[0]][-1]
  parts = re.findall(r"%([\w.\-]+)", root.rest.split(")")[0]) if root.opcode == "tuple" else []
  return {fused.get(p) for p in parts or [root.name]} == {"dynamic-update-slice"}


def moves_only(comps, ins: Instr) -> bool:
  """Whether ``ins`` only moves data (see the module's docstring)."""
  if ins.opcode in MOVES:
    return True
  if ins.opcode != "fusion" or is_in_place(comps, ins):
    return False
  ops = {i.opcode for i in comps[called(ins)[0]]}
  return ops <= FUSED_MOVES and bool(ops & MOVES)


def token_loop(comps, batch: int, new: int) -> Instr:
  """The token loop's ``while`` (the module's docstring says how it is told)."""
  tokens = re.compile(rf"\bs32\[{batch},{new}\]")
  where = {i.name: comp for comp, body in comps.items() for i in body}
  loops = [i for body in comps.values() for i in body
           if i.opcode == "while" and tokens.search(i.type)]
  if not loops:
    raise ValueError(f"no while loop carries the s32[{batch},{new}] token buffer")
  loop = max(loops, key=lambda i: reach(comps, called(i)[0]))
  while inner := [i for i in loops if where[i.name] in reached(comps, called(loop)[0])]:
    loop = max(inner, key=lambda i: reach(comps, called(i)[0]))  # N steps per stop check
  return loop


def reached(comps, name: str, seen=None) -> set[str]:
  """The computations ``name`` calls, directly or not, itself included."""
  seen = set() if seen is None else seen
  if name not in seen:
    seen.add(name)
    for i in comps[name]:
      for c in called(i):
        reached(comps, c, seen)
  return seen


def reach(comps, name: str) -> int:
  """How many instructions ``name`` holds with the computations it calls (once each)."""
  return sum(len(comps[c]) for c in reached(comps, name))


class Tally(NamedTuple):
  copies: list  # (instruction, opcode, shape, bytes per execution, executions per step)
  vocab: list  # (instruction, shape): vocabulary-sized arrays written per step
  notes: list
  writes: list  # (shape, bytes per step): every array the step writes (not in place)


def walk(comps, name: str, times: int, tally: Tally, vocab_elements: int, nested=False,
         branch=max):
  """Add the data movement of one run of computation ``name``, run ``times`` per step, of a
  ``conditional`` the branch ``branch`` picks by size (``max``: the worst case; ``min``: the
  common path where the larger branch is a rare fallback, e.g. top-p's sort)."""
  for ins in comps[name]:
    if ins.opcode == "while":
      found = _TRIPS.search(ins.rest)
      trips = int(found.group(1)) if found else None
      if trips is None:
        tally.notes.append(f"{ins.name}: no known trip count, counted once")
      walk(comps, called(ins)[0], times * (trips or 1), tally, vocab_elements, True, branch)
    elif ins.opcode == "call":
      walk(comps, called(ins)[0], times, tally, vocab_elements, nested, branch)
    elif ins.opcode == "conditional":
      branches = called(ins)
      taken = branch(branches, key=lambda c: reach(comps, c))
      tally.notes.append(f"{ins.name}: {len(branches)} branches, the {branch.__name__} counted")
      walk(comps, taken, times, tally, vocab_elements, nested, branch)
    elif moves_only(comps, ins) and nbytes(ins.type):
      tally.copies.append((ins.name, _kind(comps, ins), re.sub(r"\{[^}]*\}", "", ins.type),
                           nbytes(ins.type), times))
    if ins.opcode not in WRITES_NOTHING | {"call", "conditional"} and not is_in_place(
        comps, ins):
      tally.writes.extend((f"{dtype}[{dims}]", n * ITEMSIZE.get(dtype, 4) * times)
                          for (dtype, dims), (_, n) in zip(_ARRAY.findall(ins.type),
                                                           arrays(ins.type)))
    if (not nested and ins.opcode not in WRITES_NOTHING and not is_in_place(comps, ins)):
      tally.vocab.extend((ins.name, shape) for shape, (_, n) in
                         zip(_ARRAY.findall(ins.type), arrays(ins.type)) if n >= vocab_elements)


def _kind(comps, ins: Instr) -> str:
  if ins.opcode != "fusion":
    return ins.opcode
  ops = {i.opcode for i in comps[called(ins)[0]]} - {"parameter", "constant", "bitcast"}
  return "fusion(" + ",".join(sorted(ops)) + ")"


def squeezed(shape) -> tuple[int, ...]:
  """An array's dimensions without its 1s, from a tuple or an HLO shape such as bf16[1,4]{1,0}."""
  if isinstance(shape, str):
    shape = [int(d) for d in _ARRAY.search(shape).group(2).split(",") if d]
  return tuple(d for d in shape if d != 1)


def analyse(text: str, batch: int, new: int, vocab: int, kv_shapes: set[tuple],
            weight_shapes: set[tuple], slots: int = 0) -> dict:
  """The token loop's data movement per decode step (module docstring) from optimized HLO;
  ``slots``: the cache's length, whose [.., S] arrays of 3 or more axes are attention scores or
  probabilities (``score_bytes_per_step``; none where the fused decode kernel runs)."""
  comps = parse_hlo(text)
  loop = token_loop(comps, batch, new)
  tally = Tally([], [], [], [])
  walk(comps, called(loop)[0], 1, tally, batch * vocab)
  common = Tally([], [], [], [])
  walk(comps, called(loop)[0], 1, common, batch * vocab, branch=min)
  by = {"kv_cache": 0, "weights": 0, "other": 0}
  for _, _, shape, size, times in tally.copies:
    dims = squeezed(shape) if "(" not in shape else None
    by["kv_cache" if dims in kv_shapes else "weights" if dims in weight_shapes else "other"] += (
        size * times)
  top = sorted(tally.copies, key=lambda c: -c[3] * c[4])[:10]
  written = {}
  for shape, size in tally.writes:
    written[shape] = written.get(shape, 0) + size
  return {
      "token_loop": loop.name, "copy_bytes_per_step": sum(c[3] * c[4] for c in tally.copies),
      "kv_copy_bytes_per_step": by["kv_cache"], "weight_copy_bytes_per_step": by["weights"],
      "other_copy_bytes_per_step": by["other"], "copies_per_step": sum(c[4] for c in tally.copies),
      "top_copies": [{"name": n, "kind": k, "shape": s, "bytes": b, "per_step": t,
                      "bytes_per_step": b * t} for n, k, s, b, t in top],
      "vocab_arrays_per_step": len(tally.vocab),
      # a conditional's smaller branch instead (the draw's rare sort fallback not taken)
      "vocab_arrays_common_path": len(common.vocab),
      "copy_bytes_common_path": sum(c[3] * c[4] for c in common.copies),
      "vocab_arrays": [f"{n}: {d}[{s}]" for n, (d, s) in tally.vocab],
      "written_bytes_per_step": sum(b for _, b in tally.writes),
      "score_bytes_per_step": sum(b for shape, b in written.items()
                                  if slots and _is_scores(shape, slots)),
      "top_writes": [{"shape": k, "bytes_per_step": v} for k, v in sorted(
          written.items(), key=lambda kv: -kv[1])[:8]], "notes": tally.notes}


def _is_scores(shape: str, slots: int) -> bool:
  """Whether ``dtype[d0,d1,...]`` has 3 or more axes, the last ``slots`` long."""
  dims = [int(x) for x in shape[shape.index("[") + 1:-1].split(",") if x]
  return len(dims) >= 3 and dims[-1] == slots


class Program(NamedTuple):
  hlo: str
  weight_bytes: int
  kv_bytes: int
  kv_shapes: set  # one layer's K and V (``squeezed``)
  weight_shapes: set  # each params leaf's, and one layer's of each stacked leaf
  lower_s: float
  compile_s: float
  layers: str  # "scan" or "unroll": ``config.layers`` resolved for the target
  slots: int  # the cache's length (``cache.cache_length``)
  decode_attention: str  # "pallas" or "einsum": ``attention.decode_path`` for the target


def gpu_layout(params=None) -> str:  # pylint: disable=unused-argument
  return "gpu"  # ``sampling.compile_platform`` while this script traces for target "cpu"


# XLA:GPU's description of an H100 SXM (its public properties), for a deviceless compile
H100_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 3352320000000 l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: 84929347584 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 7 }
runtime_version { major: 13 minor: 0 patch: 0 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""
CUDA_INSTALL = ("pip install jax-cuda13-plugin=={v} jax-cuda13-pjrt=={v} nvidia-cuda-nvcc "
                "nvidia-nvvm nvidia-cuda-runtime nvidia-nvjitlink")
TARGETS = ("cpu", "gpu", "tpu")


def target_device(target: str):
  """The device to compile for: None for "cpu" (this machine's), an H100 described to XLA:GPU
  for "gpu" (needs JAX's CUDA plugin, no GPU), one v5e chip for "tpu" (libtpu, no TPU)."""
  if target == "cpu":
    return None
  if target == "tpu":
    from ppojax.run import aot  # pylint: disable=import-outside-toplevel
    return aot.topology_devices("v5e:1x1")[0]
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  try:
    return topologies.get_topology_desc(platform="cuda", target_config=H100_TARGET,
                                        topology="1x1x1").devices[0]
  except Exception as e:  # no plugin: JAX's errors vary by version
    raise SystemExit(f"--target gpu compiles with XLA:GPU without a GPU, which needs JAX's "
                     f"CUDA plugin ({type(e).__name__}: {str(e).splitlines()[0]}): "
                     f"{CUDA_INSTALL.format(v=jax.__version__)}") from e


def compile_generate(cfg, batch: int, prompt: int, config, target: str = "cpu") -> Program:
  """``generate`` of ``cfg`` for [batch, prompt] prompts compiled for ``target`` (``TARGETS``,
  module docstring), every input abstract, the params in the decode layout as the suite passes
  them; "cpu" compiles this machine's back end in the GPU's decode layout."""
  device = target_device(target)
  mesh = None if device is None else jax.sharding.Mesh([device], ("data",))
  if target == "gpu":  # cuDNN's prefill attention needs the library; the token loop's is einsum
    cfg = cfg.replace(attention="einsum")

  def place(tree):  # on the target's device (this machine's without one)
    if mesh is None:
      return tree
    where = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where), tree)

  platform = sampling.compile_platform
  if target == "cpu":  # the layout and the draw as compiled for a GPU
    sampling.compile_platform = draw.compile_platform = gpu_layout
  try:
    found = {}

    def layout(p):
      found["module"], p = sampling.decode_layout(CausalLM(cfg), p, config.layers)
      return p
    params = place(jax.eval_shape(layout, place(jax.eval_shape(
        lambda: init_params(CausalLM(cfg), jax.random.key(0))))))
    module = found["module"]
    tokens = place(jax.ShapeDtypeStruct((batch, prompt), jnp.int32))
    mask = place(jax.ShapeDtypeStruct((batch, prompt), jnp.bool_))
    key = place(jax.eval_shape(lambda: jax.random.key(0)))
    # a new function, so no trace cached under another layout is reused
    program = jax.jit(functools.partial(sampling.generate.__wrapped__, module, config=config))
    with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
      t = time.perf_counter()
      lowered = program.lower(params, tokens, mask, key)
      lower_s, t = time.perf_counter() - t, time.perf_counter()
      hlo = lowered.compile().as_text()
      compile_s = time.perf_counter() - t
      # the cache as generate lays it out for the target (keys, length: cache.keys_transposed)
      slots = cache_length(module.cfg, prompt + config.max_new_tokens - 1)
      cache = jax.eval_shape(lambda: init_cache(module.cfg, batch, slots))
      path = "einsum" if keys_transposed(module.cfg) else "pallas"
  finally:
    sampling.compile_platform = draw.compile_platform = platform
  kv = jax.tree.leaves(cache)
  per_layer = {squeezed(x.shape[1:] if module.cfg.scan_layers else x.shape) for x in kv}
  leaves = jax.tree.leaves(params)
  weight_shapes = {squeezed(x.shape) for x in leaves} | {
      squeezed(x.shape[1:]) for x in leaves if x.ndim > 1 and x.shape[0] == module.cfg.num_layers}
  size = lambda xs: sum(x.size * x.dtype.itemsize for x in xs)
  return Program(hlo, size(leaves), size(kv), per_layer, weight_shapes, lower_s,
                 compile_s, "scan" if module.cfg.scan_layers else "unroll", slots, path)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", choices=tuple(MODELS), default="qwen2.5-0.5b")
  parser.add_argument("--small", action="store_true", help="--model small")
  parser.add_argument("--batch", type=int, default=256)
  parser.add_argument("--prompt", type=int, default=128)
  parser.add_argument("--new", type=int, default=512)
  parser.add_argument("--layers", choices=sampling.LAYERS, default="auto",
                      help="auto: as the target's platform resolves it (scan on TPU only)")
  parser.add_argument("--target", choices=TARGETS, default="cpu",
                      help="cpu: this CPU in the GPU's layout; gpu: XLA:GPU for an H100 "
                      "(JAX's CUDA plugin, no GPU); tpu: XLA:TPU for one v5e chip (libtpu)")
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--temperature", type=float, default=1.0)
  parser.add_argument("--top-p", type=float, default=1.0)
  parser.add_argument("--top-k", type=int, default=0)
  parser.add_argument("--greedy", action="store_true")
  parser.add_argument("--min-new-tokens", type=int, default=None,
                      help="stop tokens excluded before this many (default: --new, forced)")
  parser.add_argument("--check", action="store_true", help="exit 1 where a goal is missed")
  args = parser.parse_args(argv)
  name = "small" if args.small else args.model
  cfg = MODELS[name]().replace(dtype=args.dtype, param_dtype=args.dtype)
  config = sampling.SamplingConfig(
      max_new_tokens=args.new, stop_ids=(0,), pad_id=0, temperature=args.temperature,
      top_k=args.top_k, top_p=args.top_p, greedy=args.greedy, layers=args.layers,
      min_new_tokens=args.new if args.min_new_tokens is None else args.min_new_tokens)
  got = compile_generate(cfg, args.batch, args.prompt, config, args.target)
  report = analyse(got.hlo, args.batch, args.new, cfg.vocab_size, got.kv_shapes,
                   got.weight_shapes, got.slots)
  layer_copies = report["kv_copy_bytes_per_step"] + report["weight_copy_bytes_per_step"]
  fraction = layer_copies / (got.weight_bytes + got.kv_bytes)
  passed = fraction <= GOAL_FRACTION and report["vocab_arrays_per_step"] <= GOAL_VOCAB_ARRAYS
  print(json.dumps({
      "model": name, "target": args.target, "layers": got.layers, "dtype": args.dtype,
      "decode_attention": got.decode_attention, "cache_slots": got.slots,
      "batch": args.batch,
      "prompt": args.prompt, "new": args.new, "sampling": {
          k: getattr(config, k) for k in ("temperature", "top_k", "top_p", "greedy",
                                          "min_new_tokens")},
      "weight_bytes": got.weight_bytes, "kv_cache_bytes": got.kv_bytes,
      "weight_kv_copy_fraction": fraction,
      "copy_fraction": report["copy_bytes_per_step"] / (got.weight_bytes + got.kv_bytes),
      **report, "goals": {"weight_kv_copy_fraction": GOAL_FRACTION,
                          "vocab_arrays_per_step": GOAL_VOCAB_ARRAYS, "met": passed},
      "lower_s": got.lower_s, "compile_s": got.compile_s,
      "compiled_for": {"cpu": "this CPU (GPU decode layout)", "gpu": "XLA:GPU, H100",
                       "tpu": "XLA:TPU, v5e"}[args.target]}))
  return 0 if passed or not args.check else 1


if __name__ == "__main__":
  sys.exit(main())
