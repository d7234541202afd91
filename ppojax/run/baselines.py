"""Honest baselines: the untrained policy evaluated with a simple instruction, beside the
default prompt, so that a table of "before → after" also shows what a prompt alone achieves.

    eval.baselines = {"instructed": "Reply with just the number."}

Before the first iteration (once; like "before", redone on resume only if cut short) the
held-out records are evaluated with each instruction appended to their prompt:

    "What is 23 + 45?"  →  "What is 23 + 45? Reply with just the number."

(for chat-message prompts: appended to the content of the last user message). The instruction
goes into the user's turn, not a system message, so the chat template's default system prompt
stays as in training. The instructed prompts are never cut; every held-out evaluation of a run
("before", each baseline's, "after") pads to one length (``eval_length``), so all of them run
one compiled generate program. Results: eval.json phase ``before_NAME`` (the same
``eval/...`` keys as every other phase), metrics rows ``eval_NAME/...`` at step 0, and
eval_samples_before_NAME.jsonl.
"""

from __future__ import annotations

from typing import Sequence

from ppojax.data import encoding
from ppojax.data import records as records_lib
from ppojax.data.batch import bucket_length
from ppojax.tasks import sources

PHASE = "before_{}"  # eval.json phase of baseline NAME


def check_config(config) -> None:
  """``eval.baselines``: names usable in a phase and a file name, non-empty instruction texts
  (ValueError naming the baseline otherwise)."""
  for name, text in config.eval.get("baselines", {}).items():
    if not (name.isascii() and name.replace("_", "").isalnum()):
      raise ValueError(f"eval.baselines.{name}: a baseline's name becomes the eval.json phase "
                       f"before_{name} and a file name; use letters, digits and _")
    if not isinstance(text, str) or not text.strip():
      raise ValueError(f"eval.baselines.{name}={text!r} must be a non-empty instruction text, "
                       'e.g. "Reply with just the number."')


def phases(config) -> list[tuple[str, str]]:
  """(eval.json phase, instruction) of every baseline, in the config's order."""
  return [(PHASE.format(name), text) for name, text in config.eval.get("baselines", {}).items()]


def metric_prefix(phase: str) -> str:
  """Where a phase's metrics go in metrics.jsonl: "eval/" ("before", "after", "iteration_N"),
  "eval_NAME/" for baseline NAME (its rows share step 0 with "before")."""
  prefix = PHASE.format("")
  return f"eval_{phase.removeprefix(prefix)}/" if phase.startswith(prefix) else "eval/"


def instruct(records: Sequence[dict], instruction: str, field: str = "prompt") -> list[dict]:
  """Copies of ``records`` with ``instruction`` appended to ``record[field]``: "PROMPT
  INSTRUCTION" for a string; for chat messages, to the last user message's content."""
  out = []
  for i, record in enumerate(records):
    prompt = record[field]
    if isinstance(prompt, str):
      prompt = f"{prompt} {instruction}"
    else:
      prompt = [dict(m) for m in prompt]
      users = [j for j, m in enumerate(prompt) if m.get("role") == "user"]
      if not users:
        raise records_lib.DataError(f"record {i}: a baseline instruction goes into the last user "
                             f"message, and field {field!r} has none")
      prompt[users[-1]]["content"] = f"{prompt[users[-1]]['content']} {instruction}"
    out.append({**record, field: prompt})
  return out


def _longest(config, tokenizer, records: Sequence[dict]) -> int:
  """Tokens of the longest of the records' prompts, rendered as the run renders them (0 for
  none)."""
  d = config.data
  return max((len(encoding.prompt_ids(tokenizer, r[d.field], system=d.system or None,
                                      chat_template=d.chat_template,
                                      chat_template_kwargs=d.get("chat_template_kwargs")))
              for r in records), default=0)


def instructed(config, tokenizer, records: Sequence[dict], instruction: str,
               length: int | None = None):
  """(the instructed records, an encoder that cuts none of them, padding them to ``length``;
  default: the longest of them, at least ``data.max_prompt_len``)."""
  records = instruct(records, instruction, config.data.field)
  longest = max(_longest(config, tokenizer, records), config.data.max_prompt_len)
  return records, sources.prompt_encoder(config, tokenizer, longest, length)


def eval_length(config, tokenizer, records: Sequence[dict]) -> int:
  """The one prompt length of every held-out evaluation of a run: L = ``bucket_length`` (step
  ``data.prompt_bucket``) of the longest prompt, the held-out ones as cut to M =
  ``data.max_prompt_len`` and every baseline's instructed ones whole, at most max(M, the
  longest instructed prompt). "before", the baselines and "after" share one generate program."""
  d = config.data
  whole = [_longest(config, tokenizer, instruct(records, text, d.field))
           for _, text in phases(config)]
  longest = max([min(_longest(config, tokenizer, records), d.max_prompt_len), *whole])
  return bucket_length(longest, d.get("prompt_bucket", 64), max([d.max_prompt_len, *whole]))
