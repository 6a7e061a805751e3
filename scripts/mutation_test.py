"""Mutation testing of the library's core modules: does some test fail when the code is deliberately wrong?

For each target module the script parses the source, enumerates small mutations (a flipped comparison, a swapped
arithmetic operator, a changed constant, ``and``/``or`` swapped, a dropped ``not``, a deleted statement), applies them
one at a time to a private copy of the repository, and runs the tests mapped to that module with ``pytest -x``. A
mutant is *killed* when a test fails, *survives* when all pass, *timeout* when the run exceeds the limit (counted as
killed: the mutation broke something). Surviving mutants are the list to read: each is either a missing test or an
equivalent mutant (a change no behaviour can reveal); ``docs/testing.md`` records which.

    python scripts/mutation_test.py --out docs/testing                     # all modules (CPU-hours on 2 cores)
    python scripts/mutation_test.py --modules kernels --limit 20 --out /tmp/mut   # a quick slice
    python scripts/mutation_test.py --markdown-from docs/testing/mutation.json     # the docs table

The copy lives in ``--work`` (default ``outputs/mutation``); tests run there with that copy first on ``sys.path``, so
the checkout you work in is never modified. Writes ``OUT/mutation.json`` (every mutant: module, line, operator,
original and mutated source line, outcome, seconds) as it goes, and resumes from it.
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# module -> the tests that exercise it, fastest first (pytest -x stops at the first failure)
TARGETS = {
    "kernels": ["tests/test_kernels.py", "tests/test_gradients.py", "tests/test_dropin.py::test_sampler_ratio_reaches_respo_coefficient"],
    "config": ["tests/test_config.py", "tests/test_reuse.py::test_staleness_n_uses_each_sample_once",
               "tests/test_reuse.py::test_reuse_passes_are_reshuffled_for_respo_and_replayed_for_trls_losses",
               "tests/test_trainer.py::test_respo_trains_and_logs_every_diagnostic_on_every_step",
               "tests/test_routing_replay.py::test_routing_replay_refuses_setups_where_routing_is_not_recorded",
               "tests/test_dropin.py"],
    "buffer": ["tests/test_reuse.py"],
    "diagnostics": ["tests/test_gradients.py", "tests/test_trainer.py", "tests/test_dropin.py::test_every_loss_type_trains_with_every_sampler_correction_mode"],
    "trainer": ["tests/test_gradients.py", "tests/test_trainer.py", "tests/test_reuse.py", "tests/test_dropin.py"],
}  # fmt: skip

COMPARE_SWAP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
                ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}  # fmt: skip
BINOP_SWAP = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Mult,
              ast.Mod: ast.FloorDiv, ast.Pow: ast.Mult, ast.BitAnd: ast.BitOr, ast.BitOr: ast.BitAnd}  # fmt: skip


def _skip(node: ast.AST) -> bool:
    """Docstrings, logging/messages and type annotations are not behaviour worth a mutant."""
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


class Enumerator(ast.NodeVisitor):
    """Collects (path-in-tree, operator, description) of every mutation site, in source order."""

    def __init__(self):
        self.sites: list[dict] = []
        self._in_annotation = False

    def _add(self, node, kind, detail):
        self.sites.append({"lineno": node.lineno, "col": node.col_offset, "kind": kind, "detail": detail})

    def visit_FunctionDef(self, node):
        if node.body and isinstance(node.body[0], ast.Expr) and _skip(node.body[0].value):
            body = node.body[1:]
        else:
            body = node.body
        for stmt in body:
            self.visit(stmt)
        for default in node.args.defaults + node.args.kw_defaults:
            if default is not None:
                self.visit(default)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node):
        for stmt in node.body:
            if isinstance(stmt, ast.Expr) and _skip(stmt.value):
                continue
            if isinstance(stmt, ast.AnnAssign):  # dataclass fields: mutate the default value only
                if stmt.value is not None:
                    self.visit(stmt.value)
                continue
            self.visit(stmt)

    def visit_AnnAssign(self, node):
        if node.value is not None:
            self.visit(node.value)

    def visit_Compare(self, node):
        for i, op in enumerate(node.ops):
            if type(op) in COMPARE_SWAP:
                self._add(node, "compare", (i, type(op).__name__))
        self.generic_visit(node)

    def visit_BinOp(self, node):
        if type(node.op) in BINOP_SWAP:
            self._add(node, "binop", type(node.op).__name__)
        self.generic_visit(node)

    def visit_BoolOp(self, node):
        self._add(node, "boolop", type(node.op).__name__)
        self.generic_visit(node)

    def visit_UnaryOp(self, node):
        if isinstance(node.op, (ast.Not, ast.USub)):
            self._add(node, "unary", type(node.op).__name__)
        self.generic_visit(node)

    def visit_Constant(self, node):
        if isinstance(node.value, bool):
            self._add(node, "constant", repr(node.value))
        elif isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            self._add(node, "constant", repr(node.value))

    def visit_JoinedStr(self, node):
        return  # f-strings are messages

    def visit_Call(self, node):
        name = getattr(node.func, "attr", getattr(node.func, "id", ""))
        if name in {"warning", "info", "debug", "error", "print", "ValueError", "RuntimeError", "TypeError",
                    "FileNotFoundError"}:  # fmt: skip
            return  # messages: their wording is tested where it matters, not by mutants
        self.generic_visit(node)

    def generic_visit(self, node):
        for stmt_list in ("body", "orelse", "finalbody"):
            statements = getattr(node, stmt_list, None)
            for stmt in statements if isinstance(statements, list) else []:
                if isinstance(stmt, (ast.Expr, ast.Assign, ast.AugAssign, ast.Return, ast.Raise)) and not (
                    isinstance(stmt, ast.Expr) and _skip(stmt.value)
                ):
                    self._add(stmt, "delete", type(stmt).__name__)
        super().generic_visit(node)


def mutate(tree: ast.Module, site: dict) -> ast.Module | None:
    """A copy of ``tree`` with the mutation ``site`` applied (None if it no longer applies)."""
    tree = copy.deepcopy(tree)
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) != site["lineno"] or getattr(node, "col_offset", None) != site["col"]:
            continue
        kind = site["kind"]
        if kind == "compare" and isinstance(node, ast.Compare):
            i, name = site["detail"]
            if type(node.ops[i]).__name__ == name:
                node.ops[i] = COMPARE_SWAP[type(node.ops[i])]()
                return tree
        if kind == "binop" and isinstance(node, ast.BinOp) and type(node.op).__name__ == site["detail"]:
            node.op = BINOP_SWAP[type(node.op)]()
            return tree
        if kind == "boolop" and isinstance(node, ast.BoolOp):
            node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
            return tree
        if kind == "unary" and isinstance(node, ast.UnaryOp):
            _replace(tree, node, node.operand)
            return tree
        if kind == "constant" and isinstance(node, ast.Constant):
            value = node.value
            if isinstance(value, bool):
                node.value = not value
            elif value == 0:
                node.value = 1
            elif isinstance(value, int):
                node.value = value + 1
            else:
                node.value = value * 1.5 if value not in (1.0,) else 0.5
            return tree
        if kind == "delete" and isinstance(node, ast.stmt) and type(node).__name__ == site["detail"]:
            _replace(tree, node, ast.Pass(lineno=node.lineno, col_offset=node.col_offset))
            return tree
    return None


def _replace(tree, old, new):
    for parent in ast.walk(tree):
        for field, value in ast.iter_fields(parent):
            if isinstance(value, list) and old in value:
                value[value.index(old)] = new
                return
            if value is old:
                setattr(parent, field, new)
                return


def run_tests(work: Path, tests: list[str], timeout: int) -> tuple[str, float, str]:
    """Run the test groups one pytest process each, fastest first, stopping at the first failure: a killed mutant
    costs the collection of one file, not of all of them."""
    env = {**os.environ, "PYTHONPATH": str(work), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONDONTWRITEBYTECODE": "1"}  # fmt: skip
    start = time.time()
    last = ""
    for group in tests:
        left = timeout - (time.time() - start)
        if left <= 0:
            return "timeout", time.time() - start, group
        try:
            done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p",
                                   "no:warnings", group], cwd=work, env=env, capture_output=True, text=True,
                                  timeout=left)  # fmt: skip
        except subprocess.TimeoutExpired:
            return "timeout", time.time() - start, group
        last = (done.stdout.strip().splitlines() or [""])[-1]
        if done.returncode != 0:
            return "killed", time.time() - start, f"{group}: {last}"
    return "survived", time.time() - start, last


def markdown(results: list[dict]) -> str:
    lines = ["| module | mutants | killed | timeout | survived | killed or timed out |", "|---|---:|---:|---:|---:|---:|"]
    for module in sorted({r["module"] for r in results}):
        rows = [r for r in results if r["module"] == module]
        n, k, t = len(rows), sum(r["outcome"] == "killed" for r in rows), sum(r["outcome"] == "timeout" for r in rows)
        lines.append(f"| `{module}.py` | {n} | {k} | {t} | {n - k - t} | {100 * (k + t) / n:.1f}% |")
    total = len(results)
    dead = sum(r["outcome"] in ("killed", "timeout") for r in results)
    lines.append(f"| all | {total} | | | {total - dead} | {100 * dead / max(total, 1):.1f}% |")
    lines += ["", "Survivors:", "", "| module | line | mutation | source line -> mutated |", "|---|---:|---|---|"]
    for r in results:
        if r["outcome"] == "survived":
            lines.append(f"| `{r['module']}` | {r['lineno']} | {r['kind']} {r['detail']} | `{r['before'].strip()}` -> "
                         f"`{r['after'].strip()}` |")  # fmt: skip
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modules", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    p.add_argument("--out", default="docs/testing")
    p.add_argument("--work", default="outputs/mutation")
    p.add_argument("--limit", type=int, help="At most this many mutants per module (evenly spread), for a slice.")
    p.add_argument("--timeout", type=int, default=900, help="Seconds per mutant's test run.")
    p.add_argument("--markdown-from", metavar="JSON")
    p.add_argument("--retry-survivors", action="store_true", help="Run the surviving mutants again (after new tests).")
    p.add_argument("--lines", type=int, nargs="+", help="Only the mutants of these source lines (one module).")
    args = p.parse_args(argv)
    if args.markdown_from:
        print(markdown(json.loads(Path(args.markdown_from).read_text())["mutants"]))
        return
    out, work = Path(args.out), Path(args.work).resolve()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "mutation.json"
    state = json.loads(path.read_text()) if path.exists() else {"mutants": []}
    if args.retry_survivors:
        state["mutants"] = [
            r for r in state["mutants"]
            if not (r["outcome"] == "survived" and r["module"] in args.modules and (not args.lines or r["lineno"] in args.lines))
        ]  # fmt: skip
    # A mutant is keyed by its source line's text, not its number, so results survive edits elsewhere in the file.
    done = {(r["module"], r["before"].strip(), r["col"], r["kind"], str(r["detail"])) for r in state["mutants"]}
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(ROOT, work, ignore=shutil.ignore_patterns(".git", ".venv*", "outputs", "benchmarks", "__pycache__", "*.egg-info", "*.png"))
    for module in args.modules:
        source_path = work / "respo_trl" / f"{module}.py"
        original = source_path.read_text()
        tree = ast.parse(original)
        enumerator = Enumerator()
        enumerator.visit(tree)
        sites = enumerator.sites
        if args.lines:
            sites = [site for site in sites if site["lineno"] in args.lines]
        if args.limit and len(sites) > args.limit:
            step = len(sites) / args.limit
            sites = [sites[int(i * step)] for i in range(args.limit)]
        baseline, seconds, last = run_tests(work, TARGETS[module], args.timeout)
        if baseline != "survived":
            raise SystemExit(f"{module}: the unmutated tests do not pass ({baseline}: {last}); fix them first")
        print(f"{module}: {len(sites)} mutants, tests take {seconds:.0f} s unmutated", flush=True)
        lines = original.splitlines()
        unparsed = ast.unparse(tree).splitlines()  # the mutant is compared with the unmutated tree's own unparse
        keys = [(module, lines[s["lineno"] - 1].strip(), s["col"], s["kind"], str(s["detail"])) for s in sites]
        if not (args.limit or args.lines):  # forget mutants of lines that no longer exist
            current = set(keys)
            state["mutants"] = [r for r in state["mutants"] if r["module"] != module
                                or (module, r["before"].strip(), r["col"], r["kind"], str(r["detail"])) in current]
        for i, (site, key) in enumerate(zip(sites, keys), 1):
            if key in done:
                continue
            mutant = mutate(tree, site)
            if mutant is None:
                continue
            mutated = ast.unparse(mutant)
            source_path.write_text(mutated)
            try:
                outcome, seconds, last = run_tests(work, TARGETS[module], args.timeout)
            finally:
                source_path.write_text(original)
            changed = [b for a, b in zip(unparsed, mutated.splitlines()) if a != b]
            after = changed[0] if changed else "(a line removed)"
            state["mutants"].append({
                "module": module, **site, "detail": site["detail"], "outcome": outcome, "seconds": round(seconds, 1),
                "before": lines[site["lineno"] - 1], "after": after, "last": last,
            })  # fmt: skip
            path.write_text(json.dumps(state, indent=1))
            print(f"  [{i}/{len(sites)}] {module}:{site['lineno']} {site['kind']} {site['detail']}: {outcome} "
                  f"({seconds:.0f} s)", flush=True)  # fmt: skip
    print(markdown(state["mutants"]))


if __name__ == "__main__":
    main()
