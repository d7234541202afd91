"""A griffe extension (mkdocs.yml, mkdocstrings' ``extensions``): the docstrings' display
formulas render as preformatted blocks on the site.

ppojax's docstrings set formulas apart as a paragraph indented by two spaces (the code's indent)
after a blank line, aligned in columns:

    Args ...

      δ_t = r_t + γ·V_{t+1}·m_{t+1} − V_t
      A_t = δ_t + γλ·A_{t+1}·m_{t+1}

Markdown reads an indent under four spaces as a plain paragraph and joins the lines into one, so
each such block becomes a fenced ``text`` block, dedented (a four-space block, already code to
Markdown, too: the same rendering). Untouched: the indented lines under a Google-style section
header (``Args:``, ``Returns:``, ...) and continuation lines that follow their line without a
blank line (a list item's second line).

In running text a prime before a subscript, V'_t, would open Markdown emphasis that a later
``_`` closes ("V'_t = V_{t+1}"); outside code spans that underscore is escaped.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_SECTION = re.compile(
    r"(Args|Arguments|Params|Parameters|Keyword Args|Keyword Arguments|Other Args|"
    r"Other Arguments|Other Params|Other Parameters|Raises|Exceptions|Returns|Yields|Receives|"
    r"Examples?|Attributes|Functions|Methods|Classes|Modules|Type Aliases|Warns|Warnings)"
    r"\s*:\s*")


def _indent(line: str) -> int:
  return len(line) - len(line.lstrip(" "))


def _escape_primes(line: str) -> str:
  """``'_`` -> ``'\\_`` outside the line's code spans."""
  pieces = re.split(r"(`+)", line)
  inside: str | None = None  # the backtick run that opened the code span we are in
  for k, piece in enumerate(pieces):
    if piece.startswith("`"):
      inside = None if piece == inside else (inside or piece)
    elif inside is None:
      pieces[k] = piece.replace("'_", "'\\_")
  return "".join(pieces)


def fence_formulas(text: str) -> str:
  """``text`` (a cleaned docstring) with its indented blocks outside sections fenced."""
  lines = text.split("\n")
  out: list[str] = []
  in_section = False
  i = 0
  while i < len(lines):
    line = lines[i]
    if line.strip() and _indent(line) == 0:
      in_section = bool(_SECTION.fullmatch(line))
    starts_block = (not in_section and line.strip() and _indent(line) >= 2
                    and (i == 0 or not lines[i - 1].strip()))
    if not starts_block:
      out.append(_escape_primes(line))
      i += 1
      continue
    end = i
    while end < len(lines) and lines[end].strip() and _indent(lines[end]) >= 2:
      end += 1
    cut = min(_indent(x) for x in lines[i:end])
    out += ["```text", *(x[cut:] for x in lines[i:end]), "```"]
    i = end
  return "\n".join(out)


class FenceFormulas(griffe.Extension):
  """Rewrites every docstring's formula blocks when griffe creates its object."""

  def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
    if obj.docstring is not None:
      obj.docstring.value = fence_formulas(obj.docstring.value)
