"""How each model family writes tool calls and reads tool results, as data, and
``parse_tool_calls(text, fmt)``: the calls in a completion, for the multi-turn work (DESIGN:
multi-turn). A bad call is an entry with an "error" key, never an exception: the environment
turns it into an error observation and the batch goes on.

    calls = parse_tool_calls(completion, "qwen3")
    # [{"name": "search", "arguments": {"q": "cows"}}, {"error": "bad JSON: ...", "text": "..."}]

    family   a call                                         results: role (rendering)
    qwen3    <tool_call>{"name", "arguments"}</tool_call>   tool (<tool_response>…</tool_response>)
    smollm3  the same (tools via xml_tools=)                tool (a plain user turn)
    llama3   the whole reply: {"name", "parameters"}        ipython or tool (the ipython turn)
    gemma3   ```tool_code f(a=1) ``` (no tool tokens)       user (```tool_output … ```)
    olmo3    <function_calls>f(a=1) g()</function_calls>    environment (the environment turn)

Sources read to confirm these (to learn, nothing copied):

- Qwen3: its chat template as llama.cpp keeps it (models/templates/Qwen-Qwen3-0.6B.jinja): calls
  ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``, a "tool" message rendered in a
  user turn as ``<tool_response>\\n…\\n</tool_response>`` (consecutive results share the turn),
  ``enable_thinking=False`` adding ``<think>\\n\\n</think>\\n\\n`` after the generation prompt.
  Qwen2.5: not read here; Qwen's maintainers point vLLM users to the same "hermes" parser
  (github.com/QwenLM/Qwen3/discussions/1098). vLLM's hermes_tool_parser.py: the same markers, a
  call left open at the end parsed to the end of the text.
- SmolLM3: HuggingFaceTB/SmolLM3-3B's template (llama.cpp's models/templates copy, and a copy
  with its ``xml_tools`` block): the same <tool_call> JSON; a "tool" message is rendered as a
  user turn with its content as given, without <tool_response> tags (whether it was trained
  with such tags around results: unconfirmed).
- Llama 3.1+: Llama 3.3's template (llama.cpp models/templates/meta-llama-Llama-3.3-70B-
  Instruct.jinja): a custom call is the assistant's whole message ``{"name": ..., "parameters":
  ...}``, a built-in one ``<|python_tag|>name.call(arg="...")``; "tool" and "ipython" messages
  both render under the ``ipython`` header; one call per message there, while vLLM's
  llama_tool_parser.py (``Llama3JsonToolParser``) also takes ";"-separated objects and
  "arguments" for "parameters". Raw code after <|python_tag|> (code_interpreter): unconfirmed,
  reported as an error here.
- Gemma 2/3: Gemma 2's template (llama.cpp google-gemma-2-2b-it.jinja) and Gemma 3's
  (transformers' convert_gemma3_weights.py) have no tool tokens and no tool role (roles must
  alternate user/model), and Google's Gemma function-calling guide says a framework must find
  calls by the format the prompt asked for. The ```tool_code``` / ```tool_output``` fences are
  that prompt convention (Google ADK's code executors use the same two delimiters); the guide's
  own example asks for a Python list ``[f(a=1), g(b=2)]``, which a fence may hold too.
- OLMo 3 (Instruct): open-instruct's "olmo" chat template (open_instruct/
  dataset_transformation.py: an assistant's ``function_calls`` in ``<function_calls>…
  </function_calls>``, results in the ``environment`` role, tool schemas in a message's
  ``functions`` field) and vLLM's olmo3_tool_parser.py (newline-separated Python calls,
  JSON's true/false/null taken as literals); open-instruct's vLLM parser table renders results
  as ``<|im_start|>environment\\n…<|im_end|>``. The released Olmo-3 tokenizer_config's template
  itself was not read: that it is the same template is unconfirmed.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import textwrap
from typing import Any


@dataclasses.dataclass(frozen=True)
class ToolFormat:
  """One family's tool-call format: how a call is written and how a result goes back."""
  family: str
  models: str  # the models that use it
  syntax: str  # between the markers: "json" ({"name", arguments}) or "python" (f(a=1) calls)
  call_open: str  # the marker before a call ("": the whole reply is the call)
  call_close: str  # the marker after it ("": none)
  arguments_key: str  # the JSON key of the arguments ("" for python calls)
  tools_argument: str  # how the tool schemas reach the template
  result_role: str  # the role of a tool-result message given to the chat template
  result_open: str  # the result's text is rendered between these (by the template or,
  result_close: str  # for gemma3, by the caller)
  builtin_tag: str = ""  # before a built-in tool's call (Llama's <|python_tag|>)
  notes: str = ""


FORMATS = {f.family: f for f in (
    ToolFormat("qwen3", "Qwen2.5 Instruct, Qwen3", "json", "<tool_call>", "</tool_call>",
               "arguments", "apply_chat_template(tools=...)", "tool", "<tool_response>\n",
               "\n</tool_response>", notes="consecutive results share one user turn"),
    ToolFormat("smollm3", "SmolLM3", "json", "<tool_call>", "</tool_call>", "arguments",
               "apply_chat_template(xml_tools=...)", "tool", "", "",
               notes="a tool message is rendered as a plain user turn; trained result tags "
                     "unconfirmed"),
    ToolFormat("llama3", "Llama 3.1, 3.2, 3.3", "json", "", "", "parameters",
               "apply_chat_template(tools=...)", "ipython", "", "", builtin_tag="<|python_tag|>",
               notes="the reply is the call; the turn ends with <|eom_id|> (ipython mode) or "
                     "<|eot_id|>; one call per message in Meta's templates"),
    ToolFormat("gemma3", "Gemma 2, Gemma 3", "python", "```tool_code", "```", "",
               "the prompt's own text (no tool tokens)", "user", "```tool_output\n", "\n```",
               notes="a prompt convention, not the template's: no tool role"),
    ToolFormat("olmo3", "OLMo 3 Instruct", "python", "<function_calls>", "</function_calls>", "",
               "a system or user message's 'functions' field", "environment", "", "",
               notes="one call per line"),
)}
ALIASES = {"qwen2.5": "qwen3", "qwen2": "qwen3", "hermes": "qwen3", "llama3.1": "llama3",
           "llama3.2": "llama3", "llama3.3": "llama3", "gemma2": "gemma3", "olmo": "olmo3"}


def tool_format(fmt: ToolFormat | str) -> ToolFormat:
  """The ``ToolFormat`` of a family name (``FORMATS``, ``ALIASES``), or ``fmt`` itself."""
  if isinstance(fmt, ToolFormat):
    return fmt
  name = ALIASES.get(str(fmt).lower(), str(fmt).lower())
  if name not in FORMATS:
    raise ValueError(f"unknown tool-call format {fmt!r}; known: "
                     f"{', '.join(sorted({*FORMATS, *ALIASES}))}")
  return FORMATS[name]


def parse_tool_calls(text: str, fmt: ToolFormat | str) -> list[dict[str, Any]]:
  """The tool calls in a completion, in order: ``{"name": str, "arguments": dict}`` each, or
  ``{"error": why, "text": the call's text}`` for a call that cannot be read (bad JSON or
  Python, no name, arguments that are not a dict of literals). [] when there is no call.
  Thinking (``<think>…</think>``, or everything before a lone ``</think>``) is skipped; a call
  whose closing marker is missing (cut off, or the model stopped there) runs to the end."""
  fmt = tool_format(fmt)
  text = _without_thinking(text)
  if not fmt.call_open:
    return _whole_reply_calls(text, fmt)
  calls = []
  for body in _spans(text, fmt.call_open, fmt.call_close):
    calls.extend(_json_calls(body, fmt) if fmt.syntax == "json" else _python_calls(body))
  return calls


def _without_thinking(text: str) -> str:
  """``text`` after its last ``</think>`` (the opening tag may be in the prompt), and before an
  unclosed ``<think>``."""
  if "</think>" in text:
    text = text[text.rindex("</think>") + len("</think>"):]
  return text.split("<think>")[0]


def _spans(text: str, open_: str, close: str) -> list[str]:
  """The texts between each ``open_`` and the next ``close`` (or the end of ``text``)."""
  bodies, start = [], text.find(open_)
  while start >= 0:
    start += len(open_)
    end = text.find(close, start)
    bodies.append(text[start:] if end < 0 else text[start:end])
    start = -1 if end < 0 else text.find(open_, end + len(close))
  return bodies


def _error(why: str, text: str) -> dict[str, str]:
  return {"error": why, "text": text.strip()}


# ---------------------------------------------------------------------------------------------
# JSON calls


def _json_calls(body: str, fmt: ToolFormat) -> list[dict]:
  """The one JSON object between a pair of markers."""
  try:
    return [_json_call(json.loads(body), fmt, body)]
  except (ValueError, RecursionError) as e:  # json.JSONDecodeError is a ValueError
    return [_error(f"bad JSON: {e}", body)]


def _json_call(obj: Any, fmt: ToolFormat, text: str) -> dict:
  """``{"name", "arguments"}`` of a decoded call object (its arguments under
  ``fmt.arguments_key``, "arguments" or "parameters"; a JSON string of an object accepted)."""
  shape = f'{{"name": ..., "{fmt.arguments_key}": {{...}}}}'
  if not isinstance(obj, dict):
    return _error(f"a call must be a JSON object {shape}, got {type(obj).__name__}", text)
  name = obj.get("name")
  if not isinstance(name, str) or not name.strip():
    return _error(f'the call has no "name" (a non-empty string): {shape}', text)
  keys = (fmt.arguments_key, "arguments", "parameters")
  args = next((obj[k] for k in keys if k in obj), {})
  if isinstance(args, str):
    try:
      args = json.loads(args)
    except (ValueError, RecursionError) as e:
      return _error(f"the arguments of {name!r} are a string but not JSON: {e}", text)
  if not isinstance(args, dict):
    return _error(f"the arguments of {name!r} must be a JSON object, got "
                  f"{type(args).__name__}", text)
  return {"name": name, "arguments": args}


def _whole_reply_calls(text: str, fmt: ToolFormat) -> list[dict]:
  """Llama's calls: the reply is one JSON object (or several separated by ";"), or a built-in
  tool's ``<|python_tag|>name.call(arg=...)``; a reply that starts otherwise has no call."""
  body = text.strip()
  tagged = bool(fmt.builtin_tag) and body.startswith(fmt.builtin_tag)
  body = body[len(fmt.builtin_tag):].strip() if tagged else body
  if not body.startswith("{"):
    return _builtin_calls(body) if tagged else []
  calls, decoder, pos = [], json.JSONDecoder(), 0
  while pos < len(body) and body[pos] == "{":
    try:
      obj, end = decoder.raw_decode(body, pos)
    except (ValueError, RecursionError) as e:
      return [*calls, _error(f"bad JSON: {e}", body[pos:])]
    calls.append(_json_call(obj, fmt, body[pos:end]))
    pos = end
    while pos < len(body) and body[pos] in " \t\r\n;":
      pos += 1
  return calls


def _builtin_calls(body: str) -> list[dict]:
  """``brave_search.call(query="...")`` after <|python_tag|>: the tool's name and arguments."""
  if not re.match(r"[A-Za-z_][\w.]*\.call\s*\(", body):
    return [_error("after <|python_tag|>: neither a JSON call nor a built-in tool's "
                   "name.call(arg=value) (raw code for code_interpreter is not parsed)", body)]
  calls = _python_calls(body)
  for call in calls:
    if call.get("name", "").endswith(".call"):
      call["name"] = call["name"][:-len(".call")]
  return calls


# ---------------------------------------------------------------------------------------------
# Python calls


def _python_calls(body: str) -> list[dict]:
  """Calls written as Python, one per line (or a list ``[f(a=1), g()]``), keyword arguments
  with literal values (JSON's true/false/null too)."""
  code = textwrap.dedent(body).strip()
  try:
    tree = ast.parse(code)
  except SyntaxError as e:
    return [_error(f"not Python calls: {e.msg} (line {e.lineno})", body)]
  except (ValueError, RecursionError, MemoryError) as e:  # null bytes, nesting too deep
    return [_error(f"not Python calls: {type(e).__name__}: {e}", body)]
  nodes = []
  for stmt in tree.body:
    value = stmt.value if isinstance(stmt, ast.Expr) else stmt
    nodes.extend(value.elts if isinstance(value, (ast.List, ast.Tuple)) else [value])
  if not nodes:
    return [_error("an empty call block: write name(arg=value), one call per line", body)]
  return [_python_call(node) for node in nodes]


_JSON_LITERALS = {"true": True, "false": False, "null": None}


def _python_call(node: ast.AST) -> dict:
  """``{"name", "arguments"}`` of one ``name(arg=literal, ...)`` call node."""
  text = ast.unparse(node)
  name = _dotted(node.func) if isinstance(node, ast.Call) else None
  if name is None:
    return _error("not a function call name(arg=value, ...)", text)
  if node.args or any(k.arg is None for k in node.keywords):
    return _error(f"give the arguments of {name!r} by name: {name}(arg=value, ...)", text)
  args = {}
  for k in node.keywords:
    try:
      args[k.arg] = ast.literal_eval(_JsonLiterals().visit(k.value))
    except (ValueError, TypeError, RecursionError):  # TypeError: {[1]: 2}
      return _error(f"argument {k.arg!r} of {name!r} is {ast.unparse(k.value)}: the values must "
                    "be literals (numbers, strings, lists, dicts, True/False/None)", text)
  return {"name": name, "arguments": args}


def _dotted(node: ast.AST) -> str | None:
  """``f`` or ``a.b.f`` as a string; None for anything else called."""
  if isinstance(node, ast.Name):
    return node.id
  if isinstance(node, ast.Attribute) and (head := _dotted(node.value)) is not None:
    return f"{head}.{node.attr}"
  return None


class _JsonLiterals(ast.NodeTransformer):
  """JSON's true/false/null (which models write in Python calls) as Python constants."""

  def visit_Name(self, node: ast.Name) -> ast.AST:  # ast's method name
    if node.id in _JSON_LITERALS:
      return ast.copy_location(ast.Constant(_JSON_LITERALS[node.id]), node)
    return node
