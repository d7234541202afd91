"""What the training CLI reports: metric logs, sample tables and curve plots (the progress bar:
ppojax/run/progress.py).

Plain Python and NumPy; the back ends (``tensorboardX``, ``wandb``, ``matplotlib``) are imported
only when used.

Files written under a run's ``workdir``:

  metrics.jsonl   one JSON object per logged step: ``{"step": 12, "objective/kl": 0.013, ...}``
  samples.jsonl   one JSON object per sample: ``{"step": 12, "prompt": ..., "response": ...}``
  tensorboard/    TensorBoard event files (scalars, and the samples table as text)

Non-finite floats are written as the JSON *strings* ``"nan"``, ``"inf"`` and ``"-inf"``, so every
line is standard JSON (no bare ``NaN`` tokens) and nothing is lost: :func:`read_metrics` turns
them back into floats.
"""

from __future__ import annotations

import json
import math
import os
import sys
import uuid
from typing import Any, Iterable

import numpy as np

from ppojax.infra import files

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
TENSORBOARD_DIR = "tensorboard"

_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


# ---------------------------------------------------------------------------------------------
# JSON lines.


def _number(key: str, value: Any) -> int | float:
  """A metric value (Python, NumPy or JAX scalar) as a Python int or float."""
  a = np.asarray(value)
  if a.shape != ():
    raise ValueError(f"metric {key!r} must be a scalar, got an array of shape {a.shape}")
  if a.dtype.kind in "iub":
    return int(a)
  return float(a)


def _jsonable(value: Any) -> Any:
  """Non-finite floats as the strings "nan"/"inf"/"-inf"; other values unchanged."""
  if isinstance(value, float) and not math.isfinite(value):
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
  return value


def _dumps(row: dict[str, Any]) -> str:
  return json.dumps({k: _jsonable(v) for k, v in row.items()}, ensure_ascii=False,
                    allow_nan=False)


def _ends_with_newline(path: str) -> bool:
  with open(path, "rb") as f:
    f.seek(0, os.SEEK_END)
    if f.tell() == 0:
      return True
    f.seek(-1, os.SEEK_END)
    return f.read(1) == b"\n"


def _truncate_jsonl(path: str, max_step: int | None) -> None:
  """Drops the rows of a JSONL file with ``step > max_step`` and an unterminated last line (a
  write cut off by a crash); the kept lines stay byte-identical. Rewrites only if needed."""
  if not os.path.exists(path):
    return
  if max_step is None and _ends_with_newline(path):
    return
  with open(path, "rb") as f:
    lines = f.read().splitlines(keepends=True)
  kept = []
  for i, line in enumerate(lines, 1):
    if not line.endswith(b"\n"):
      continue  # Only the last line can lack its newline: a partial write.
    if max_step is None or not line.strip():
      kept.append(line)
      continue
    try:
      row = json.loads(line)
    except ValueError as e:
      raise ValueError(f"{path}:{i} is not a JSON line ({e}); fix or remove it to resume") from e
    if not (isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] > max_step):
      kept.append(line)
  if len(kept) != len(lines):
    with files.atomic_write(path, "wb") as f:
      f.write(b"".join(kept))


def read_metrics(path: str) -> list[dict]:
  """Reads a ``metrics.jsonl`` back: one dict per line, ``"nan"``/``"inf"``/``"-inf"`` strings
  turned back into floats. An unterminated, unparsable last line (a write in progress) is
  skipped; any other bad line raises ``ValueError``."""
  with open(path, encoding="utf-8") as f:
    text = f.read()
  lines = text.split("\n")
  rows = []
  for i, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
    except ValueError as e:
      if i == len(lines):  # Last piece, no newline after it: a row still being written.
        continue
      raise ValueError(f"{path}:{i} is not a JSON line: {e}") from e
    rows.append({k: _NONFINITE.get(v, v) if isinstance(v, str) else v for k, v in row.items()})
  return rows


# ---------------------------------------------------------------------------------------------
# Metric writer.


def _import_wandb(project: str):
  try:
    import wandb  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError(f"wandb_project={project!r} was set but wandb is not installed: "
                      "pip install wandb, or unset it") from e
  return wandb


def _tensorboard_writer():
  """tensorboardX's ``SummaryWriter``, imported without PyTorch where PyTorch is not loaded yet:
  tensorboardX imports torch where it is installed only to accept torch tensors (1.7 s of a
  command's start-up; ppojax logs Python floats)."""
  if "torch" in sys.modules or "tensorboardX" in sys.modules:
    from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
    return SummaryWriter
  sys.modules["torch"] = None  # ``import torch`` raises ImportError: tensorboardX goes without
  try:
    from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
  finally:
    del sys.modules["torch"]
  return SummaryWriter


class MetricWriter:
  """Writes metrics to ``workdir/metrics.jsonl``, TensorBoard and (optionally) Weights & Biases.

  Args:
    workdir: the run's directory; created if missing.
    tensorboard: also write TensorBoard event files under ``workdir/tensorboard``.
    wandb_project: log to this W&B project too (needs ``pip install wandb``). ``wandb`` is
      imported only when this is set; ``wandb_config`` is ignored otherwise.
    wandb_config: the run config shown in W&B.
    resume_step: the step of the checkpoint a run resumes from. Rows with a larger step, written
      by the interrupted run after that checkpoint, are dropped from ``metrics.jsonl`` and
      ``samples.jsonl`` (atomic rewrite; earlier rows stay byte-identical) and hidden in
      TensorBoard (``purge_step``), so the files match those of an uninterrupted run.
  """

  def __init__(self, workdir: str, *, tensorboard: bool = True, wandb_project: str | None = None,
               wandb_config: dict | None = None, resume_step: int | None = None):
    wandb = _import_wandb(wandb_project) if wandb_project is not None else None
    SummaryWriter = _tensorboard_writer() if tensorboard else None
    self.workdir = os.fspath(workdir)
    os.makedirs(self.workdir, exist_ok=True)
    self.metrics_path = os.path.join(self.workdir, METRICS_FILE)
    self.samples_path = os.path.join(self.workdir, SAMPLES_FILE)
    _truncate_jsonl(self.metrics_path, resume_step)
    _truncate_jsonl(self.samples_path, resume_step)
    self._metrics_file = open(self.metrics_path, "a", encoding="utf-8")
    self._samples_file = None  # Opened on the first write_samples.
    self._tb = None
    if tensorboard:
      self._tb = SummaryWriter(
          os.path.join(self.workdir, TENSORBOARD_DIR),
          purge_step=None if resume_step is None else resume_step + 1,
          # Event file names carry only whole seconds: a unique suffix stops two writers opened
          # in the same second from overwriting each other's file.
          filename_suffix=f".{uuid.uuid4().hex[:8]}",
          # tensorboardX writes events from a background thread, flushing every flush_secs.
          flush_secs=2)
    self._wandb_run = None
    if wandb is not None:
      self._wandb_run = wandb.init(project=wandb_project, config=wandb_config, dir=self.workdir)

  def write(self, step: int, metrics: dict[str, float]) -> None:
    """Logs ``metrics`` at ``step`` to every sink. The JSONL line is flushed at once; TensorBoard
    events reach the disk within about 2 s (tensorboardX's writer thread), or at ``close``."""
    if "step" in metrics:
      raise ValueError("metrics must not contain a 'step' key: it is the row's step column")
    step = int(step)
    values = {k: _number(k, v) for k, v in metrics.items()}
    self._metrics_file.write(_dumps({"step": step, **values}) + "\n")
    self._metrics_file.flush()
    if self._tb is not None:
      for k, v in values.items():
        self._tb.add_scalar(k, v, step)
    if self._wandb_run is not None:
      self._wandb_run.log(values, step=step)

  def write_samples(self, step: int, rows: list[dict]) -> None:
    """Appends ``{"step": step, **row}`` lines to ``samples.jsonl`` and the rows' table to
    TensorBoard text (tag ``samples``)."""
    step = int(step)
    if self._samples_file is None:
      self._samples_file = open(self.samples_path, "a", encoding="utf-8")
    for row in rows:
      clean = {k: (_number(k, v) if _is_numeric(v) else v) for k, v in row.items()}
      self._samples_file.write(_dumps({"step": step, **clean}) + "\n")
    self._samples_file.flush()
    if self._tb is not None:
      # Indented 4 spaces: a Markdown code block, so TensorBoard keeps the columns aligned.
      table = format_samples_table(rows)
      self._tb.add_text("samples", "\n".join("    " + ln for ln in table.split("\n")), step)

  def close(self) -> None:
    """Flushes and closes every sink. Idempotent."""
    for f in (self._metrics_file, self._samples_file):
      if f is not None and not f.closed:
        f.close()
    if self._tb is not None:
      self._tb.close()
      self._tb = None
    if self._wandb_run is not None:
      self._wandb_run.finish()
      self._wandb_run = None

  def __enter__(self) -> MetricWriter:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _is_numeric(value: Any) -> bool:
  """Python/NumPy/JAX numbers, bools excluded."""
  if isinstance(value, (bool, np.bool_, str)):
    return False
  return isinstance(value, (int, float, np.number)) or hasattr(value, "__array__")


# ---------------------------------------------------------------------------------------------
# Samples table.


def _cell(text: Any, max_chars: int, keep_end: bool = False) -> str:
  """One line of at most ``max_chars``: newlines shown as ⏎, tabs as ⇥, a cut marked by …
  (at the end; at the start with ``keep_end``)."""
  s = str(text).replace("\r\n", "⏎").replace("\n", "⏎").replace("\r", "⏎").replace("\t", "⇥")
  if len(s) > max_chars:
    s = "…" + s[len(s) - max_chars + 1:] if keep_end else s[:max_chars - 1] + "…"
  return s


def _score_cell(score: Any) -> str:
  if score is None:
    return ""
  if _is_numeric(score):
    return f"{float(np.asarray(score)):.4g}"
  return str(score)


def format_samples_table(rows: list[dict], max_chars: int = 80) -> str:
  """A plain-text table of samples with columns ``score | prompt | response``.

  Newlines show as ``⏎`` (tabs as ``⇥``), so each sample takes one line; texts longer than
  ``max_chars`` are cut to ``max_chars`` characters: a response keeps its beginning (the last
  character shown is ``…``), a prompt its end, where chat prompts differ (the first is ``…``).
  """
  if max_chars < 1:
    raise ValueError(f"max_chars must be at least 1, got {max_chars}")
  cells = [(_score_cell(r.get("score")), _cell(r.get("prompt", ""), max_chars, keep_end=True),
            _cell(r.get("response", ""), max_chars)) for r in rows]
  header = ("score", "prompt", "response")
  w_score = max([len(header[0])] + [len(c[0]) for c in cells])
  w_prompt = max([len(header[1])] + [len(c[1]) for c in cells])
  w_resp = max([len(header[2])] + [len(c[2]) for c in cells])

  def line(score: str, prompt: str, response: str) -> str:
    return f"{score:>{w_score}} | {prompt:<{w_prompt}} | {response}".rstrip()

  out = [line(*header), "-" * w_score + "-+-" + "-" * w_prompt + "-+-" + "-" * w_resp]
  out += [line(*c) for c in cells]
  return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# Curves.


def plot_curves(metrics_path: str, out_path: str,
                keys: Iterable[str] = ("objective/scores", "objective/kl",
                                       "objective/entropy_masked")) -> list[str]:
  """Plots each of ``keys`` found in a ``metrics.jsonl`` against step, one subplot per key, to
  a PNG at ``out_path`` (written atomically). Returns the keys plotted."""
  # pylint: disable=import-outside-toplevel
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  rows = read_metrics(metrics_path)
  keys = list(keys)
  present = [k for k in keys if any(r.get(k) is not None and "step" in r for r in rows)]
  if not present:
    available = sorted({k for r in rows for k in r} - {"step"})
    raise ValueError(f"none of the keys {keys} is in {metrics_path} ({len(rows)} rows); "
                     f"keys there: {available}")

  # An explicit Agg canvas: renders without a display and leaves pyplot's backend alone.
  fig = Figure(figsize=(7, 2.4 * len(present)), layout="constrained")
  FigureCanvasAgg(fig)
  axes = fig.subplots(len(present), 1, sharex=True, squeeze=False)[:, 0]
  for ax, key in zip(axes, present):
    points = sorted((r["step"], float(r[key])) for r in rows
                    if r.get(key) is not None and "step" in r)
    ax.plot([p[0] for p in points], [p[1] for p in points], marker="." if len(points) < 50 else "")
    ax.set_title(key)
    ax.grid(alpha=0.3)
  axes[-1].set_xlabel("step")

  with files.atomic_write(out_path, "wb") as f:
    fig.savefig(f, format="png", dpi=100)
  return present


def score_line(history: list[dict], num_iterations: int, log_every: int) -> str:
  """"score: 0.918 -> 0.915 (iterations 142-150, logged every 10)": the mean score of the first
  and last logged rows, and ``log_every`` where iterations went unlogged, between them or after
  the last (a run stopped by a signal between two logged iterations ends on an earlier one)."""
  first, last = history[0]["objective/scores"], history[-1]["objective/scores"]
  a, b = history[0]["iteration"], history[-1]["iteration"]
  span = f"iterations {a}-{b}" if a != b else f"iteration {a}"
  unlogged = b - a + 1 > len(history) or b != num_iterations
  every = f", logged every {log_every}" if log_every > 1 and unlogged else ""
  return f"score: {first:.3f} -> {last:.3f} ({span}{every})"
