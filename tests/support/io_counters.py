"""What this process read, as the kernel counts it: tests that a reader seeks instead of
scanning assert on it (a reader's own counters could miss a stray full read)."""

from __future__ import annotations

from pathlib import Path

PROC_IO = Path("/proc/self/io")


def rchar() -> int:
    """Bytes this process has read through read(2) and friends so far (``/proc/self/io``)."""
    for line in PROC_IO.read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError(f"no rchar in {PROC_IO}")
