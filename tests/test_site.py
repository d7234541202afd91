"""The documentation site (mkdocs.yml, docs/) builds with ``mkdocs build --strict``: no warning,
so no link to a missing page or anchor, no page left out of the nav, no docstring that griffe
cannot read. The front page's four tasks each lead to a page of their own."""

from __future__ import annotations

import html
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# the front page's tasks: the page (as built) that answers each with a command
TASKS = {"use my own reward function": "how-to/reward/index.html",
         "use my own dataset": "how-to/dataset/index.html",
         "run GRPO with LoRA on a GPU": "how-to/grpo-lora-gpu/index.html",
         "compile for a TPU pod": "how-to/tpu-pod/index.html"}


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
  out = tmp_path_factory.mktemp("site")
  env = dict(os.environ, NO_MKDOCS_2_WARNING="1")  # Material's notice about its successor
  proc = subprocess.run(
      [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
  log = proc.stdout + proc.stderr
  assert proc.returncode == 0, f"mkdocs build --strict failed:\n{log}"
  warnings = [line for line in log.splitlines() if line.lstrip().startswith(("WARNING", "ERROR"))]
  assert not warnings, "\n".join(warnings)
  return out


def _article(page: pathlib.Path) -> str:
  """The page's own content, without the site's navigation."""
  return re.search(r"<article.*?</article>", page.read_text(), re.DOTALL).group(0)


def _preformatted(article: str) -> list[str]:
  """The text of every code block."""
  return [html.unescape(re.sub(r"<[^>]+>", "", block))
          for block in re.findall(r"<pre[^>]*>(.*?)</pre>", article, re.DOTALL)]


def test_front_page_leads_to_each_task(site):
  front = _article(site / "index.html")
  for task, page in TASKS.items():
    assert (site / page).is_file(), f"{task}: {page} was not built"
    href = page.removesuffix("index.html")
    assert f'href="{href}"' in front, f"{task}: the front page does not link {href}"
    commands = [b for b in _preformatted(_article(site / page)) if "python -m ppojax." in b]
    assert commands, f"{task}: {page} shows no ppojax command"


def test_docstring_formulas_render_preformatted(site):
  """docs/griffe_formulas.py: a docstring's formula block indented by two spaces is one
  preformatted block, its lines kept apart (Markdown would join them into a paragraph)."""
  blocks = _preformatted(_article(site / "reference/api/kl/index.html"))
  assert any("k1 = Δ" in b and "\nk3 = (e^{−Δ} − 1) + Δ" in b for b in blocks), blocks[:3]


def _formulas_module():
  spec = importlib.util.spec_from_file_location("griffe_formulas",
                                                ROOT / "docs" / "griffe_formulas.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_fence_formulas_leaves_sections_and_continuations():
  fence = _formulas_module().fence_formulas
  text = ("GAE.\n\n  δ_t = r_t − V_t\n  A_t = δ_t\n\n- a list item\n  its second line\n"
          "V'_t is `V'_t`.\n\nArgs:\n  x: [B, T].\n\n  more about x.\nReturns:\n  y.")
  assert fence(text) == (
      "GAE.\n\n```text\nδ_t = r_t − V_t\nA_t = δ_t\n```\n\n- a list item\n  its second line\n"
      "V'\\_t is `V'_t`.\n\nArgs:\n  x: [B, T].\n\n  more about x.\nReturns:\n  y.")


# a page of docs/ named in the code, and the sections quoted after it: 'docs/X.md, "Heading"',
# 'docs/X.md ("Heading")' or '"One" and "Two"', across a docstring's line breaks
_CITED = re.compile(r'(docs/[\w./-]+\.(?:md|png))'
                    r'(?:[,:]?\s*\(?((?:"[^"\n]+"(?:,?\s+and\s+|,\s*)?)+))?')


def _headings(page: pathlib.Path) -> list[str]:
  return [re.sub(r"[`*]", "", line.lstrip("#").strip())
          for line in page.read_text().splitlines() if line.startswith("#")]


def test_every_docs_page_and_section_the_code_cites_exists():
  """Benchmarks say which docs table they produce and modules where a choice is explained: a
  page renamed or a section retitled would leave them pointing nowhere."""
  sources = [p for folder in ("ppojax", "benchmarks", "configs")
             for p in (ROOT / folder).rglob("*.py")] + [ROOT / "README.md"]
  missing = []
  for source in sources:
    text = re.sub(r"\n[ \t#]*", " ", source.read_text())  # a docstring's or comment's lines
    for match in _CITED.finditer(text):
      cited, page = match.group(1), ROOT / match.group(1)
      if "ggml's docs/" in text[max(0, match.start() - 7):match.end()]:
        continue  # the GGUF format's own document, in ggml's repository
      if not page.is_file():
        missing.append(f"{source.relative_to(ROOT)}: {cited}")
        continue
      headings = _headings(page) if cited.endswith(".md") else []
      for quoted in re.findall(r'"([^"]+)"', match.group(2) or ""):
        title = re.sub(r"[`*]", "", quoted).strip()
        if not any(h == title or h.startswith(title) for h in headings):
          missing.append(f'{source.relative_to(ROOT)}: {cited}, "{quoted}"')
  assert not missing, "cited but not in docs/:\n" + "\n".join(missing)


def test_the_readmes_links_resolve():
  """README.md is no page of the site, so the strict build does not check its links: each
  relative link names a file of the repository, and its #anchor a heading of that page (slugs
  as the site's toc makes them)."""
  from markdown.extensions.toc import slugify  # pylint: disable=import-outside-toplevel
  readme = (ROOT / "README.md").read_text()
  broken = []
  for target, anchor in re.findall(r"\]\((?!https?:)([^)#\s]+)(?:#([^)\s]+))?\)", readme):
    page = ROOT / target
    if not page.exists():
      broken.append(target)
    elif anchor and anchor not in {slugify(h, "-") for h in _headings(page)}:
      broken.append(f"{target}#{anchor}")
  assert not broken, broken
