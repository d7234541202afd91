"""Graceful stops: the first SIGTERM / Ctrl-C ends a training run after the current iteration
(with a checkpoint); a second one aborts at once."""

from __future__ import annotations

import os
import signal
import sys
import threading


class StopSignals:
  """While active (a context manager, in the main thread): the first SIGTERM or SIGINT sets
  ``received`` (its name) for the training loop to stop at the end of the current iteration;
  a second one ends the process at once with exit code 128 + its number.

  Python runs signal handlers only between bytecodes, so during a long compiled call (a
  compile, a step) they would wait for it to return. Signals are therefore also written to a
  pipe (``signal.set_wakeup_fd``, done in C) and counted by a watcher thread, which sees the
  second signal and exits even while the main thread is blocked. The previous handlers and
  wakeup fd are restored on exit. Elsewhere than the main thread nothing is installed.
  """

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.received: str | None = None
    self._active = False

  def __enter__(self) -> StopSignals:
    if threading.current_thread() is not threading.main_thread():
      return self
    self._read, self._write = os.pipe()
    os.set_blocking(self._write, False)
    try:
      self._old_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
    except ValueError:  # e.g. an embedding that forbids it: no handlers then
      os.close(self._read)
      os.close(self._write)
      return self
    self._previous = {s: signal.getsignal(s) for s in self.SIGNALS}
    for s in self.SIGNALS:
      signal.signal(s, self._handle)
    self._count = 0
    self._thread = threading.Thread(target=self._watch, name="ppojax-signals", daemon=True)
    self._thread.start()
    self._active = True
    return self

  def _handle(self, signum, frame):  # pylint: disable=unused-argument
    """The Python-level handler: nothing to do, the watcher thread counts (the wakeup fd)."""

  def _watch(self) -> None:
    while True:
      try:
        data = os.read(self._read, 64)
      except OSError:
        return
      if not data:  # the write end was closed: __exit__
        return
      for signum in data:
        if signum not in self.SIGNALS:
          continue
        name = signal.Signals(signum).name
        self._count += 1
        if self._count == 1:
          self.received = name
          print(f"\n{name}: stopping after the current iteration with a checkpoint "
                f"({name} again aborts at once)", file=sys.stderr, flush=True)
        else:
          print(f"\n{name} again: aborting now, without a checkpoint", file=sys.stderr,
                flush=True)
          os._exit(128 + signum)  # pylint: disable=protected-access

  def __exit__(self, *exc) -> None:
    if not self._active:
      return
    self._active = False
    signal.set_wakeup_fd(self._old_fd)
    for s, handler in self._previous.items():
      signal.signal(s, handler if handler is not None else signal.SIG_DFL)
    os.close(self._write)
    self._thread.join(timeout=5)
    os.close(self._read)
