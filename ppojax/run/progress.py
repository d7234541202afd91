"""The training loops' progress: ``tqdm``'s bar on a terminal, plain lines in a log
(``Progress``), for ``runner.run``, the supervised stages' ``fit`` and the classic runner.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, TextIO


def _short_name(key: str) -> str:
  """The last path component of a metric name: ``objective/kl`` -> ``kl``."""
  return key.rsplit("/", 1)[-1]


def _is_tty(stream: Any) -> bool:
  try:
    return bool(stream.isatty())
  except (AttributeError, ValueError, OSError):
    return False


# One progress line in a log file: no bar, no carriage return, tqdm's fields.
LOG_FORMAT = "{n_fmt}/{total_fmt} {percentage:3.0f}% [{elapsed}<{remaining}, {rate_fmt}{postfix}]"


class Progress:
  """The training loops' progress: ``tqdm``'s bar on a terminal, plain lines elsewhere.

  On a TTY it is a ``tqdm`` bar (redrawn in place) with rate, ETA and the metrics given to
  :meth:`update`; on any other stream (a log file, a CI console) each :meth:`update` writes one
  line in tqdm's own format, without a bar or carriage returns::

    12/100  12% [00:37<04:32,  3.10s/it, scores=0.512, kl=0.0131]

  Rate and ETA count only the steps done since ``start`` (tqdm's ``initial``), so a run resumed
  at step ``start`` gets a sane ETA; they average over all those steps (the first one includes
  compilation). :meth:`write` prints a message above the bar without breaking it.
  """

  def __init__(self, total: int, start: int = 0, stream: TextIO | None = None, *,
               clock: Callable[[], float] = time.monotonic):
    if total <= 0:
      raise ValueError(f"Progress total must be positive, got total={total}")
    from tqdm import tqdm  # pylint: disable=import-outside-toplevel
    self._tqdm = tqdm
    self.total, self.start = int(total), int(start)
    self.stream = sys.stderr if stream is None else stream
    self._clock = clock
    self._t0 = clock()
    self._postfix = ""
    self._bar = (tqdm(total=self.total, initial=self.start, file=self.stream, unit="it",
                      dynamic_ncols=True, smoothing=0.0, mininterval=0.0)
                 if _is_tty(self.stream) else None)

  @staticmethod
  def _format_metrics(metrics: dict[str, float]) -> str:
    return ", ".join(f"{_short_name(k)}={float(v):.4g}" for k, v in metrics.items())

  def update(self, step: int, metrics: dict[str, float] | None = None) -> None:
    """Shows progress at ``step``. Without ``metrics`` the last metrics given are shown again."""
    if metrics is not None:
      self._postfix = self._format_metrics(metrics)
    if self._bar is not None:
      self._bar.set_postfix_str(self._postfix, refresh=False)
      self._bar.update(step - self._bar.n)
      return
    line = self._tqdm.format_meter(step, self.total, self._clock() - self._t0,
                                   initial=self.start, postfix=self._postfix or None, unit="it",
                                   bar_format=LOG_FORMAT)
    self.stream.write(line + "\n")
    self.stream.flush()

  def write(self, text: str) -> None:
    """Prints ``text`` (to stdout) without breaking the bar."""
    if self._bar is not None:
      self._tqdm.write(text, file=sys.stdout)
    else:
      print(text, flush=True)

  def close(self) -> None:
    """Ends the bar's line. Idempotent."""
    if self._bar is not None:
      self._bar.close()

  def __enter__(self) -> Progress:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
