"""A training rank that fails ends, and takes its helper processes with it.

Data-loader workers inherit Megatron's SIGTERM handler (``--exit-signal-handler``), so at a
failed rank's exit ``multiprocessing`` SIGTERMs them, they ignore it, and it waits forever. On
failure (an exception, or a non-zero ``SystemExit``) the rank SIGKILLs its children first;
normal ends and Megatron's early exits are left alone.
"""

from __future__ import annotations

import multiprocessing
import signal
from collections.abc import Callable


def end_children() -> list[int]:
    """SIGKILL every live ``multiprocessing`` child of this process; returns their pids.

    SIGCHLD goes back to its default first: the data loader's handler raises in the main
    thread when one of its workers dies by a signal, which would cut this loop short."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    killed = []
    for child in multiprocessing.active_children():
        if child.pid is not None:
            child.kill()
            killed.append(child.pid)
    for child in multiprocessing.active_children():
        child.join(timeout=5)
    return killed


def ending_children_on_failure[T](run: Callable[[], T]) -> T:
    """Run ``run``; if it fails, end this process's helper processes before re-raising."""
    try:
        return run()
    except BaseException as exc:
        if not (isinstance(exc, SystemExit) and exc.code in (0, None)):
            end_children()
        raise
