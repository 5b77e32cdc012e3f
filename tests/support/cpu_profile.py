"""Where the suite's CPU goes, per test: an opt-in pytest plugin (docs/testing.md).

``CPU_PROFILE_DIR=DIR .venv/bin/python -m pytest -p tests.support.cpu_profile`` appends one
JSON line per test (wall seconds, the CPU of the test process and of the children it waited
for: launches, ranks, subprocesses) to ``DIR/<xdist worker>.jsonl``;
``python -m tests.support.cpu_profile DIR`` sums them per file, most CPU first. Slurm jobs run
under slurmd, outside the count.
"""

from __future__ import annotations

import collections
import json
import os
import resource
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


def _cpu() -> float:
    own, children = (
        resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """Time one test, set-up and tear-down included."""
    wall, cpu = time.monotonic(), _cpu()
    yield
    line = {"test": item.nodeid, "wall": time.monotonic() - wall, "cpu": _cpu() - cpu}
    out = (
        Path(os.environ["CPU_PROFILE_DIR"])
        / f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.jsonl"
    )
    with open(out, "a") as handle:
        handle.write(json.dumps(line) + "\n")


def main(directory: str) -> None:
    """Print CPU and wall seconds and the test count per file, most CPU first."""
    files: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for path in Path(directory).glob("*.jsonl"):
        for line in path.read_text().splitlines():
            test = json.loads(line)
            row = files[test["test"].split("::")[0]]
            row[0], row[1], row[2] = row[0] + test["cpu"], row[1] + test["wall"], row[2] + 1
    print(f"{sum(r[0] for r in files.values()):.0f} CPU s in all")
    for name, (cpu, wall, count) in sorted(files.items(), key=lambda item: -item[1][0]):
        print(f"{cpu:7.0f} CPU s {wall:7.0f} s {count:4d} tests  {name}")


if __name__ == "__main__":
    main(sys.argv[1])
