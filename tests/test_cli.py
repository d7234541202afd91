"""The command lines' face (ppojax/infra/cli.py): a bad option, config value or model path is
one line on stderr, ``PROG: error: MESSAGE``, exit code 2, no traceback and no resolved config;
``PPOJAX_DEBUG=1`` or ``--debug`` shows the traceback. Each command fails before any model loads
or anything trains (a few seconds each)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from ppojax.infra import cli
from ppojax.run.config import defaults

ROOT = pathlib.Path(__file__).parents[1]
# the RL section of the config ("ppo" before its rename to "rl")
RL = "rl" if "rl" in defaults() else "ppo"


def _run(module: str, *args: str, cwd: pathlib.Path = ROOT,
         **env: str) -> subprocess.CompletedProcess:
  environ = {k: v for k, v in os.environ.items() if k != "PPOJAX_DEBUG"}
  environ.update(JAX_PLATFORMS="cpu", **env)
  return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=environ,
                        capture_output=True, text=True, timeout=120, check=False)


def _assert_usage_error(result: subprocess.CompletedProcess, prog: str, message: str) -> None:
  """Exit code 2, stderr one line ``PROG: error: ...message...``, nothing on stdout."""
  output = result.stdout + result.stderr
  assert result.returncode == 2, output[-3000:]
  assert "Traceback" not in output
  lines = [line for line in result.stderr.splitlines() if line.strip()]
  assert len(lines) == 1, result.stderr
  assert lines[0].startswith(f"{prog}: error: ") and message in lines[0], lines[0]
  assert result.stdout == ""  # the resolved config is printed only once it is valid


def test_train_a_bad_config_value_is_one_message():
  result = _run("ppojax.train", "--config", "configs/toy.py", f"--config.{RL}.clip_eps=2")
  _assert_usage_error(result, "ppojax.train", f"{RL}.clip_eps=2.0 must be in (0, 1)")


@pytest.mark.parametrize("args,message", [
    ([f"--config.{RL}.clp_eps=1"],
     f"unknown config option {RL}.clp_eps in --config.{RL}.clp_eps; did you mean {RL}.clip_eps?"),
    (["--config.no_such_section.x=1"], "unknown config option no_such_section in"),
    ([f"--config.{RL}.clip_eps=abc"], "could not convert string to float: 'abc'"),
    (["--no_such_flag=1"], "Unknown command line flag 'no_such_flag'"),
    (["stray"], "unexpected arguments: stray"),
])
def test_train_a_bad_flag_is_one_message(args, message):
  _assert_usage_error(_run("ppojax.train", "--config", "configs/toy.py", *args), "ppojax.train",
                      message)


def test_train_a_missing_config_file_is_one_message():
  result = _run("ppojax.train", "--config", "configs/no_such_config.py")
  _assert_usage_error(result, "ppojax.train", "cannot load the config file: [Errno 2] No such "
                      "file or directory: 'configs/no_such_config.py'")


def test_a_config_file_that_raises_is_one_message(tmp_path):
  path = tmp_path / "raises.py"
  path.write_text('def get_config():\n  raise ValueError("no such preset")\n')
  _assert_usage_error(_run("ppojax.train", "--config", str(path)), "ppojax.train",
                      f"flag --config={path}: the config file raised ValueError: no such preset "
                      f'(File "{path}", line 2, in get_config; {cli.DEBUG_HINT})')


@pytest.mark.parametrize("override", [[], [f"--config.{RL}.clip_eps=0.1"]])
def test_a_config_file_that_reads_a_missing_file_is_named_as_the_one_that_raised(tmp_path,
                                                                                   override):
  """The config file exists; a file it reads does not (ml_collections defers that OSError and,
  once an override touches the config, rewraps it as "Configuration is not available ...")."""
  path = tmp_path / "mine.py"
  missing = tmp_path / "quickstart.py"
  path.write_text(f"import runpy\ndef get_config():\n  return runpy.run_path({str(missing)!r})\n")
  _assert_usage_error(_run("ppojax.train", f"--config={path}", *override), "ppojax.train",
                      f"flag --config={path}: the config file raised FileNotFoundError: [Errno 2] "
                      f"No such file or directory: '{missing}' ({cli.DEBUG_HINT})")


def test_debug_shows_the_traceback():
  for env, flag in (({"PPOJAX_DEBUG": "1"}, []), ({}, ["--debug"])):
    result = _run("ppojax.train", "--config", "configs/toy.py", f"--config.{RL}.clip_eps=2",
                  *flag, **env)
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "ConfigError: " in result.stderr
    assert f"{RL}.clip_eps=2.0 must be in (0, 1)" in result.stderr


@pytest.mark.parametrize("module", ["ppojax.sft", "ppojax.supervised.sft"])
def test_sft_a_bad_config_value_is_one_message(module):
  result = _run(module, "--config", "configs/sft_arith.py", "--config.train.aggregation=bogus")
  _assert_usage_error(result, "ppojax.sft", "train.aggregation='bogus' is not one of "
                      "'token_mean'")


@pytest.mark.parametrize("option, message", [
    ("train.batch_size=0", "train.batch_size=0 must be an integer >= 1"),
    ("train.grad_accum=3", "train.batch_size=16 is not a multiple of train.grad_accum=3"),
    ("optim.lr=-1", "optim.lr=-1.0 must be > 0")])
def test_supervised_ranges_are_checked_before_any_model_loads(option, message):
  result = _run("ppojax.sft", "--config", "configs/sft_arith.py", f"--config.{option}")
  _assert_usage_error(result, "ppojax.sft", message)


def test_train_rm_a_misspelt_option_is_one_message():
  result = _run("ppojax.train_rm", "--config", "configs/rm_arith.py", "--config.model.init=tiny",
                "--config.train.batch_sz=4")
  _assert_usage_error(result, "ppojax.train_rm",
                      "unknown config option train.batch_sz in --config.train.batch_sz; did you "
                      "mean train.batch_size?")


def test_preferences_a_bad_option_or_model_path_is_one_message(tmp_path):
  common = ["--config", "configs/rlhf_arith.py", f"--out={tmp_path / 'pairs.jsonl'}"]
  _assert_usage_error(_run("ppojax.preferences", *common, "--samples=0"), "ppojax.preferences",
                      "flag --samples=0: 0 is not a positive integer")
  missing = tmp_path / "no_policy"
  result = _run("ppojax.supervised.preferences", *common, f"--config.model.policy={missing}")
  _assert_usage_error(result, "ppojax.preferences",
                      f"model.policy: {missing} is not a model directory (nothing is there)")
  assert not (tmp_path / "pairs.jsonl").exists()


def test_aot_a_bad_option_is_one_message():
  _assert_usage_error(_run("ppojax.aot", "--topology", "v5e:2x2"), "ppojax.aot",
                      "flag --config=None: Flag --config must have a value other than None.")
  result = _run("ppojax.run.aot", "--config=configs/scale.py:tiny", f"--config.{RL}.clp_eps=1")
  _assert_usage_error(result, "ppojax.aot", f"did you mean {RL}.clip_eps?")
  result = _run("ppojax.aot", "--config=configs/scale.py:tiny", "--compile_cache=/tmp/cache")
  _assert_usage_error(result, "ppojax.aot", "--compile_cache has no effect here")


# ---------------------------------------------------------------------------------------------
# Which exceptions are usage errors (in process)
# ---------------------------------------------------------------------------------------------


def _loader(error: Exception):
  raise error


def _caught(fn, *args) -> Exception:
  try:
    fn(*args)
  except Exception as e:  # noqa: BLE001  pylint: disable=broad-except
    return e
  raise AssertionError("no exception")


def test_the_input_errors_name_exception_classes():
  import importlib  # pylint: disable=import-outside-toplevel
  for name in cli.INPUT_ERRORS:
    module, _, cls = name.partition(":")
    assert issubclass(getattr(importlib.import_module(module), cls), Exception), name
  assert len(cli.input_errors()) == len(cli.INPUT_ERRORS) + 1  # and cli.UsageError


def test_builtin_errors_are_usage_errors_only_while_loading():
  from ppojax.run import checks  # pylint: disable=import-outside-toplevel
  config_error = _caught(_loader, checks.ConfigError("rl.x=1 must be 0"))
  assert cli.usage_message(config_error) == "rl.x=1 must be 0"  # wherever raised
  bug = _caught(_loader, ValueError("shapes (2,) and (3,) differ"))
  assert cli.usage_message(bug) is None  # not while loading: a bug, with its traceback
  # while loading: raised here, outside ppojax: the type and a pointer to the traceback
  assert cli.usage_message(bug, loaders=[_loader]) == (
      f"ValueError: shapes (2,) and (3,) differ ({cli.DEBUG_HINT})")
  missing = _caught(open, "/no/such/file")
  assert cli.usage_message(_caught(_loader, missing), loaders=[_loader]).startswith(
      "FileNotFoundError: [Errno 2] No such file or directory")
  assert cli.usage_message(_caught(_loader, RuntimeError("x")), loaders=[_loader]) is None


def test_sft_a_missing_init_names_its_option_and_where_a_relative_path_is_read(tmp_path):
  result = _run("ppojax.sft", "--config", str(ROOT / "configs" / "sft_arith.py"),
                "--config.model.init=runs/sft/no_such_policy", cwd=tmp_path)
  # (sft prints the resolved config before it loads the model)
  assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
  assert result.stderr.strip().splitlines()[-1] == (
      "ppojax.sft: error: model.init: runs/sft/no_such_policy is not a model directory (nothing "
      f"is there; a relative path is read from {tmp_path})")


@pytest.mark.parametrize("module, option", [("ppojax.train", f"{RL}.clp_eps"),
                                            ("ppojax.sft", "train.batch_sz")])
def test_the_default_config_loads_from_any_directory(tmp_path, module, option):
  """Without --config, a command reads the clone's configs/ (an absolute default): from another
  directory an override of it is checked as at the root (ml_collections raised a traceback on
  the relative default there)."""
  result = _run(module, f"--config.{option}=1", cwd=tmp_path)
  _assert_usage_error(result, module, f"unknown config option {option} in --config.{option}")


def test_help_says_what_a_missing_config_means_not_its_none_default():
  """``--help`` gives the config flag's own words (the default file), not absl's rendering of
  the flag's placeholder default, ``(default: 'None')``."""
  result = _run("ppojax.train", "--help")  # (absl's help exits with 1)
  assert "Without it: the clone's configs/toy.py." in result.stdout
  assert "'None'" not in result.stdout, result.stdout


def test_a_hub_id_that_cannot_be_fetched_is_one_line(tmp_path):
  """A name that could be a hub id ("owner/name") and is no directory here: huggingface_hub's
  error (a failed connection here, several lines) is folded into the one message."""
  result = _run("ppojax.preferences", "--config", "configs/rlhf_arith.py",
                f"--out={tmp_path / 'pairs.jsonl'}", "--config.model.policy=nobody/no_such_model")
  _assert_usage_error(result, "ppojax.preferences", "model.policy: 'nobody/no_such_model' is not "
                      "a local directory and could not be downloaded from the Hugging Face Hub")
