"""Mutation testing of ppojax's math modules: do the tests notice a wrong operator?

Table: none in the docs; it prints every surviving mutant and a count per module.

Each mutant is one small change inside a function body of one module (docstrings, comments,
signatures, error messages and f-strings are never touched):

  arithmetic   + ↔ −,  * ↔ /,  ** → *,  // → /   (also in augmented assignments)
  comparison   < → <=, <= → <, > → >=, >= → >, == ↔ !=, is ↔ is not, in ↔ not in
  boolean      and ↔ or, ``not x`` → x
  constants    0 → 1, 1 → 0, 0.5 → 1.0, other numbers c → c + 1, True ↔ False
               (``axis=`` and ``keepdims=`` values are constants too and are labelled so)
  unary minus  −x → x
  calls        jnp.maximum ↔ jnp.minimum, max ↔ min, sum ↔ mean, stop_gradient(x) → x,
               the branches of jnp.where swapped, the two arguments of a two-argument call of a
               function of the same module (or of subtract/divide) swapped

A git worktree of HEAD (``--rev``) is made in a temporary directory and every mutant is
written into *its* copy of the module, so the checkout that others import is never changed;
the test files of every selection are copied from the checkout into the worktree at the start
(the tests as they are now, the package as committed). Each mutant is judged in a fresh
process, ``python -m pytest -q -x -p no:cacheprovider <tests>``, run in the worktree with a
timeout; the module's stale bytecode is removed before each run and no bytecode is written.
The module is restored after each mutant (try/finally; Ctrl-C included), checked by hash at
the end, and the worktree removed. Before the mutants, the selection must pass on the
unmutated module (else that module is skipped).

Usage (from the repository root):

  python benchmarks/mutation.py                       # every module, its default selection
  python benchmarks/mutation.py --modules kl,rewards --limit 20
  python benchmarks/mutation.py --modules lora --tests "tests/test_lora_math.py -k merge"
  python benchmarks/mutation.py --modules kl --only 45,52   # just the mutants at these lines
  python benchmarks/mutation.py --list --modules ops        # print the mutants, run nothing
  python benchmarks/mutation.py --limit 10 --rerun run.log  # judge run.log's survivors again

``--limit N`` keeps N mutants per module, spread evenly over the module (a fixed choice, so two
runs with the same N judge the same mutants). Prints a line per surviving mutant, a line per
module (killed / survived / timed out) and, last, one JSON line:
``{"modules": {name: {"killed", "survived", "timeout", "total"}}, "score": killed/total,
"survivors": [{"module", "line", "mutation"}, ...]}``. A timed-out mutant counts as killed in
the score (the tests did not pass) and is reported apart.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent

MODULES = {
    "advantages": "ppojax/core/advantages.py",
    "losses": "ppojax/core/losses.py",
    "kl": "ppojax/core/kl.py",
    "rewards": "ppojax/core/rewards.py",
    "ops": "ppojax/core/ops.py",
    "algorithms": "ppojax/core/algorithms.py",
    "lora": "ppojax/models/lora.py",
}
# The fast tests that exercise each module (the math pins; no end-to-end runs): pytest arguments.
EST, PROP, REF = "tests/test_estimators.py", "tests/test_properties.py", "tests/test_reference.py"
TESTS = {
    "advantages": [EST, REF, PROP, "-k", "not registry_critic and (test_estimators or gae)"],
    "losses": [REF, PROP, "tests/test_scale_options.py", "tests/test_supervised.py", "-k",
               ("(loss or entropy_bonus or clipfrac or policy_gradient or is_weight) and not "
                "counts_response and not tis_reweights")],
    "kl": [REF, PROP, EST, "-k", "kl"],
    "rewards": [REF, PROP, "-k", "adjust_scores or shape_rewards"],
    "ops": [REF, PROP, "-k", ("masked or aggregat or stop_token or response_mask or last_index "
                             "or gather_last")],
    "algorithms": ["tests/test_algorithms.py", EST, "-k",
                   "defaults or record or config_errors or registry"],
    "lora": ["tests/test_lora_math.py", "tests/test_lora.py", "-k",
             ("test_lora_math or split_and_combine or targets_accept or only_with_an_rng")],
}

BINOPS = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult,
          ast.Pow: ast.Mult, ast.FloorDiv: ast.Div}
OP_TEXT = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.Pow: "**",
           ast.FloorDiv: "//", ast.Mod: "%", ast.MatMult: "@"}
CMPOPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
          ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn,
          ast.NotIn: ast.In}
CMP_TEXT = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=",
            ast.Is: "is", ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in"}
RENAMES = {"maximum": "minimum", "minimum": "maximum", "max": "min", "min": "max",
           "sum": "mean", "mean": "sum"}
SWAPPABLE = {"subtract", "divide"}


@dataclasses.dataclass(frozen=True)
class Mutant:
  line: int
  start: int  # byte offsets into the module's source
  end: int
  text: str  # what replaces source[start:end]
  mutation: str


def _line_starts(src: bytes) -> list[int]:
  starts, pos = [0], 0
  for line in src.splitlines(keepends=True):
    pos += len(line)
    starts.append(pos)
  return starts


class _Finder(ast.NodeVisitor):
  """Collects the mutants of one module's function bodies."""

  def __init__(self, src: bytes, local_functions: set[str]):
    self.src, self.starts, self.local = src, _line_starts(src), local_functions
    self.mutants: list[Mutant] = []
    self.in_body = 0

  def span(self, node) -> tuple[int, int]:
    return (self.starts[node.lineno - 1] + node.col_offset,
            self.starts[node.end_lineno - 1] + node.end_col_offset)

  def text(self, node) -> str:
    start, end = self.span(node)
    return self.src[start:end].decode()

  def add(self, node, text: str, mutation: str):
    start, end = self.span(node)
    self.mutants.append(Mutant(node.lineno, start, end, text, mutation))

  # -- where to look: function bodies, not their docstrings, messages or f-strings ---------
  def visit_FunctionDef(self, node):
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
      body = body[1:]  # the docstring
    self.in_body += 1
    for stmt in body:
      self.visit(stmt)
    self.in_body -= 1

  visit_AsyncFunctionDef = visit_FunctionDef

  def visit_Raise(self, node):
    del node  # an error's message is no math

  def visit_JoinedStr(self, node):
    del node

  def visit_Lambda(self, node):
    self.visit(node.body)

  # -- the mutations ------------------------------------------------------------------------
  def visit_BinOp(self, node):
    if self.in_body and type(node.op) in BINOPS:
      new = BINOPS[type(node.op)]
      self.add(node, f"(({self.text(node.left)}) {OP_TEXT[new]} ({self.text(node.right)}))",
               f"{OP_TEXT[type(node.op)]} -> {OP_TEXT[new]}")
    self.generic_visit(node)

  def visit_AugAssign(self, node):
    if self.in_body and type(node.op) in BINOPS:
      new = BINOPS[type(node.op)]
      self.add(node, f"{self.text(node.target)} {OP_TEXT[new]}= ({self.text(node.value)})",
               f"{OP_TEXT[type(node.op)]}= -> {OP_TEXT[new]}=")
    self.generic_visit(node)

  def visit_Compare(self, node):
    if self.in_body:
      operands = [node.left] + node.comparators
      for i, op in enumerate(node.ops):
        ops = list(node.ops)
        ops[i] = CMPOPS[type(op)]()
        parts = [f"({self.text(operands[0])})"]
        for o, right in zip(ops, operands[1:]):
          parts.append(f"{CMP_TEXT[type(o)]} ({self.text(right)})")
        self.add(node, "(" + " ".join(parts) + ")",
                 f"{CMP_TEXT[type(op)]} -> {CMP_TEXT[type(ops[i])]}")
    self.generic_visit(node)

  def visit_BoolOp(self, node):
    if self.in_body:
      new, name = (" or ", "and -> or") if isinstance(node.op, ast.And) else (" and ", "or -> and")
      self.add(node, "(" + new.join(f"({self.text(v)})" for v in node.values) + ")", name)
    self.generic_visit(node)

  def visit_UnaryOp(self, node):
    if self.in_body and isinstance(node.op, (ast.USub, ast.Not)):
      name = "-x -> x" if isinstance(node.op, ast.USub) else "not x -> x"
      self.add(node, f"({self.text(node.operand)})", name)
    self.generic_visit(node)

  def visit_keyword(self, node):
    self.keyword = node.arg
    self.visit(node.value)
    self.keyword = None

  keyword = None

  def visit_Constant(self, node):
    if not self.in_body:
      return
    value, label = node.value, f"{self.keyword}=" if self.keyword else "constant "
    if isinstance(value, bool):
      self.add(node, repr(not value), f"{label}{value} -> {not value}")
    elif isinstance(value, (int, float)):
      new = {0: 1, 1: 0, 0.5: 1.0}.get(value, value + 1)
      new = type(value)(new)
      self.add(node, f"({new!r})", f"{label}{value!r} -> {new!r}")

  def visit_Call(self, node):
    if self.in_body:
      func = node.func
      name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
      if name in RENAMES and isinstance(func, ast.Attribute):
        start, end = self.span(func)
        new = f"{self.text(func.value)}.{RENAMES[name]}"
        self.mutants.append(Mutant(func.lineno, start, end, new, f"{name} -> {RENAMES[name]}"))
      if name == "stop_gradient" and len(node.args) == 1:
        self.add(node, f"({self.text(node.args[0])})", "stop_gradient removed")
      if name == "where" and len(node.args) == 3:
        a, b, c = (self.text(x) for x in node.args)
        self.add(node, f"{self.text(func)}({a}, {c}, {b})", "where branches swapped")
      local = isinstance(func, ast.Name) and name in self.local
      if ((local or name in SWAPPABLE) and len(node.args) == 2
          and not node.keywords and not any(isinstance(a, ast.Starred) for a in node.args)):
        a, b = (self.text(x) for x in node.args)
        self.add(node, f"{self.text(func)}({b}, {a})", f"{name}: arguments swapped")
    self.generic_visit(node)


def committed_source(rel: str, rev: str) -> bytes:
  """The module as committed at ``rev`` (what the worktree holds)."""
  return subprocess.run(["git", "show", f"{rev}:{rel}"], cwd=ROOT, capture_output=True,
                        check=True).stdout


def find_mutants(rel: str, rev: str = "HEAD") -> list[Mutant]:
  """Every mutant of the module ``rel`` committed at ``rev`` that still compiles, in order."""
  src, path = committed_source(rel, rev), rel
  tree = ast.parse(src)
  local = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
  finder = _Finder(src, local)
  finder.visit(tree)
  out = []
  for m in sorted(finder.mutants, key=lambda m: (m.start, m.end, m.mutation)):
    mutated = src[:m.start] + m.text.encode() + src[m.end:]
    if mutated == src:
      continue
    try:
      compile(mutated, str(path), "exec")
    except SyntaxError:
      continue
    out.append(m)
  return out


def spread(mutants: list, limit: int | None) -> list:
  """``limit`` of the mutants, evenly spaced over the list (all of them without a limit)."""
  if limit is None or limit >= len(mutants):
    return mutants
  step = len(mutants) / limit
  return [mutants[int(i * step)] for i in range(limit)]


class Worktree:
  """A detached git worktree of ``rev`` in a temporary directory, removed on exit."""

  def __init__(self, rev: str):
    self.rev = rev

  def __enter__(self) -> pathlib.Path:
    self.parent = pathlib.Path(tempfile.mkdtemp(prefix="ppojax-mutation-"))
    self.path = self.parent / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(self.path), self.rev],
                   cwd=ROOT, check=True)
    return self.path

  def __exit__(self, *exc):
    subprocess.run(["git", "worktree", "remove", "--force", str(self.path)], cwd=ROOT,
                   check=False)
    shutil.rmtree(self.parent, ignore_errors=True)
    subprocess.run(["git", "worktree", "prune"], cwd=ROOT, check=False)


def _drop_bytecode(module: pathlib.Path):
  for pyc in (module.parent / "__pycache__").glob(module.stem + ".*.pyc"):
    pyc.unlink(missing_ok=True)


def run_tests(tree: pathlib.Path, tests: list[str], timeout: float) -> str:
  """'passed', 'failed' or 'timeout': the selection in a fresh process in the worktree."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONDONTWRITEBYTECODE="1")
  env.pop("PYTHONPATH", None)
  cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests]
  try:
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, timeout=timeout,
                          start_new_session=True, check=False)
  except subprocess.TimeoutExpired:
    return "timeout"
  return "passed" if proc.returncode == 0 else "failed"


def judge(tree: pathlib.Path, rel: str, mutant: Mutant, tests: list[str], timeout: float) -> str:
  """The selection's verdict on one mutant; the module is restored whatever happens."""
  path = tree / rel
  original = path.read_bytes()
  try:
    path.write_bytes(original[:mutant.start] + mutant.text.encode() + original[mutant.end:])
    _drop_bytecode(path)
    return run_tests(tree, tests, timeout)
  finally:
    path.write_bytes(original)
    _drop_bytecode(path)


def check_imports_worktree(tree: pathlib.Path):
  """The worktree's ppojax, not an installed one, is what its processes import."""
  out = subprocess.run([sys.executable, "-c", "import ppojax; print(ppojax.__file__)"],
                       cwd=tree, capture_output=True, text=True, check=True,
                       env=dict(os.environ, JAX_PLATFORMS="cpu")).stdout.strip()
  if not pathlib.Path(out).resolve().is_relative_to(tree.resolve()):
    raise SystemExit(f"the worktree's processes import ppojax from {out}, not the worktree")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--modules", default=",".join(MODULES), help="comma-separated: " +
                 ", ".join(MODULES))
  p.add_argument("--limit", type=int, default=None, help="mutants per module, spread evenly")
  p.add_argument("--tests", default=None, help="pytest arguments, space-separated, for every "
                 "module (default: the module's fast selection, TESTS)")
  p.add_argument("--only", default=None, help="comma-separated source lines to mutate")
  p.add_argument("--timeout", type=float, default=None,
                 help="seconds per mutant (default: 3 × the unmutated run + 20)")
  p.add_argument("--list", action="store_true", help="print the mutants and run nothing")
  p.add_argument("--rev", default="HEAD", help="the commit whose modules are mutated")
  p.add_argument("--rerun", default=None, help="a file whose last line is an earlier run's "
                 "JSON: judge only its survivors (same --limit and --rev as that run)")
  return p.parse_args(argv)


def choose(args, names: list[str]) -> dict[str, list[Mutant]]:
  """The mutants to judge per module: ``--only``'s lines, ``--limit`` spread, ``--rerun``."""
  only = {int(x) for x in args.only.split(",")} if args.only else None
  keep = None
  if args.rerun:
    last = pathlib.Path(args.rerun).read_text().strip().splitlines()[-1]
    keep = {(s["module"], s["line"], s["mutation"]) for s in json.loads(last)["survivors"]}
  chosen = {}
  for name in names:
    mutants = find_mutants(MODULES[name], args.rev)
    if only is not None:
      mutants = [m for m in mutants if m.line in only]
    mutants = spread(mutants, args.limit)
    if keep is not None:
      mutants = [m for m in mutants if (name, m.line, m.mutation) in keep]
    chosen[name] = mutants
  return chosen


def judge_module(tree: pathlib.Path, name: str, mutants: list[Mutant], tests: list[str],
                 timeout: float | None, survivors: list) -> dict | None:
  """Counts of killed / survived / timed-out mutants of one module (None: its selection fails
  unmutated); appends the survivors to ``survivors``."""
  start = time.time()
  if run_tests(tree, tests, 1800) != "passed":
    print(f"{name}: skipped, the selection {tests} fails on the unmutated module", flush=True)
    return None
  base = time.time() - start
  timeout = timeout or 3 * base + 20
  print(f"{name}: {len(mutants)} mutants, selection {base:.0f} s unmutated, "
        f"timeout {timeout:.0f} s", flush=True)
  counts = {"killed": 0, "survived": 0, "timeout": 0}
  for m in mutants:
    t_mutant = time.time()
    verdict = judge(tree, MODULES[name], m, tests, timeout)
    key = {"passed": "survived", "failed": "killed", "timeout": "timeout"}[verdict]
    counts[key] += 1
    if key == "survived":
      survivors.append({"module": name, "line": m.line, "mutation": m.mutation})
    print(f"  {key} {name}:{m.line}: {m.mutation} ({time.time() - t_mutant:.0f} s)", flush=True)
  print(f"{name}: killed {counts['killed']}, survived {counts['survived']}, timeout "
        f"{counts['timeout']} of {len(mutants)} ({time.time() - start:.0f} s)", flush=True)
  return dict(counts, total=len(mutants))


def main(argv=None) -> int:
  args = parse_args(argv)
  names = [m.strip() for m in args.modules.split(",") if m.strip()]
  unknown = [n for n in names if n not in MODULES]
  if unknown:
    raise SystemExit(f"unknown modules {unknown}; choose from {', '.join(MODULES)}")
  chosen = choose(args, names)
  if args.list:
    for name, mutants in chosen.items():
      for m in mutants:
        print(f"{name}:{m.line}: {m.mutation}  ->  {m.text[:80]}")
    return 0

  results, survivors, t0 = {}, [], time.time()
  with Worktree(args.rev) as tree:
    check_imports_worktree(tree)
    hashes = {n: hashlib.sha256((tree / MODULES[n]).read_bytes()).hexdigest() for n in names}
    selections = {n: args.tests.split() if args.tests else TESTS[n] for n in names}
    for t in {t.split("::")[0] for n in names for t in selections[n] if t.startswith("tests/")}:
      if (ROOT / t).exists():  # the tests as they are in the checkout now, copied at the start
        shutil.copy2(ROOT / t, tree / t)
    for name in names:
      tests = [t for t in selections[name]
               if not t.startswith("tests/") or (tree / t.split("::")[0]).exists()]
      counts = judge_module(tree, name, chosen[name], tests, args.timeout, survivors)
      if counts is not None:
        results[name] = counts
    for n in names:
      if hashlib.sha256((tree / MODULES[n]).read_bytes()).hexdigest() != hashes[n]:
        raise SystemExit(f"{MODULES[n]} was not restored in the worktree")
  total = sum(r["total"] for r in results.values())
  dead = sum(r["killed"] + r["timeout"] for r in results.values())
  print(f"{time.time() - t0:.0f} s in all", flush=True)
  print(json.dumps({"modules": results, "score": round(dead / total, 4) if total else None,
                    "survivors": survivors}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
