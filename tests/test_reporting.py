"""Tests for ppojax.run.progress (the progress bar) and ppojax.run.reporting (metric/sample
logs, samples table, curve plots)."""

from __future__ import annotations

import io
import json
import math
import os
import struct
import sys
import time
import types

import numpy as np
import pytest

from ppojax.run.progress import Progress
from ppojax.run.reporting import (
  MetricWriter,
  format_samples_table,
  plot_curves,
  read_metrics,
)


class FakeClock:
  """A clock the test moves by hand."""

  def __init__(self, t: float = 1000.0):
    self.t = t

  def __call__(self) -> float:
    return self.t


class TTYStringIO(io.StringIO):

  def isatty(self) -> bool:
    return True


# ---------------------------------------------------------------------------------------------
# Progress.


def test_progress_log_line_has_count_elapsed_eta_rate_and_metrics():
  clock, out = FakeClock(), io.StringIO()
  bar = Progress(100, stream=out, clock=clock)
  clock.t += 12 * 3.1  # 3.1 s per step, 88 steps left: 272.8 s -> 04:32.
  bar.update(12, {"objective/scores": 0.5123456, "objective/kl": 0.0131234})
  assert out.getvalue() == "12/100  12% [00:37<04:32,  3.10s/it, scores=0.5123, kl=0.01312]\n"
  clock.t += 88 * 3.1 + 3 * 3600  # Slower now: hours in the ETA.
  bar.update(50)
  per_it = (100 * 3.1 + 3 * 3600) / 50  # 222.2 s per step, 50 steps left: 3h05m10s
  assert out.getvalue().splitlines()[-1] == (
      f"50/100  50% [3:05:10<3:05:10, {per_it:.2f}s/it, scores=0.5123, kl=0.01312]")


def test_progress_resumed_start_gives_eta_from_steps_done_since_start():
  clock, out = FakeClock(), io.StringIO()
  bar = Progress(100, start=50, stream=out, clock=clock)
  clock.t += 10.0
  bar.update(60)  # 10 steps in 10 s since the resume: 1 step/s, 40 steps left.
  assert out.getvalue() == "60/100  60% [00:10<00:40,  1.00it/s]\n"


def test_progress_before_first_step_has_no_rate():
  out = io.StringIO()
  Progress(100, start=20, stream=out, clock=FakeClock()).update(20)
  assert out.getvalue() == "20/100  20% [00:00<?, ?it/s]\n"


def test_progress_non_tty_one_plain_line_per_update():
  clock, out = FakeClock(), io.StringIO()
  bar = Progress(4, stream=out, clock=clock)
  for step in range(1, 5):
    clock.t += 0.5
    bar.update(step, {"objective/scores": 0.5, "loss/value_avg": np.float32(12345.678),
                      "entropy": float("nan")})
  bar.close()
  bar.close()  # Idempotent.
  lines = out.getvalue().split("\n")
  assert lines[-1] == "" and len(lines) == 5 and "\r" not in out.getvalue()
  assert lines[0] == "1/4  25% [00:00<00:01,  2.00it/s, scores=0.5, value_avg=1.235e+04, entropy=nan]"
  assert lines[3].startswith("4/4 100% [00:02<00:00,  2.00it/s, ")


def test_progress_keeps_last_metrics_when_none_given():
  out = io.StringIO()
  bar = Progress(10, stream=out, clock=FakeClock())
  bar.update(1, {"a/x": 1.0})
  bar.update(2)
  assert out.getvalue().splitlines()[1].endswith(", x=1]")


def test_progress_on_a_tty_is_a_tqdm_bar_redrawn_in_place(capsys):
  out = TTYStringIO()
  bar = Progress(10, stream=out)
  bar.update(1, {"objective/kl": 0.123456})
  bar.update(2, {})
  bar.write("samples at iteration 2")  # above the bar, on stdout
  bar.close()
  text = out.getvalue()
  assert "\r" in text and text.count("\n") <= 2  # redrawn, not one line per update
  assert " 2/10 [" in text and "kl=0.1235" in text and "|" in text  # tqdm's bar and fields
  assert "samples at iteration 2" in capsys.readouterr().out


def test_progress_rejects_bad_total():
  with pytest.raises(ValueError, match="total"):
    Progress(0, stream=io.StringIO())


# ---------------------------------------------------------------------------------------------
# TensorBoard event files, read without TensorBoard: TFRecord framing + tensorboardX's protos.


def _read_events(path: str) -> list:
  from tensorboardX.proto import event_pb2  # pylint: disable=import-outside-toplevel
  from tensorboardX.record_writer import masked_crc32c  # pylint: disable=import-outside-toplevel
  data, events, i = open(path, "rb").read(), [], 0
  while i < len(data):
    header = data[i:i + 8]
    (n,) = struct.unpack("<Q", header)
    assert struct.unpack("<I", data[i + 8:i + 12])[0] == masked_crc32c(header)
    payload = data[i + 12:i + 12 + n]
    assert struct.unpack("<I", data[i + 12 + n:i + 16 + n])[0] == masked_crc32c(payload)
    events.append(event_pb2.Event.FromString(payload))
    i += 16 + n
  assert i == len(data)
  return events


def _event_files(workdir) -> list[str]:
  d = os.path.join(workdir, "tensorboard")
  return sorted(os.path.join(d, f) for f in os.listdir(d) if ".tfevents." in f)


def _scalars(events) -> dict[tuple[str, int], float]:
  return {(v.tag, e.step): v.simple_value for e in events if e.HasField("summary")
          for v in e.summary.value if v.WhichOneof("value") == "simple_value"}


# ---------------------------------------------------------------------------------------------
# MetricWriter.


def _strict_loads(line: str):
  def reject(name):
    raise ValueError(f"non-standard JSON constant {name}")
  return json.loads(line, parse_constant=reject)


def test_metric_writer_jsonl_round_trip(tmp_path):
  rows = [{"objective/kl": 0.5, "objective/scores": np.float32(0.1), "count": np.int64(7)},
          {"objective/kl": 0.25, "objective/scores": 2.0, "count": 3}]
  with MetricWriter(str(tmp_path), tensorboard=False) as w:
    w.write(1, rows[0])
    w.write(2, rows[1])
    # Flushed at once: readable before close.
    assert len(read_metrics(str(tmp_path / "metrics.jsonl"))) == 2
  got = read_metrics(str(tmp_path / "metrics.jsonl"))
  assert got == [{"step": 1, "objective/kl": 0.5, "objective/scores": float(np.float32(0.1)),
                  "count": 7},
                 {"step": 2, "objective/kl": 0.25, "objective/scores": 2.0, "count": 3}]
  assert type(got[0]["objective/scores"]) is float and type(got[0]["count"]) is int
  assert not os.path.exists(tmp_path / "tensorboard")


def test_metric_writer_nonfinite_values_are_standard_json(tmp_path):
  with MetricWriter(str(tmp_path), tensorboard=False) as w:
    w.write(1, {"a": float("nan"), "b": float("inf"), "c": -np.inf, "d": np.float32("nan")})
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert [_strict_loads(ln) for ln in lines] == [
      {"step": 1, "a": "nan", "b": "inf", "c": "-inf", "d": "nan"}]
  (row,) = read_metrics(str(tmp_path / "metrics.jsonl"))
  assert math.isnan(row["a"]) and row["b"] == math.inf and row["c"] == -math.inf
  assert math.isnan(row["d"])


def test_metric_writer_rejects_step_key_and_arrays(tmp_path):
  with MetricWriter(str(tmp_path), tensorboard=False) as w:
    with pytest.raises(ValueError, match="'step'"):
      w.write(1, {"step": 3.0})
    with pytest.raises(ValueError, match="scalar"):
      w.write(1, {"x": np.zeros(3)})


def _wait_until_larger(path: str, size: int, deadline_s: float = 20.0) -> int:
  """tensorboardX writes events from a background thread (flushed every 2 s here): waits until
  the file outgrows ``size``, and returns the new size (``size`` itself if it never did)."""
  end = time.monotonic() + deadline_s
  while os.path.getsize(path) <= size and time.monotonic() < end:
    time.sleep(0.05)
  return os.path.getsize(path)


def test_metric_writer_tensorboard_scalars(tmp_path):
  w = MetricWriter(str(tmp_path))
  (path,) = _event_files(tmp_path)
  size0 = os.path.getsize(path)  # 0, or the file-version header once flushed.
  w.write(5, {"objective/kl": 0.25, "objective/scores": -1.5})
  size1 = _wait_until_larger(path, size0)
  assert size0 < size1  # Written while the writer is still open.
  w.write(6, {"objective/kl": 0.125, "objective/scores": float("nan")})
  w.close()
  assert os.path.getsize(path) > size1  # close writes out what is still queued.
  scalars = _scalars(_read_events(path))
  assert scalars[("objective/kl", 5)] == 0.25 and scalars[("objective/kl", 6)] == 0.125
  assert scalars[("objective/scores", 5)] == -1.5
  assert math.isnan(scalars[("objective/scores", 6)])


def test_metric_writer_resume_truncates_to_checkpoint_step(tmp_path):
  full, resumed = tmp_path / "full", tmp_path / "resumed"

  def metrics(step):
    return {"objective/kl": step / 7, "objective/scores": float("nan") if step == 2 else step}

  def samples(step):
    return [{"prompt": f"p{step}", "response": "r\nr", "score": step / 3}]

  with MetricWriter(str(full)) as w:  # An uninterrupted run.
    for step in range(1, 7):
      w.write(step, metrics(step))
      w.write_samples(step, samples(step))
  with MetricWriter(str(resumed)) as w:  # Checkpoint at 3, interrupted after 5, mid-write.
    for step in range(1, 6):
      w.write(step, metrics(step))
      w.write_samples(step, samples(step))
  with open(resumed / "metrics.jsonl", "a") as f:
    f.write('{"step": 6, "objective/k')
  before = (resumed / "metrics.jsonl").read_bytes().splitlines(keepends=True)
  assert len(before) == 6

  w = MetricWriter(str(resumed), resume_step=3)
  after = (resumed / "metrics.jsonl").read_bytes()
  assert after == b"".join(before[:3])  # Rows <= 3 byte-identical, later ones dropped.
  assert [r["step"] for r in read_metrics(str(resumed / "samples.jsonl"))] == [1, 2, 3]
  assert not [f for f in os.listdir(resumed) if f.endswith(".tmp")]
  for step in range(4, 7):
    w.write(step, metrics(step))
    w.write_samples(step, samples(step))
  w.close()
  for name in ("metrics.jsonl", "samples.jsonl"):
    assert (resumed / name).read_bytes() == (full / name).read_bytes()
  # TensorBoard: the new event file starts with a purge marker at step 4 (hides steps >= 4 of the
  # interrupted run) and holds the rewritten steps.
  files = [_read_events(p) for p in _event_files(resumed)]
  assert len(files) == 2
  (first,) = [f for f in files if not any(e.HasField("session_log") for e in f)]
  (second,) = [f for f in files if any(e.HasField("session_log") for e in f)]
  assert [e.step for e in second if e.HasField("session_log")] == [4]
  assert sorted(s for (tag, s) in _scalars(second) if tag == "objective/kl") == [4, 5, 6]
  assert sorted(s for (tag, s) in _scalars(first) if tag == "objective/kl") == [1, 2, 3, 4, 5]


def test_metric_writer_resume_without_files_and_plain_append(tmp_path):
  w = MetricWriter(str(tmp_path), tensorboard=False, resume_step=10)
  w.write(11, {"a": 1.0})
  w.close()
  w = MetricWriter(str(tmp_path), tensorboard=False)  # No resume: appends.
  w.write(12, {"a": 2.0})
  w.close()
  assert [r["step"] for r in read_metrics(str(tmp_path / "metrics.jsonl"))] == [11, 12]


def test_metric_writer_resume_rejects_corrupt_middle_line(tmp_path):
  (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
  with pytest.raises(ValueError, match="metrics.jsonl:2"):
    MetricWriter(str(tmp_path), tensorboard=False, resume_step=1)


def test_metric_writer_wandb_missing_raises_clear_import_error(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError.
  with pytest.raises(ImportError, match=r"wandb_project='proj' was set but wandb is not "
                     r"installed: pip install wandb, or unset it"):
    MetricWriter(str(tmp_path / "run"), tensorboard=False, wandb_project="proj")
  assert not os.path.exists(tmp_path / "run")  # Fails before touching anything.
  # Without a project wandb is never imported.
  MetricWriter(str(tmp_path / "run"), tensorboard=False).close()


def test_metric_writer_logs_to_wandb(tmp_path, monkeypatch):
  calls = []

  class Run:

    def log(self, metrics, step):
      calls.append(("log", metrics, step))

    def finish(self):
      calls.append(("finish",))

  def init(**kwargs):
    calls.append(("init", kwargs))
    return Run()

  monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
  w = MetricWriter(str(tmp_path), tensorboard=False, wandb_project="proj",
                   wandb_config={"lr": 1e-5})
  w.write(3, {"objective/kl": np.float32(0.5)})
  w.close()
  assert calls == [("init", {"project": "proj", "config": {"lr": 1e-5}, "dir": str(tmp_path)}),
                   ("log", {"objective/kl": 0.5}, 3), ("finish",)]


def test_write_samples_jsonl_and_tensorboard_text(tmp_path):
  rows = [{"prompt": "2+2=", "response": "4\nDone", "score": 1.0},
          {"prompt": "héllo", "response": "x", "score": np.float32(-0.5)}]
  with MetricWriter(str(tmp_path)) as w:
    w.write_samples(7, rows)
  lines = (tmp_path / "samples.jsonl").read_text(encoding="utf-8").splitlines()
  assert [_strict_loads(ln) for ln in lines] == [
      {"step": 7, "prompt": "2+2=", "response": "4\nDone", "score": 1.0},
      {"step": 7, "prompt": "héllo", "response": "x", "score": -0.5}]
  (path,) = _event_files(tmp_path)
  texts = [(v.tag, e.step, v.tensor.string_val[0].decode()) for e in _read_events(path)
           if e.HasField("summary") for v in e.summary.value if v.tag.startswith("samples")]
  assert len(texts) == 1 and texts[0][1] == 7
  assert texts[0][2] == "\n".join("    " + ln for ln in format_samples_table(rows).split("\n"))


# ---------------------------------------------------------------------------------------------
# format_samples_table.


def test_format_samples_table_layout():
  table = format_samples_table([{"prompt": "Q: 2+2?\nA:", "response": "4", "score": 1.0},
                                {"prompt": "hi", "response": "hello\r\nthere", "score": -0.25}])
  assert table.split("\n") == [
      "score | prompt     | response",
      "------+------------+------------",
      "    1 | Q: 2+2?⏎A: | 4",
      "-0.25 | hi         | hello⏎there",
  ]


def test_format_samples_table_cuts_long_text_explicitly():
  long = "system header " * 3 + "What is 2?"  # chat prompts differ at their end
  table = format_samples_table([{"prompt": long, "response": "ab\ncdefgh", "score": 0.5}],
                               max_chars=8)
  row = table.split("\n")[2]
  assert row == "  0.5 | …t is 2? | ab⏎cdef…"
  assert format_samples_table([{"prompt": "x" * 8, "response": "", "score": 0}], 8).split(
      "\n")[2] == "    0 | xxxxxxxx |"  # Exactly max_chars: not cut.
  with pytest.raises(ValueError, match="max_chars"):
    format_samples_table([], max_chars=0)


def test_format_samples_table_empty():
  assert format_samples_table([]) == "score | prompt | response\n------+--------+---------"


# ---------------------------------------------------------------------------------------------
# plot_curves.


def _metrics_file(tmp_path, rows) -> str:
  path = tmp_path / "metrics.jsonl"
  with MetricWriter(str(tmp_path), tensorboard=False) as w:
    for step, row in rows:
      w.write(step, row)
  return str(path)


def test_plot_curves_writes_png_and_returns_keys(tmp_path):
  path = _metrics_file(tmp_path, [(s, {"objective/scores": s / 10, "objective/kl": 0.01 * s,
                                       "loss/x": 1.0}) for s in range(1, 6)]
                       + [(6, {"objective/kl": float("nan")})])
  out = tmp_path / "plots" / "curves.png"
  out.parent.mkdir()
  keys = plot_curves(path, str(out))
  assert keys == ["objective/scores", "objective/kl"]  # objective/entropy_masked is absent.
  data = out.read_bytes()
  assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
  assert os.listdir(out.parent) == ["curves.png"]  # No temp file left behind.
  assert plot_curves(path, str(out), keys=("loss/x",)) == ["loss/x"]


def test_plot_curves_raises_when_no_key_present(tmp_path):
  path = _metrics_file(tmp_path, [(1, {"loss/x": 1.0})])
  out = tmp_path / "curves.png"
  with pytest.raises(ValueError,
                     match=r"none of the keys .*objective/kl.* keys there: \['loss/x'\]"):
    plot_curves(path, str(out))
  assert not out.exists()
  assert [f for f in os.listdir(tmp_path) if f.endswith(".png")] == []

