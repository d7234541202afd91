"""What the command lines share (``ppojax.train``, ``ppojax.sft``, ``ppojax.train_rm``,
``ppojax.preferences``, ``ppojax.aot``): a mistake in what the user gave is one message on
stderr, ``PROG: error: MESSAGE`` (what was wrong, what to do), and exit code 2 (a usage error);
a bug keeps Python's traceback and exit code 1.

Usage errors are

- flags absl cannot parse, a config file that does not load, an override of a config field
  that does not exist (``parse_flags``);
- the exceptions ppojax raises for bad input (``INPUT_ERRORS``: a config, data, checkpoint,
  model file or workdir that cannot be used), wherever they are raised: their messages are
  written for the user. ``UsageError`` is the command's own;
- ``OSError`` (a missing file, an unreachable hub id), ``ImportError`` (a function the config
  names, e.g. ``reward.fn``), ``ValueError`` and ``KeyError`` raised while the config, data and
  models are loaded: with one of the command's ``loaders`` on the stack (for ``ppojax.train``
  its config check and ``build.build``: everything before the first iteration). One raised
  outside ppojax's own code (jax, transformers, ...) may still be a bug: its message names its
  type and points at the traceback.

The same types raised anywhere else (in training, in writing results) are bugs: traceback.
``PPOJAX_DEBUG=1`` or ``--debug`` shows the traceback of a usage error too (exit code 1).

Every command but ``ppojax.aot`` keeps XLA's compiled programs in a persistent cache, so that a
rerun does not compile them again: ``--compile_cache=DIR`` (or ``PPOJAX_COMPILE_CACHE=DIR``),
``off`` to turn it off; by default ``JAX_COMPILATION_CACHE_DIR`` where set, else
``$XDG_CACHE_HOME/ppojax/xla`` (``ppojax.infra.compile.cache_dir``).
"""

from __future__ import annotations

import functools
import inspect
import os
import pathlib
import re
import sys
from collections.abc import Callable, Iterable
from typing import Any

from absl import app, flags

from ppojax.infra import compile as compile_lib

USAGE_EXIT = 2
# "module:Class": ppojax's exceptions for bad input; named, not imported (infra is the lowest
# layer), and only a module already imported can have raised one
INPUT_ERRORS = (
    "ppojax.run.checks:ConfigError",  # a config that cannot run
    "ppojax.data.records:DataError",  # bad or missing data
    "ppojax.run.resume:ResumeError",  # the workdir holds another run's checkpoint
    "ppojax.run.checkpoint:CheckpointMismatchError",  # ... of another model or optimizer
    "ppojax.models.hf:CheckpointError",  # a model directory that cannot be read
    "ppojax.models.gguf:GGUFError",  # a GGUF file that cannot be read
    "ppojax.models.gguf:ModelFetchError",  # a model that cannot be downloaded
    "ppojax.run.aot:AotError",  # a TPU topology that cannot be had here
    "ppojax.infra.files:DiskFullError",  # no space left for a checkpoint or the export
)
LOADING_ERRORS = (OSError, ImportError, ValueError, KeyError)
DEBUG_HINT = "PPOJAX_DEBUG=1 shows the traceback"
_PACKAGE = pathlib.Path(__file__).resolve().parents[1]  # ppojax/
# flag name -> the config file a command reads when its command line names none
DEFAULT_CONFIGS: dict[str, str] = {}


def shipped_config(name: str) -> str | None:
  """The clone's ``configs/NAME`` as an absolute path, so a command runs from any directory
  (``pip install -e .`` runs ppojax from the clone); None where ppojax was installed without its
  configs/."""
  path = _PACKAGE.parent / "configs" / name
  return str(path) if path.is_file() else None


def default_config(default: str, help_: str, name: str = "config") -> str:
  """The help of a CLI's ``config_flags.DEFINE_config_file(name, None, ...)`` flag, whose
  default, the clone's ``configs/DEFAULT``, ``parse_flags`` puts on a command line that names no
  config file. (A default given to ml_collections is loaded when the flag is defined, at import,
  and the overrides on the command line are looked up in it there: a misspelt ``--config.x`` was
  a traceback, not one message.) Without configs/ (not installed from a clone) the flag is
  required."""
  path = shipped_config(default)
  if not path:
    return help_
  DEFAULT_CONFIGS[name] = path
  return f"{help_} Without it: the clone's configs/{default}."


def _with_default_configs(argv: list[str]) -> list[str]:
  """argv with ``--NAME=PATH`` for each config flag of ``DEFAULT_CONFIGS`` it does not name."""
  named = {name for name, _ in _flag_values(argv[1:], list(DEFAULT_CONFIGS))}
  return argv[:1] + [f"--{name}={path}" for name, path in DEFAULT_CONFIGS.items()
                     if name not in named] + argv[1:]


DEBUG = flags.DEFINE_bool("debug", False,
                          "Show the traceback of a usage error (also: PPOJAX_DEBUG=1).")
COMPILE_CACHE = flags.DEFINE_string(
    "compile_cache", None, "Persistent XLA compilation cache: a directory, or 'off' (default: "
    "$PPOJAX_COMPILE_CACHE, $JAX_COMPILATION_CACHE_DIR, else $XDG_CACHE_HOME/ppojax/xla).")


class UsageError(Exception):
  """A mistake the command itself finds (e.g. stray arguments); the message is printed."""


def debug(argv: Iterable[str] | None = None) -> bool:
  """Whether usage errors show their traceback: ``PPOJAX_DEBUG`` set (not "0") or ``--debug``
  (looked for in ``argv`` while the flags are not parsed)."""
  if os.environ.get("PPOJAX_DEBUG", "0") not in ("", "0"):
    return True
  if flags.FLAGS.is_parsed():
    return DEBUG.value
  return any(a in ("--debug", "-debug", "--debug=true", "--debug=True", "--debug=1")
             for a in (sys.argv if argv is None else argv))


def input_errors() -> tuple[type[BaseException], ...]:
  """The classes of ``INPUT_ERRORS`` whose modules are imported, and ``UsageError``."""
  found = [UsageError]
  for name in INPUT_ERRORS:
    module, _, cls = name.partition(":")
    if module in sys.modules:
      found.append(getattr(sys.modules[module], cls))
  return tuple(found)


def usage_message(error: BaseException, loaders: Iterable[Callable] = ()) -> str | None:
  """The one message of a usage error (module docstring); None: a bug."""
  if isinstance(error, input_errors()):
    return _text(error)
  if isinstance(error, LOADING_ERRORS) and _raised_in(error, loaders):
    if _raised_by_ppojax(error):
      return _text(error)
    hint = "" if isinstance(error, OSError) else f" ({DEBUG_HINT})"
    return f"{type(error).__name__}: {_text(error)}{hint}"
  return None


def fail(prog: str, message: str) -> None:
  """Prints ``PROG: error: MESSAGE`` to stderr and exits with code 2."""
  sys.stdout.flush()
  print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
  sys.exit(USAGE_EXIT)


def run(main: Callable[[list[str]], Any], prog: str, loaders: Iterable[Callable] = (),
        configs: Iterable[Any] = (), compile_cache: bool = True) -> None:
  """``absl.app.run(main)`` with usage errors as one message (module docstring). ``loaders``:
  the functions that load the config, data and models; ``configs``: the holders of the
  ``config_flags`` flags, loaded while the flags are parsed; ``compile_cache``: whether the
  persistent compilation cache is on (``--compile_cache``)."""
  loaders, configs = tuple(loaders), tuple(configs)
  app.run(functools.partial(_guarded, main, prog, loaders, compile_cache),
          flags_parser=functools.partial(parse_flags, prog, configs))


def use_compile_cache() -> str | None:
  """Turns the persistent compilation cache on where ``--compile_cache`` and the environment
  say (``compile.cache_dir``), or off; returns the directory (None: off)."""
  where = compile_lib.cache_dir(COMPILE_CACHE.value)
  try:
    return compile_lib.use_cache(where)
  except OSError as e:
    raise UsageError(f"cannot use {where!r} as the compilation cache ({e.strerror or e}): give "
                     "another directory with --compile_cache=DIR, or --compile_cache=off") from e


def _guarded(main, prog: str, loaders: tuple, compile_cache: bool, argv: list[str]):
  try:
    if compile_cache:
      use_compile_cache()
    return main(argv)
  except Exception as e:  # pylint: disable=broad-except
    message = usage_message(e, loaders)
    if message is None or debug():
      raise
    fail(prog, message)


def parse_flags(prog: str, configs: tuple, argv: list[str]) -> list[str]:
  """absl's flag parsing, then each config file loaded; what fails is one message."""
  for holder in configs:  # its help says what naming none does, not "(default: 'None')"
    flags.FLAGS[holder.name].default_as_str = None
  try:
    rest = flags.FLAGS(_with_default_configs(argv))
    for holder in configs:
      error = _load_error(holder.value)
      if error is not None:
        raise error
    return rest
  except Exception as e:  # pylint: disable=broad-except
    message = _flag_message(e, argv, [h.name for h in configs])
    if message is None or debug(argv):
      raise
    fail(prog, message)


def _load_error(value) -> BaseException | None:
  """The error of a config file that did not load (ml_collections defers it to first use)."""
  if type(value).__name__ == "_ErrorConfig":
    return vars(value).get("_error") or OSError("the config file did not load")
  return None


def _flag_message(error: BaseException, argv: list[str], names: list[str]) -> str | None:
  if isinstance(error, flags.UnrecognizedFlagError):
    return f"{error} (--helpfull lists the flags)"
  if isinstance(error, flags.Error):
    flag, raised, trace = str(error).partition(": Error whilst parsing config file:")
    if not raised:
      return str(error)
    # get_config() raised (ml_collections puts the traceback in the message): its last line
    lines = [line.strip() for line in trace.splitlines() if line.strip()]
    where = [line for line in lines if line.startswith('File "')][-1:]
    return (f"{flag}: the config file raised {lines[-1] if lines else 'an error'} "
            f"({''.join(w + '; ' for w in where)}{DEBUG_HINT})")
  if isinstance(error, OSError):  # the config file did not load (ml_collections defers it)
    return _load_message(error, argv, names)
  if isinstance(error, (KeyError, AttributeError)):
    return _override_message(error, argv, names)
  return None


def _load_message(error: OSError, argv: list[str], names: list[str]) -> str:
  """A config file that is missing, or one that raised an OSError itself (a file it reads)."""
  if isinstance(error.__cause__, OSError):  # "Configuration is not available because of ..."
    error = error.__cause__
  lines = [line.strip() for line in str(error).splitlines() if line.strip()]
  text = lines[-1] if lines else str(error)
  for name, value in _flag_values(argv, names):
    path = value.split(":")[0]
    if os.path.isfile(path) and getattr(error, "filename", None) != path:
      return (f"flag --{name}={value}: the config file raised {type(error).__name__}: {text} "
              f"({DEBUG_HINT})")
  return f"cannot load the config file: {text}"


def _flag_values(argv: list[str], names: list[str]):
  """(name, value) of each ``--name=value`` or ``--name value`` in argv whose name is in names."""
  for i, arg in enumerate(argv):
    m = re.fullmatch(r"--?(\w+)(?:=(.*))?", arg)
    if m and m.group(1) in names:
      value = m.group(2) if m.group(2) is not None else next(iter(argv[i + 1:i + 2]), "")
      if value:
        yield m.group(1), value


def _override_message(error: BaseException, argv: list[str], names: list[str]) -> str | None:
  """``--config.a.b=v`` with no field a or a.b (ml_collections: "'b'\\nDid you mean "c"...")."""
  while error.args and isinstance(error.args[0], BaseException):  # AttributeError(KeyError)
    error = error.args[0]
  first, _, rest = str(error.args[0] if error.args else "").partition("\n")
  key = first.strip("'\" ")
  near = re.findall(r'Did you mean "([^"]+)"', rest)
  for arg in argv:
    m = re.match(r"--?(?:no)?(\w+)\.([\w.]+)", arg)
    if not m or m.group(1) not in names or key not in m.group(2).split("."):
      continue
    path = m.group(2).split(".")
    at = path.index(key)
    option = ".".join(path[:at + 1])
    renamed = getattr(sys.modules.get("ppojax.run.checks"), "RENAMED", {})
    if option in renamed:  # an option that has another name now
      return (f"config option {option} is now {renamed[option]}: "
              f"--{m.group(1)}.{renamed[option]}{m.group(2)[len(option):]}")
    hint = (f"; did you mean {'.'.join(path[:at] + near[:1])}?" if near else
            f": {'.'.join(path[:at]) or 'the config'} has no field {key}")
    return f"unknown config option {option} in --{m.group(1)}.{m.group(2)}{hint}"
  return None


def _text(error: BaseException) -> str:
  if isinstance(error, KeyError) and len(error.args) == 1 and isinstance(error.args[0], str):
    return error.args[0]
  return str(error) or type(error).__name__


def _frames(error: BaseException):
  tb = error.__traceback__
  while tb is not None:
    yield tb.tb_frame
    tb = tb.tb_next


def _raised_in(error: BaseException, loaders: Iterable[Callable]) -> bool:
  """Whether one of ``loaders`` is on the stack between the command and the raise."""
  codes = {inspect.unwrap(f).__code__ for f in loaders}
  return any(frame.f_code in codes for frame in _frames(error))


def _raised_by_ppojax(error: BaseException) -> bool:
  """Whether the innermost frame is ppojax's own code (a ``raise`` with a written message)."""
  frames = list(_frames(error))
  if not frames:
    return False
  path = pathlib.Path(frames[-1].f_code.co_filename).resolve()
  return path.is_relative_to(_PACKAGE)
