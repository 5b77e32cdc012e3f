"""README is a one-page overview: its three commands are the ones CI runs (set-up, test) and the
demo entry point; every relative link of README and docs/ reaches a file and heading."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
MAX_WORDS = 1500  # the rest belongs in a docs/ page per topic


def _commands() -> list[str]:
    section = README.read_text().split("## Commands", 1)[1].split("\n## ")[0]
    return re.findall(r"^    (\S.*)$", section, flags=re.M)


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_readme_has_exactly_setup_test_and_demo_and_ci_runs_the_first_two() -> None:
    setup, test, demo = _commands()
    ci = REPO.joinpath(".ci", "run").read_text().splitlines()
    assert setup in ci and test in ci
    assert demo == ".venv/bin/megatron-ext demo"


def test_readme_is_a_one_page_overview() -> None:
    words = len(README.read_text().split())
    assert words <= MAX_WORDS, f"README has {words} words: move details to a docs/ page"


def test_every_relative_link_in_readme_and_docs_resolves() -> None:
    broken = []
    pages = [README, *sorted(REPO.joinpath("docs").glob("*.md"))]
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists() or (anchor and anchor not in _anchors(linked)):
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert len(pages) > 5 and not broken, broken


def test_every_repository_path_named_in_readme_and_docs_exists() -> None:
    """A file or folder named in backticks (`megatron_ext/...`, `tools/...`, globs too) is there:
    a module merged or removed takes its mentions along."""
    named = re.compile(r"`((?:megatron_ext|tools|launch|tests|benchmarks|docs)/[^`\s<]*)")
    missing = [
        f"{page.relative_to(REPO)}: {path}"
        for page in [README, *sorted(REPO.joinpath("docs").glob("*.md"))]
        for path in named.findall(page.read_text())
        if not any(REPO.glob(path.split("::")[0].rstrip("/")))  # a test id names its file
    ]
    assert not missing, missing
