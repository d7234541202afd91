"""Environments for multi-turn rollouts (``rollout.multiturn``; docs/multiturn.md).

``make_env(config, tokenizer)`` builds the one ``config.env.name`` names: a traced environment
of this package ("count_turns", "guess_number"), "tools" (``env.tools`` on the host, ``tools``),
or any "module:factory" whose ``factory(config, tokenizer, sampling)`` returns a ``TokenEnv`` or
a host environment (``rollout.host_turns.HostEnv``, marked ``on_host = True``); "" (one turn):
None.
"""

from __future__ import annotations

import importlib

from ppojax.data.turns import end_of_turn
from ppojax.envs import count_turns, guess_number, tools

TRACED = {"count_turns": count_turns.make, "guess_number": guess_number.make}


def _import(path: str):
  module, _, attr = path.strip().partition(":")
  if not attr:
    raise ValueError(f"{path!r} is not 'module:name'")
  return getattr(importlib.import_module(module), attr)


def make_tools(config, tokenizer, sampling) -> tools.ToolEnv:
  """``env.name = "tools"``: the functions ``env.tools`` names ("module:fn,module:fn"), called
  in ``env.tool_format``'s syntax, their results framed by the tokenizer's chat template."""
  if tokenizer is None:
    raise ValueError("env.name='tools' needs the policy's tokenizer (model.tokenizer)")
  e, d = config.env, config.data
  fns = [_import(p) for p in e.tools.split(",") if p.strip()]
  if not fns:
    raise ValueError("env.name='tools' needs env.tools, e.g. "
                     "'ppojax.envs.calculator:calculate'")
  end = end_of_turn(tokenizer, sampling.stop_ids)
  return tools.ToolEnv({fn.__name__: fn for fn in fns}, tokenizer, e.max_turns, e.obs_tokens,
                       e.tool_format, end, chat_template=d.chat_template,
                       chat_template_kwargs=d.get("chat_template_kwargs"))


def make_env(config, tokenizer=None, sampling=None):
  """The run's environment, or None for single-turn rollouts. ``sampling``: the run's
  resolved ``SamplingConfig`` (its stop ids end the policy's turns, its pad id fills)."""
  name = config.get("env", {}).get("name", "")
  if not name:
    return None
  if name in TRACED:
    return TRACED[name](config, tokenizer, sampling)
  if name == "tools":
    return make_tools(config, tokenizer, sampling)
  if ":" not in name:
    raise ValueError(f"env.name={name!r} is not known: choose one of {', '.join(TRACED)}, "
                     "tools, or give 'module:factory' (factory(config, tokenizer, sampling) -> an "
                     "environment)")
  return _import(name)(config, tokenizer, sampling)
