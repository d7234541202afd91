"""What the peers' benchmark sides share; it measures nothing itself.

Table: none of its own; the peer harnesses beside it (``trl_ppo.py``, ``tunix_ppo.py`` and, through
them, the GRPO sides) fill the rows of docs/performance/peers.md.

Standard library only: it is imported inside the trl and tunix environments as well as ppojax's.
It holds their virtual environments under the ppojax cache, created on first use, the PPO sides'
common options, the process's peak resident set and the check that every response has the
requested length."""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import venv
from pathlib import Path


def cache_dir(name: str) -> Path:
  """``$PPOJAX_CACHE/NAME`` (default ``~/.cache/ppojax/NAME``)."""
  return Path(os.environ.get("PPOJAX_CACHE", Path.home() / ".cache" / "ppojax")) / name


def ensure_env(directory: Path, requirements: tuple[str, ...], peer: str, skip: str) -> Path:
  """The Python of a virtual environment in ``directory`` with ``requirements`` installed,
  created on first use (minutes of downloads); a marker file records a complete install, and a
  failed one is redone. ``peer`` and ``skip`` (the flag that runs without it) name it in
  messages."""
  directory = Path(directory)
  python = directory / "bin" / "python"
  marker = directory / "ppojax-requirements.txt"
  wanted = "\n".join(requirements)
  if python.exists() and marker.exists() and marker.read_text() == wanted:
    return python
  print(f"creating a {peer} environment in {directory}: {' '.join(requirements)}", flush=True)
  venv.create(directory, with_pip=True, clear=True)
  pip = subprocess.run([str(python), "-m", "pip", "install", "--quiet", *requirements],
                       check=False)
  if pip.returncode:
    raise RuntimeError(f"could not install {' '.join(requirements)} into {directory} "
                       f"(pip exit code {pip.returncode}; PyPI must be reachable once); "
                       f"{skip} runs without {peer}")
  marker.write_text(wanted)  # only after a complete install: a failed one is redone
  return python


def peak_rss_mb(field: str = "VmHWM") -> float:
  """VmHWM (or another field, e.g. VmRSS) of /proc/self/status in MiB, as
  ``ppojax.infra.hostmem.peak_rss_mb`` (which the peers' environments cannot import): ``ru_maxrss``
  would count the parent's resident set at the fork."""
  with open("/proc/self/status", encoding="ascii") as f:
    return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def ppo_arguments(description: str) -> argparse.ArgumentParser:
  """The PPO iteration's options common to ``trl_ppo.py`` and ``tunix_ppo.py``."""
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument("--policy", required=True)
  parser.add_argument("--reward", required=True)
  parser.add_argument("--prompts", required=True, help="JSON list of token-id lists")
  parser.add_argument("--response-length", type=int, default=32)
  parser.add_argument("--iterations", type=int, default=3)
  parser.add_argument("--warmup", type=int, default=1)
  parser.add_argument("--lr", type=float, default=3e-6)
  return parser


def check_lengths(lengths, expected: int, who: str) -> None:
  """Raises ``RuntimeError`` unless every one of ``lengths`` (one per response, in tokens) is
  ``expected``: the benchmarks compare the work of exactly ``expected`` new tokens per row, so a
  shorter or longer response makes a comparison void. The message names ``who``, the expected
  length, and each length found with how many responses had it."""
  lengths = [int(n) for n in lengths]
  if not lengths:
    raise RuntimeError(f"{who}: no responses to check (expected {expected} tokens each)")
  wrong = [n for n in lengths if n != expected]
  if wrong:
    found = ", ".join(f"{n} tokens × {k}" for n, k in sorted(collections.Counter(lengths).items()))
    raise RuntimeError(f"{who}: {len(wrong)} of {len(lengths)} responses are not {expected} "
                       f"tokens long (expected {expected} each; found {found})")
