"""docs/faults.md is exactly what the fault tests declare (regenerate it when adding one)."""

from __future__ import annotations

from pathlib import Path

from tests.support import faults

DOC = Path(__file__).resolve().parents[2] / "docs" / "faults.md"


def test_docs_faults_md_is_generated_from_the_tests() -> None:
    rendered = faults.render()
    assert DOC.is_file() and DOC.read_text() == rendered, (
        "docs/faults.md is stale: run `python tests/support/faults.py > docs/faults.md`"
    )
    assert rendered.count("\n| ") >= 1
