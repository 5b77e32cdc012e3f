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


def ending_children_on_failure[T](run: Callable[[], T]) -> T:
    """Run ``run``; if it fails, SIGKILL every live ``multiprocessing`` child before re-raising.

    SIGCHLD goes back to its default first: the data loader's handler raises in the main
    thread when one of its workers dies by a signal, which would cut the kills short."""
    try:
        return run()
    except BaseException as exc:
        if not (isinstance(exc, SystemExit) and exc.code in (0, None)):
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            children = multiprocessing.active_children()
            for child in children:
                child.kill()
            for child in children:
                child.join(timeout=5)
        raise
