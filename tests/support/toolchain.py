"""Stand-ins for the C toolchain, first on ``PATH`` (#46: nothing the suite runs needs a
compiler). A call fails, as on a machine without one, and is noted with its caller."""

from __future__ import annotations

import os
from pathlib import Path

TOOLS = ("cc", "gcc", "c++", "g++", "clang", "clang++", "make", "ld")
CALLS = "MEGATRON_EXT_COMPILER_CALLS"  # the session's calls file (tests/conftest.py)


def session_folder() -> str:
    """The folder of the session's stand-ins, for a test that starts a process with a bare
    ``PATH``."""
    return str(Path(os.environ[CALLS]).parent)


def stand_ins(folder: Path, calls: Path) -> dict[str, str]:
    """Write the stand-ins into ``folder`` (the caller puts it first on ``PATH``) and return
    ``CC``/``CXX`` pointing at them. Each call appends ``tool args <- its parent's command
    line`` to ``calls`` and exits 1."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in TOOLS:
        tool = folder / name
        tool.write_text(
            "#!/bin/sh\n"
            f'echo "{name} $* <- $(tr "\\0" " " < /proc/$PPID/cmdline)" >> "{calls}"\n'
            "exit 1\n"
        )
        tool.chmod(0o755)
    return {"CC": str(folder / "cc"), "CXX": str(folder / "c++")}
