"""Environments for multi-turn rollouts (``rollout.multiturn``; docs/multiturn.md).

``make_env(config, tokenizer)`` builds the one ``config.env.name`` names: a traced environment
of this package ("count_turns", "guess_number") or any "module:factory" whose
``factory(config, tokenizer)`` returns a ``TokenEnv``; "" (one turn): None.
"""

from __future__ import annotations

import importlib

from ppojax.envs import count_turns, guess_number

TRACED = {"count_turns": count_turns.make, "guess_number": guess_number.make}


def make_env(config, tokenizer=None):
  """The run's traced environment, or None for single-turn rollouts."""
  name = config.get("env", {}).get("name", "")
  if not name:
    return None
  if name in TRACED:
    return TRACED[name](config, tokenizer)
  if ":" not in name:
    raise ValueError(f"env.name={name!r} is not known: choose one of {', '.join(TRACED)}, or "
                     "give 'module:factory' (factory(config, tokenizer) -> a TokenEnv)")
  module, _, attr = name.partition(":")
  return getattr(importlib.import_module(module), attr)(config, tokenizer)
