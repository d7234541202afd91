"""Tools for the policy, as an environment on the host (``rollout.host_turns.HostEnv``): plain
Python functions with type hints and a docstring (trl's convention; ``tool_schemas`` renders
them with transformers' ``get_json_schema``). Each turn, every live row's text is parsed for
tool calls in the model family's format (``data.tool_formats``), each call runs with a time
limit, and the results go back as one observation framed by the chat template as the tool's
message (``data.turns``). A turn without a tool call ends the episode (``end_without_call``);
its text is the answer the outcome reward reads.

Bad input keeps the batch: a call that cannot be parsed, an unknown tool, wrong arguments, a
tool that raises or outlasts ``timeout_s`` each answer the policy with an error text, counted
per episode (``tool_errors``); the model's text is never executed, only passed as arguments.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any, Callable

from ppojax.data.tool_formats import parse_tool_calls, tool_format
from ppojax.data.turns import observation_ids
from ppojax.rollout.host_turns import HostAnswer


def tool_schemas(tools: list[Callable]) -> list[dict]:
  """The JSON schemas of ``tools`` (``transformers.utils.get_json_schema``: the type hints and
  the docstring's Args), as ``apply_chat_template(tools=...)`` takes them."""
  from transformers.utils import get_json_schema  # pylint: disable=import-outside-toplevel
  return [get_json_schema(fn) for fn in tools]


def system_prompt(tools: list[Callable], fmt: str = "qwen3") -> str:
  """A system message that offers ``tools`` and shows the JSON call syntax, for a chat
  template that does not render tools itself (SmolLM2's)."""
  f = tool_format(fmt)
  if f.syntax != "json" or not f.call_open:
    raise ValueError(f"system_prompt writes JSON calls between markers; {f.family} calls "
                     "differently: describe its tools in the prompt yourself")
  return (f"You can call these tools:\n{signatures(tools)}\nTo call one, reply with only "
          f"{f.call_open}{{\"name\": ..., \"{f.arguments_key}\": {{...}}}}{f.call_close}; its "
          "result comes in the next message. Then reply with the answer alone.")


def signatures(tools: list[Callable]) -> str:
  """One line per tool from its schema: ``name(arg: type, ...): the description's first
  sentence`` (a compact rendering: a small model's prompt stays short)."""
  lines = []
  for schema in tool_schemas(tools):
    fn = schema["function"]
    args = ", ".join(f"{k}: {v.get('type', 'any')}"
                     for k, v in fn.get("parameters", {}).get("properties", {}).items())
    lines.append(f"{fn['name']}({args}): {fn.get('description', '').split('. ')[0]}")
  return "\n".join(lines)


@dataclasses.dataclass(eq=False)
class ToolEnv:
  """Tools behind ``HostEnv``'s interface (one episode per row); see the module docstring."""

  tools: dict[str, Callable]
  tokenizer: Any
  max_turns: int
  obs_tokens: int
  fmt: str = "qwen3"
  end_of_turn: str = ""  # the policy's stop token's text (the template's end of a turn)
  role: str = ""  # the role of a result message ("": the format's)
  chat_template: bool = True
  chat_template_kwargs: dict | None = None
  timeout_s: float = 5.0
  end_without_call: bool = True  # a turn without a call ends the episode
  on_host = True

  def __post_init__(self):
    self.role = self.role or tool_format(self.fmt).result_role
    self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4)

  def reset(self, records, prompts, seed) -> None:
    del records, prompts, seed  # the tools hold no per-episode state

  def step(self, turn: int, actions: list[list[int]], live: list[bool]) -> list[HostAnswer]:
    return [self._answer(ids) if on else HostAnswer([]) for ids, on in zip(actions, live)]

  def _answer(self, ids: list[int]) -> HostAnswer:
    text = self.tokenizer.decode(ids, skip_special_tokens=True)
    calls = parse_tool_calls(text, self.fmt)
    if not calls:
      # every key of a call's info, 0: an iteration without a call logs the same metrics
      return HostAnswer([], done=self.end_without_call,
                        info={"tool_calls": 0, "tool_errors": 0, "results_cut": 0})
    results, errors = [], 0
    for call in calls:
      result, ok = self.run(call)
      results.append(result)
      errors += not ok
    f = tool_format(self.fmt)
    shown = "\n".join(f"{f.result_open}{r}{f.result_close}" if self.role == "user" else r
                      for r in results)
    obs, cut = self.framed(shown)
    return HostAnswer(obs, info={"tool_calls": len(calls), "tool_errors": errors,
                                 "results_cut": int(cut)})

  def framed(self, text: str) -> tuple[list[int], bool]:
    """(the ids of ``text`` as the tool's message, whether the text was cut to fit): a message
    over ``obs_tokens`` keeps the frame (the next turn's generation prompt included) and as
    much of the text's start as fits, marked with "…"."""
    frame = lambda t: observation_ids(  # noqa: E731
        self.tokenizer, t, end_of_turn=self.end_of_turn, role=self.role,
        chat_template=self.chat_template, chat_template_kwargs=self.chat_template_kwargs)
    ids = frame(text)
    cut = False
    while len(ids) > self.obs_tokens and text:
      keep = max(0, len(text) * self.obs_tokens // len(ids) - 2)
      text, cut = (text[:keep] + "…") if keep else "", True
      ids = frame(text)
    return ids, cut

  def run(self, call: dict) -> tuple[str, bool]:
    """(the result's text, whether the call succeeded) of one parsed call."""
    if "error" in call:
      return f"error: the tool call could not be read ({call['error']})", False
    fn = self.tools.get(call["name"])
    if fn is None:
      return (f"error: no tool named {call['name']!r}; the tools are "
              f"{', '.join(sorted(self.tools))}"), False
    future = self._pool.submit(fn, **call["arguments"])
    try:
      result = future.result(timeout=self.timeout_s)
    except concurrent.futures.TimeoutError:
      return f"error: {call['name']} took longer than {self.timeout_s} s", False
    except TypeError as e:  # wrong or missing arguments
      return f"error: bad arguments for {call['name']}: {e}", False
    except Exception as e:  # pylint: disable=broad-except  # the tool's own failure
      return f"error: {call['name']} failed: {type(e).__name__}: {e}", False
    text = str(result)
    return text, not text.startswith("error:")
