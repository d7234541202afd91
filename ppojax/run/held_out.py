"""A training run's held-out evaluations (``runner.run``): greedy completions of the task's
held-out prompts, scored by ``config.eval.metrics`` before training (also with each instruction
of ``eval.baselines``), every ``eval.every`` iterations and after; each phase is committed to
eval.json, and a resumed run does again the one a kill cut short.
"""

from __future__ import annotations

import json
import pathlib
import time

from ppojax.data import encoding
from ppojax.data import records as records_lib
from ppojax.infra import files, hostmem
from ppojax.learner import state as state_lib
from ppojax.models import lora
from ppojax.run import baselines, evaluation
from ppojax.run.build import Run, _import
from ppojax.run.reporting import METRICS_FILE
from ppojax.tasks import sources


def policy_model(r: Run, state) -> tuple:
  """(module, params) of the current policy as one plain model: with LoRA the base's
  architecture and the merged weights W + (α/r)·A·B (``lora.merge``), else the policy."""
  if state.base is None:
    return r.models.policy, state.actor
  merged = lora.merge(state_lib.policy_params(state.actor, state.base), r.models.policy.cfg)
  return r.models.reference, merged


def evaluate(r: Run, state, phase: str, workdir, writer, it: int, say=print,
             instruction: str | None = None) -> dict:
  """Greedy completions of the held-out prompts, scored by ``config.eval.metrics``; written to
  eval.json, eval_samples_{phase}.jsonl and the metrics (at iteration ``it``), and shown
  (``say``). ``phase``: "before", "after", "iteration_N" (``eval.every``) or "before_NAME"
  (``eval.baselines``: each prompt with ``instruction`` appended, ppojax/run/baselines.py)."""
  e = r.config.eval
  metrics = {name: _import(path) for name, path in e.metrics.items()}
  records, encode, tokenizer = r.source.eval_records, r.source.encode, r.policy.tokenizer
  length = baselines.eval_length(r.config, tokenizer, records)  # one program for all phases
  if instruction is None:
    encode = sources.padded(encode, length, encoding.pad_token_id(tokenizer))
  else:
    records, encode = baselines.instructed(r.config, tokenizer, records, instruction, length)
  scorer = None  # RLHF: the reward model's score (the proxy) beside the true metrics
  if r.models.reward is not None:
    scorer = evaluation.reward_model_scorer(r.models.reward, r.frozen.reward)
  t0 = time.perf_counter()
  summary, rows = evaluation.evaluate(
      *policy_model(r, state), records, encode,
      evaluation.greedy(r.sampling, e.max_new_tokens or None), r.policy.tokenizer, metrics,
      e.batch_size, e.group_by or None, r.config.data.field, scorer, r.env)
  shown = ", ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in summary.items())
  say(f"held-out eval {phase.replace('_', ' ')} ({len(rows)} prompts, "
      f"{time.perf_counter() - t0:.0f} s): {shown}")
  if writer:  # first: a run cut off before eval.json is written evaluates again (redo_cut_short)
    prefix = baselines.metric_prefix(phase)
    writer.write(it, {prefix + k.removeprefix("eval/"): v for k, v in summary.items()})
  if workdir:
    records_lib.write_jsonl(rows, workdir / f"eval_samples_{phase}.jsonl")
    evals = read_evals(workdir)
    evals[phase] = summary
    with files.atomic_write(workdir / "eval.json") as f:  # the commit: this phase is done
      f.write(json.dumps(evals, indent=1))
  hostmem.release()
  return summary


def read_evals(workdir) -> dict:
  """The phases eval.json holds (those done), by name; {} without one."""
  path = pathlib.Path(workdir) / "eval.json" if workdir else None
  return json.loads(path.read_text()) if path and path.exists() else {}


def redo_cut_short(workdir: pathlib.Path, config, start: int, evals: dict) -> None:
  """Drops from metrics.jsonl the rows of the evaluations due at iteration ``start`` that
  eval.json lacks (a kill after its metrics row, before eval.json): they are done again."""
  n = config.num_iterations
  phases = [(0, "before"), *((0, p) for p, _ in baselines.phases(config))]
  for it, phase in phases + ([(n, "after")] if n else []):  # n = 0: evaluation only
    if it == start and phase not in evals:
      drop_eval_rows(workdir / METRICS_FILE, [it], baselines.metric_prefix(phase))


def drop_eval_rows(path: pathlib.Path, steps: list[int], prefix: str = "eval/") -> None:
  """Removes the held-out evaluation rows at ``steps`` (those with a metric named
  ``prefix``...) from metrics.jsonl (atomically)."""
  if not steps or not path.exists():
    return
  lines = path.read_bytes().splitlines(keepends=True)
  keep = []
  for line in lines:
    try:
      row = json.loads(line)
    except ValueError:
      keep.append(line)  # not ours to judge: the writer's resume drops a partial last line
      continue
    if not (isinstance(row, dict) and row.get("step") in steps
            and any(k.startswith(prefix) for k in row)):
      keep.append(line)
  if len(keep) != len(lines):
    with files.atomic_write(path, "wb") as f:
      f.write(b"".join(keep))
