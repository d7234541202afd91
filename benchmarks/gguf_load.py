"""Seconds to read SmolLM2-135M-Instruct's GGUF header: the gguf package's ``GGUFReader``
against ``ppojax.models.gguf_file.read``, and a whole ``load_model("smollm2")`` (header,
dequantising, tokenizer, parameters), each the best of ``--repeats`` in this process:

Table: docs/performance/compiling.md, "Start-up".

    python benchmarks/gguf_load.py [--repeats 3]

The last line printed is a JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import gguf

from ppojax.models import gguf as gguf_lib
from ppojax.models import gguf_file, load_model


def _best(fn, repeats: int) -> float:
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return min(times)


def _load_uncached() -> None:
  gguf_lib._open.cache_clear()  # pylint: disable=protected-access
  load_model("smollm2")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()
  path = gguf_lib.fetch_smollm2()
  figures = {"gguf_reader_s": _best(lambda: gguf.GGUFReader(path), args.repeats),
             "gguf_file_read_s": _best(lambda: gguf_file.read(path), args.repeats),
             "load_model_s": _best(_load_uncached, args.repeats)}
  figures["header_speedup"] = figures["gguf_reader_s"] / figures["gguf_file_read_s"]
  print(json.dumps({"model": path.name, **{k: round(v, 3) for k, v in figures.items()}}))


if __name__ == "__main__":
  main()
