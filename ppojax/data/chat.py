"""Prompts through a tokenizer's chat template: the messages of a prompt, the template's own
variables (``data.chat_template_kwargs``: Qwen3's ``enable_thinking``), a system message folded
into the first user turn where the template has no system role (Gemma's), and the prefix every
rendered prompt begins with (``template_prefix``: the shared prefix of a batch).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ppojax.data.records import DataError


def _messages(prompt: str | list[dict], system: str | None) -> list[dict]:
  """Chat messages for a prompt: a string becomes one user message; ``system`` is prepended
  when given and the prompt has no system message of its own."""
  if isinstance(prompt, str):
    messages = [{"role": "user", "content": prompt}]
  elif isinstance(prompt, list):
    messages = [dict(m) for m in prompt]
  else:
    raise DataError(f"a prompt must be a string or a list of chat messages, got "
                    f"{type(prompt).__name__}")
  if system is not None and not any(m.get("role") == "system" for m in messages):
    messages.insert(0, {"role": "system", "content": system})
  return messages


def plain_ids(ids: Any) -> list[int]:
  """A flat list of ints from whatever ``apply_chat_template`` returned (list, array, dict /
  BatchEncoding with "input_ids", or a batch of one)."""
  if isinstance(ids, Mapping) or hasattr(ids, "input_ids"):
    ids = ids["input_ids"]
  if hasattr(ids, "tolist"):
    ids = ids.tolist()
  ids = list(ids)
  if len(ids) == 1 and isinstance(ids[0], (list, tuple)):
    ids = list(ids[0])
  return [int(t) for t in ids]


def prompt_ids(tokenizer, prompt: str | list[dict], *, system: str | None = None,
               chat_template: bool = True, chat_template_kwargs: Mapping | None = None
               ) -> list[int]:
  """Token ids of a prompt: through the chat template with the generation prompt appended, or
  (``chat_template=False``) the raw text with the tokenizer's special tokens.

  ``chat_template_kwargs`` (``data.chat_template_kwargs``) reach the template as variables, e.g.
  ``{"enable_thinking": False}`` for Qwen3 (``template_kwargs``). A template that rejects a
  leading system message (Gemma 2's raises "System role not supported") gets it folded into the
  first user message the way Gemma 3's template folds it itself: the system text, a blank line,
  the user text (``fold_system``). Whether to fold is decided by trying the template, never by
  the model's name; a template that rejects the folded messages too (it objects to something
  else) gives a ``DataError`` with both of its errors."""
  kwargs = template_kwargs(chat_template_kwargs)
  if chat_template:
    if not getattr(tokenizer, "chat_template", None):
      raise DataError("the tokenizer has no chat template; set data.chat_template=False to feed "
                      "prompts as raw text")
    messages = _messages(prompt, system)
    try:
      return _render(tokenizer, messages, kwargs)
    except DataError as rejected:
      if (folded := fold_system(messages)) is None:
        raise
      try:
        return _render(tokenizer, folded, kwargs)
      except DataError as again:
        why = again.__cause__ or again
        raise DataError(f"{rejected}; with the system message folded into the first user "
                        f"message (as Gemma 3's template folds it) it failed too: "
                        f"{type(why).__name__}: {why}") from rejected.__cause__
  if not isinstance(prompt, str):
    raise DataError(f"the prompt is a {type(prompt).__name__} (chat messages?) but "
                    "data.chat_template=False feeds prompts as raw text; set "
                    "data.chat_template=True or give string prompts")
  if system is not None:
    raise DataError("a system prompt needs the chat template; set data.chat_template=True or "
                    "drop data.system")
  if kwargs:
    raise DataError("data.chat_template_kwargs are the chat template's variables; set "
                    "data.chat_template=True or drop data.chat_template_kwargs")
  return plain_ids(tokenizer(prompt)["input_ids"])


def _render(tokenizer, messages: list[dict], kwargs: dict) -> list[int]:
  """``apply_chat_template``'s ids of ``messages`` with the generation prompt; a template error
  becomes a ``DataError`` naming the messages' roles, a missing package an ``ImportError``."""
  try:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        **kwargs)
  except ImportError as e:  # a missing package (transformers renders templates with jinja2)
    raise _missing_package(e, "rendering the tokenizer's chat template") from e
  except Exception as e:  # jinja errors, e.g. a template that rejects system messages
    raise DataError(f"the tokenizer's chat template failed on the messages "
                    f"{[m.get('role') for m in messages]}: {type(e).__name__}: {e}") from e
  return plain_ids(ids)


def fold_system(messages: list[dict]) -> list[dict] | None:
  """``messages`` with a leading system message folded into the first user message as Gemma 3's
  template folds it: ``f"{system}\\n\\n{user}"``. None where there is nothing to fold this way
  (no leading system message, no user message, or content that is not text)."""
  if not messages or messages[0].get("role") != "system":
    return None
  system, rest = messages[0].get("content"), [dict(m) for m in messages[1:]]
  users = [m for m in rest if m.get("role") == "user"]
  if not isinstance(system, str) or not users or not isinstance(users[0].get("content"), str):
    return None
  users[0]["content"] = f"{system}\n\n{users[0]['content']}"
  return rest


# apply_chat_template's own arguments, which ppojax sets (or which change what it returns):
# data.chat_template_kwargs may not set them
RESERVED_TEMPLATE_KWARGS = (
    "conversation", "add_generation_prompt", "continue_final_message", "tokenize", "return_dict",
    "return_tensors", "return_assistant_tokens_mask", "padding", "truncation", "max_length",
    "tokenizer_kwargs")


def template_kwargs(kwargs: Mapping | None) -> dict:
  """``data.chat_template_kwargs`` as a plain dict for ``apply_chat_template`` (None: ``{}``): a
  mapping (a ``ConfigDict`` too) with string keys, none of them ``RESERVED_TEMPLATE_KWARGS``.
  As trl's and verl's ``chat_template_kwargs``: each key is a variable the template reads."""
  if kwargs is None:
    return {}
  if hasattr(kwargs, "to_dict"):  # an ml_collections ConfigDict
    kwargs = kwargs.to_dict()
  if not isinstance(kwargs, Mapping):
    raise DataError(f"data.chat_template_kwargs must be a dict of the chat template's variables, "
                    f"e.g. {{'enable_thinking': False}}; got the {type(kwargs).__name__} "
                    f"{kwargs!r}")
  if bad := [k for k in kwargs if not isinstance(k, str) or not k]:
    raise DataError(f"data.chat_template_kwargs: the keys must be the names (strings) of the chat "
                    f"template's variables, e.g. 'enable_thinking'; got {bad!r}")
  if reserved := sorted(set(kwargs) & set(RESERVED_TEMPLATE_KWARGS)):
    raise DataError(f"data.chat_template_kwargs sets {reserved}: ppojax sets these arguments of "
                    "apply_chat_template itself (prompts are tokenized with the generation "
                    "prompt appended); remove them")
  return dict(kwargs)


def _missing_package(e: ImportError, what: str) -> ImportError:
  """An ImportError naming the missing package and how to install it. Python's own name it in
  ``e.name``; transformers' ("apply_chat_template requires jinja2 to be installed") in the text."""
  found = re.search(r"No module named '([\w.]+)'|requires (\w+)", str(e))
  name = (e.name or (found and (found.group(1) or found.group(2))) or "").split(".")[0]
  if not name:
    return ImportError(f"{what} needs a package that is not installed here ({e}); "
                       "`pip install -e .` in the ppojax checkout installs every dependency")
  if "cannot import name" in str(e):  # installed, but a version without what is needed
    return ImportError(f"{what} needs a newer `{name}` than the one installed: "
                       f"pip install -U {name}. The error was: {e}", name=name)
  return ImportError(f"{what} needs the Python package `{name}`, which is not installed here: "
                     f"pip install {name} (or `pip install -e .` in the ppojax checkout, which "
                     f"installs every dependency of ppojax). The error was: {e}", name=name)


# Probe prompts for ``template_prefix``: letters, a digit, a leading space and a leading newline,
# so that the prefix stops before any token a prompt's first characters could merge into.
PREFIX_PROBES = ("a", "Z", "1", " a", "\na")


def template_prefix(tokenizer, *, system: str | None = None, chat_template: bool = True,
                    chat_template_kwargs: Mapping | None = None) -> list[int]:
  """The token ids that every prompt encoded by ``prompt_ids`` with these settings begins with:
  the chat template's header and system prompt, or the tokenizer's BOS token. It is the common
  prefix of the ids of a few probe prompts (``PREFIX_PROBES``); a prompt whose first tokens
  differ anyway (a rare merge across the boundary, or one cut from the left) is caught where
  the prefix is used (``experience.with_prefix``)."""
  seqs = [prompt_ids(tokenizer, probe, system=system, chat_template=chat_template,
                     chat_template_kwargs=chat_template_kwargs) for probe in PREFIX_PROBES]
  n = 0
  while all(len(ids) > n for ids in seqs) and len({ids[n] for ids in seqs}) == 1:
    n += 1
  return seqs[0][:n]
