"""A multi-turn iteration against a single-turn one with the same tokens: the toy game in turns
traced into the step (configs/toy_turns.py: T turns of L policy tokens, each answered by O
environment tokens) and the toy task in one turn of T·(L + O) tokens, same model, prompts, batch
and PPO settings. Every turn runs its full L tokens and the single turn its full R (both by
``sampling.min_new_tokens``), so both iterations hold the same tokens: B rows of P + T·(L + O).

Table: docs/performance/cpu.md, "Multi-turn vs single-turn iteration:
`benchmarks/multiturn_step.py`".

    python benchmarks/multiturn_step.py [--turns 4 --turn-tokens 8 --obs-tokens 2]
        [--batch 64] [--width 256 --layers 4] [--runs 5] [--small]

The multi-turn iteration decodes T·L tokens and prefills each turn's L + O (its turn again and
the observation: ``multiturn.observe``) where the single turn decodes all T·(L + O); the
learner's passes are the same length. Prints one JSON line: seconds per iteration of each (the
median of ``--runs``, the two alternated after one warm-up each), tokens per second, their
ratio, and the machine.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import jax

from ppojax.run import build as build_lib
from ppojax.run import runner

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from algorithms import machine  # noqa: E402

_TOY_TURNS = pathlib.Path(__file__).resolve().parents[1] / "configs" / "toy_turns.py"


def configs(a) -> dict:
  """The two configs: "multi_turn" and "single_turn"."""
  tiny = dict(vocab_size=16, hidden_size=a.width, intermediate_size=4 * a.width,
              num_layers=a.layers,
              num_heads=max(1, a.width // 64), num_kv_heads=max(1, a.width // 128),
              max_position_embeddings=512)
  common = dict(rl__batch_size=a.batch, num_iterations=a.runs + 1, sample_every=0,
                model__tiny=tiny, rl__num_minibatches=2, rl__num_epochs=1)
  turns = build_lib.load_config(
      _TOY_TURNS, env__max_turns=a.turns, env__obs_tokens=a.obs_tokens,
      sampling__max_new_tokens=a.turn_tokens, sampling__min_new_tokens=a.turn_tokens, **common)
  total = a.turns * (a.turn_tokens + a.obs_tokens)
  single = build_lib.load_config(
      _TOY_TURNS, env__name="", reward__kind="jax",
      reward__fn="ppojax.tasks.count:count_reward", sampling__max_new_tokens=total,
      sampling__min_new_tokens=total, **common)
  return {"multi_turn": turns, "single_turn": single}


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--turns", type=int, default=4)
  p.add_argument("--turn-tokens", type=int, default=8)
  p.add_argument("--obs-tokens", type=int, default=2)  # count_turns answers with 2 tokens
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--width", type=int, default=256)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--runs", type=int, default=5)
  p.add_argument("--small", action="store_true", help="a quick check: width 64, 2 layers")
  a = p.parse_args(argv)
  if a.small:
    a.width, a.layers, a.batch, a.runs = 64, 2, 16, 2
  runs = {name: build_lib.build(c) for name, c in configs(a).items()}
  states, times = {}, {name: [] for name in runs}
  for name, r in runs.items():  # warm-up: the compile, then nothing is timed
    states[name] = runner.iteration(r, r.state, r.source.batch(0).prompts)[0]
  for i in range(a.runs):
    for name, r in runs.items():
      t0 = time.perf_counter()
      states[name], metrics, _, _ = runner.iteration(r, states[name],
                                                     r.source.batch(i + 1).prompts)
      jax.block_until_ready(states[name].step)
      times[name].append(time.perf_counter() - t0)
  prompt_len = runs["single_turn"].source.batch(0).prompts.tokens.shape[1]
  tokens = a.batch * (prompt_len + a.turns * (a.turn_tokens + a.obs_tokens))
  med = {name: statistics.median(t) for name, t in times.items()}
  out = {"bench": "multiturn_step", "turns": a.turns, "turn_tokens": a.turn_tokens,
         "obs_tokens": a.obs_tokens, "batch": a.batch, "width": a.width, "layers": a.layers,
         "tokens_per_iteration": tokens,
         **{f"{n}_s": round(v, 4) for n, v in med.items()},
         **{f"{n}_tokens_per_s": round(tokens / v, 1) for n, v in med.items()},
         "multi_over_single_time": round(med["multi_turn"] / med["single_turn"], 3),
         "runs": a.runs, **machine()}
  print(json.dumps(out))


if __name__ == "__main__":
  main()
