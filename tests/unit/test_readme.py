"""README's three commands are the ones CI runs (set-up, test) and the demo entry point exists."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _commands() -> list[str]:
    section = REPO.joinpath("README.md").read_text().split("## Commands", 1)[1].split("\n## ")[0]
    return re.findall(r"^    (\S.*)$", section, flags=re.M)


def test_readme_has_exactly_setup_test_and_demo_and_ci_runs_the_first_two() -> None:
    setup, test, demo = _commands()
    ci = REPO.joinpath(".ci", "run").read_text().splitlines()
    assert setup in ci and test in ci
    assert demo == ".venv/bin/megatron-ext demo"
