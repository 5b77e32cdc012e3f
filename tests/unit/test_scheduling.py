"""The suite's xdist units (tests/conftest.py): every test file that asks for a session-scoped
launch shares one unit with the other files that ask for it, or the launch would run once per
worker (and two Slurm clusters would start side by side)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from tests.conftest import SHARED, TESTS, unit_of

# Session-scoped, but cheap enough to make once per worker (a tiny corpus, ~5 s).
PER_WORKER = {"data_args"}


def _session_fixtures() -> set[str]:
    names = set()
    for conftest in TESTS.rglob("conftest.py"):
        for node in ast.walk(ast.parse(conftest.read_text())):
            if isinstance(node, ast.FunctionDef) and any(
                isinstance(d, ast.Call)
                and any(
                    k.arg == "scope" and getattr(k.value, "value", None) == "session"
                    for k in d.keywords
                )
                for d in node.decorator_list
            ):
                names.add(node.name)
    return names - PER_WORKER


def _users(fixtures: set[str]) -> dict[str, set[str]]:
    """Fixture -> the test files whose tests (or module fixtures) take it as an argument."""
    users: dict[str, set[str]] = defaultdict(set)
    for path in TESTS.rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                for arg in node.args.args:
                    if arg.arg in fixtures:
                        users[arg.arg].add(path.relative_to(TESTS).as_posix())
    return users


def test_every_set_names_existing_files() -> None:
    missing = [p for paths in SHARED.values() for p in paths if not (TESTS / p).is_file()]
    assert not missing, f"tests/conftest.py SHARED names files that do not exist: {missing}"


def test_the_files_sharing_a_session_launch_share_a_unit() -> None:
    fixtures = _session_fixtures()
    assert {"tp2", "matrix", "real_shaped"} <= fixtures, "the launch fixtures were not found"
    users = _users(fixtures)
    split = {
        name: sorted(files) for name, files in users.items() if len({unit_of(f) for f in files}) > 1
    }
    assert not split, f"add these files to one set of tests/conftest.py SHARED: {split}"


def test_the_slurm_files_share_a_unit() -> None:
    slurm = [
        p.relative_to(TESTS).as_posix()
        for p in TESTS.rglob("test_*.py")
        if p != Path(__file__)
        and any(m in p.read_text() for m in ("support.slurm", "support.multinode"))
    ]
    assert len(slurm) >= 2 and len({unit_of(p) for p in slurm}) == 1, slurm
