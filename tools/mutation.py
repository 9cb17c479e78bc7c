"""Mutation testing of hspmd's core modules with mutmut (`make mutation`; not part of `make test`).

Each module is mutated alone against the fast tests that cover it (MODULES below), in its own
scratch copy of the project (mutmut writes its mutants beside the sources it reads, so the
working tree is never touched). Prints and writes one line per module: killed / mutants = score;
"survived" lists the mutants no test caught (`--show` prints their diffs).

    python tools/mutation.py                      # every module
    python tools/mutation.py schedules geometry   # some (names from MODULES)
    python tools/mutation.py schedules --show     # and the surviving mutants' diffs

Needs the `mutation` extra (`pip install -e .[mutation]`). Slow: run it under `nice`.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# module -> (source file, the fast tests that cover it)
MODULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "geometry": ("hspmd/annotations/geometry.py",
                 ("tests/test_annotations.py", "tests/test_annotation_properties.py", "tests/test_init_pieces.py")),
    "resolver": ("hspmd/comm_resolve/resolver.py",
                 ("tests/test_resolve_primitives.py", "tests/test_resolve_plan.py", "tests/test_resolve_property.py")),
    "bsr": ("hspmd/comm_resolve/bsr.py", ("tests/test_resolve_bsr.py", "tests/test_table2.py")),
    "rules": ("hspmd/ops/rules.py", ("tests/test_ops_deduction.py", "tests/test_specialize_properties.py")),
    "plan_executor": ("hspmd/backends/plan_executor.py",
                      ("tests/test_resolve_property.py", "tests/test_boxing_matrix.py", "tests/test_meta_device.py")),
    "schedules": ("hspmd/specialize/schedules.py", ("tests/test_schedules.py", "tests/test_warmup.py")),
}
KILLED = {"killed", "timeout", "segfault"}  # a test failed, hung or crashed: the mutant was caught


def _pyproject(source: str, tests: tuple[str, ...]) -> str:
    lines = [
        "[tool.mutmut]",
        'source_paths = ["hspmd"]',
        f'only_mutate = ["{source}"]',
        "pytest_add_cli_args_test_selection = [" + ", ".join(f'"{t}"' for t in tests) + "]",
        'pytest_add_cli_args = ["-q", "-p", "no:cacheprovider", "-m", "not multiprocess", "-x"]',
        "",
    ]
    return "\n".join(lines)


def run_module(name: str, show: bool) -> tuple[int, int, list[str]]:
    """(killed, total, surviving mutant names) of one module."""
    source, tests = MODULES[name]
    with tempfile.TemporaryDirectory(prefix=f"hspmd-mutation-{name}-") as tmp:
        work = Path(tmp)
        shutil.copytree(ROOT / "hspmd", work / "hspmd", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copytree(ROOT / "tests", work / "tests", ignore=shutil.ignore_patterns("__pycache__"))
        (work / "pyproject.toml").write_text(_pyproject(source, tests))
        # mutmut puts its mutated copy first on sys.path; a PYTHONPATH (e.g. a worktree) would shadow it
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        mutmut = [sys.executable, "-m", "mutmut"]
        subprocess.run(mutmut + ["run", "--max-children", "1"], cwd=work, env=env, check=False,
                       stdout=subprocess.DEVNULL)
        out = subprocess.run(mutmut + ["results", "--all", "true"], cwd=work, env=env, check=True,
                             capture_output=True, text=True).stdout
        statuses = dict(re.findall(r"^\s*(\S+): (\S.*)$", out, re.M))
        survived = sorted(m for m, s in statuses.items() if s.strip() not in KILLED)
        if show:
            for m in survived:
                print(subprocess.run(mutmut + ["show", m], cwd=work, env=env, capture_output=True, text=True).stdout)
        killed = sum(1 for s in statuses.values() if s.strip() in KILLED)
        return killed, len(statuses), survived


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("modules", nargs="*", metavar="MODULE", help=f"some of {', '.join(MODULES)} (default: all)")
    p.add_argument("--show", action="store_true", help="print the surviving mutants")
    p.add_argument("--out", default="mutation-scores.txt", help="where to write the scores")
    args = p.parse_args(argv)
    unknown = [m for m in args.modules if m not in MODULES]
    if unknown:
        p.error(f"unknown module(s) {', '.join(unknown)}; choose from {', '.join(MODULES)}")
    lines = []
    for name in args.modules or list(MODULES):
        killed, total, survived = run_module(name, args.show)
        score = killed / total if total else float("nan")
        line = f"{name:14s} {MODULES[name][0]:36s} {killed:4d} / {total:4d} killed = {score:6.1%}  survived: {len(survived)}"
        print(line, flush=True)
        lines.append(line + ("\n    " + " ".join(survived) if survived else ""))
    Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
