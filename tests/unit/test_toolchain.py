"""The suite runs with stand-ins for the C toolchain first on ``PATH`` (tests/conftest.py):
#46's "the suite passes on a machine without a C compiler", checked on every run."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from tests.support import toolchain


def test_every_toolchain_command_is_a_stand_in_for_the_whole_session() -> None:
    folder = Path(toolchain.session_folder())
    for tool in toolchain.TOOLS:
        assert Path(shutil.which(tool) or "").parent == folder, tool
    assert {os.environ["CC"], os.environ["CXX"]} == {str(folder / "cc"), str(folder / "c++")}


def test_a_stand_in_fails_and_notes_the_call_with_its_caller(tmp_path: Path) -> None:
    calls = tmp_path / "calls.txt"
    env = toolchain.stand_ins(tmp_path / "bin", calls)
    result = subprocess.run(["sh", "-c", f"{env['CC']} -c x.c"], capture_output=True)
    assert result.returncode == 1
    assert calls.read_text() == f"cc -c x.c <- sh -c {env['CC']} -c x.c \n"
