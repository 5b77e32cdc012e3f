"""What ``megatron-ext demo`` echoes of a launch's output (the rest goes to train.log only).

Why: a newcomer reads the console. Megatron prints its argument dump and a memory report per
checkpoint; torchrun adds, after a worker failed, its own ``ChildFailedError`` traceback and a
summary, below the worker's message that already says what went wrong (a refusal at start-up,
an error). The demo shows iteration and validation lines, megatron-ext messages and errors,
and nothing from where torchrun's report begins.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import TextIO

# Megatron's argument dump at start-up ("  name ........ value"): values like
# error_injection_rate would otherwise pass the filter below.
_ARGUMENT_DUMP = re.compile(r"^\s*\S+ \.{2,} ")
# The first line of torchrun's report of a failed worker (torch 2.x's elastic agent).
_LAUNCHER_FAILED = re.compile(r"elastic.*\bfailed \(exitcode")


def shown(line: str) -> bool:
    """Iteration and validation lines, megatron-ext messages and errors; not Megatron's
    argument dump or its per-checkpoint memory report."""
    if _ARGUMENT_DUMP.match(line) or "memory (MB)" in line:
        return False
    return " iteration " in line or "megatron-ext" in line or "error" in line.lower()


def console(lines: Iterable[str], log: TextIO) -> Iterator[str]:
    """Every line into ``log``; the :func:`shown` ones back, until torchrun reports a failed
    worker (the worker said what went wrong just before)."""
    reported = False
    for line in lines:
        log.write(line)
        reported = reported or bool(_LAUNCHER_FAILED.search(line))
        if not reported and shown(line):
            yield line.rstrip()
