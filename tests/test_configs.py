"""Every config file in configs/ loads, and the PPO ones pass ``build_lib.validate``, set only options
that ``ppojax.run.config.defaults()`` documents (a typo would silently add a new field) and name
reward / metric functions that import and take the trl-style arguments. No model is loaded."""

from __future__ import annotations

import inspect
import pathlib

import ml_collections
import pytest

from ppojax.run import build as build_lib
from ppojax.run import checks as checks_lib
from ppojax.run.config import defaults

ROOT = pathlib.Path(__file__).parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.py"))
COMMANDS = {"rl": "ppojax.train", "sft": "ppojax.sft", "rm": "ppojax.train_rm",
            "classic": "ppojax.train"}


def _kind(config) -> str:
  if "rl" in config:
    return "rl"
  if "classic" in config:  # configs/cartpole.py: checked by tests/test_classic.py
    return "classic"
  return "rm" if config.optim.head_lr_factor != 1.0 else "sft"  # a head trained from zero


def _keys(node: ml_collections.ConfigDict, prefix: str = "") -> set[str]:
  """Dotted names of every field; a section of the user's names (config.FREE_FORM: eval.metrics,
  eval.baselines, data.rg.options) is one leaf."""
  out = set()
  for name, value in node.items():
    key = prefix + name
    if isinstance(value, ml_collections.ConfigDict) and key not in checks_lib.FREE_FORM:
      out |= _keys(value, key + ".")
    else:
      out.add(key)
  return out


# the columns a task's records carry that its functions need (besides prompts, completions)
COLUMNS = {"arith": ("answer",), "calc": ("answer",), "file": ("answer",), "guess_number": (),
           "reasoning_gym": ("answer", "entry", "rg_dataset", "rg_options", "rg_extract")}


def _check_text_fn(path: str, what: str, task: str) -> None:
  fn = build_lib._import(path)
  assert callable(fn), f"{what}={path!r} is not callable"
  try:  # the trl signature: fn(prompts, completions, **columns) with the task's columns
    inspect.signature(fn).bind(prompts=[], completions=[], **dict.fromkeys(COLUMNS[task], []))
  except TypeError as e:
    raise AssertionError(f"{what}={path!r} does not take (prompts, completions, **columns): "
                         f"{e}") from e


def test_there_are_configs_of_every_kind():
  names = {p.stem for p in CONFIGS}
  assert {"toy", "quickstart", "qwen2_5_arith", "llama3_2_rm", "gpt2_file", "sft_arith",
          "rm_arith", "grpo_arith", "dr_grpo_arith", "rloo_arith", "reinforce_pp_arith",
          "rg_chain_sum", "rg_gsm_symbolic"} <= names
  from ppojax.core import algorithms  # pylint: disable=import-outside-toplevel
  for name in set(algorithms.ALGORITHMS) - {"ppo"}:  # one config per critic-free algorithm
    assert build_lib.load_config(ROOT / "configs" / f"{name}_arith.py").algorithm == name


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_loads_and_its_docstring_shows_its_command(path):
  text = path.read_text()
  config = build_lib.load_config(path)
  command = f"python -m {COMMANDS[_kind(config)]} --config configs/{path.name}"
  assert command in " ".join(text.split()), f"{path.name}: the docstring should show {command}"


PPO_CONFIGS = [p for p in CONFIGS if "rl" in build_lib.load_config(p)]


@pytest.mark.parametrize("path", PPO_CONFIGS, ids=[p.stem for p in PPO_CONFIGS])
def test_ppo_config_validates_and_its_functions_import(path):
  config = build_lib.load_config(path)
  build_lib.validate(config)
  unknown = _keys(config) - _keys(defaults())
  assert not unknown, f"{path.name} sets options that defaults() does not have: {unknown}"
  kind = config.reward.kind
  if kind == "model":
    assert config.model.reward, f"{path.name}: reward.kind='model' needs model.reward"
  elif kind == "text":
    _check_text_fn(config.reward.fn, "reward.fn", config.data.task)
  else:
    assert callable(build_lib._import(config.reward.fn))
  if config.data.task in COLUMNS:
    for name, fn in config.eval.metrics.items():
      _check_text_fn(fn, f"eval.metrics.{name}", config.data.task)
  if "accuracy" in config.eval.metrics:  # an evaluation table: the untrained model instructed
    assert config.eval.baselines, f"{path.name}: set eval.baselines (docs/learning.md)"
  # every field can be overridden as on the command line, e.g. a local model directory
  local = build_lib.load_config(path, model__policy="/models/mine", rl__batch_size=16)
  assert local.model.policy == "/models/mine" and local.rl.batch_size == 16


@pytest.mark.parametrize("name, policy, reward, task", [
    ("qwen2_5_arith", "Qwen/Qwen2.5-0.5B-Instruct", "text", "arith"),
    ("llama3_2_rm", "meta-llama/Llama-3.2-1B-Instruct", "model", "file"),
    ("gpt2_file", "openai-community/gpt2", "text", "file"),
])
def test_hugging_face_configs(name, policy, reward, task):
  c = build_lib.load_config(ROOT / "configs" / f"{name}.py")
  assert (c.model.policy, c.reward.kind, c.data.task) == (policy, reward, task)
  assert c.sampling.stop_ids, "the stop tokens of a real checkpoint are set explicitly"
  assert c.sampling.pad_id is not None
  if name == "llama3_2_rm":
    assert c.model.critic_init == "reward" and c.model.reward and c.data.path
    assert 128009 in c.sampling.stop_ids  # <|eot_id|> ends an assistant turn
  if name == "gpt2_file":
    assert not c.data.chat_template and c.data.path
    assert 50256 in c.sampling.stop_ids  # <|endoftext|>
  if name == "qwen2_5_arith":
    assert c.model.dtype == "bfloat16" and 151645 in c.sampling.stop_ids  # <|im_end|>
