"""A training rank that fails ends, and takes its helper processes with it.

Why: the launchers always pass ``--exit-signal-handler``, so Megatron's Python SIGTERM handler
(it only records the signal) is installed before the data loader forks its workers, and the
workers inherit it. When the rank then fails with an exception, the traceback keeps the data
iterator alive, so its workers are never shut down by the loader; at interpreter exit
``multiprocessing`` sends each daemonic child SIGTERM, which they now ignore, and joins them:
the rank waits in ``os.waitpid`` forever and the job idles until its time limit (issue #37).
Resetting SIGTERM in the workers instead would break the clean save on a stop signal, which
reaches the whole process group: the workers would die and the rank could not fetch the batch
it needs to reach its save.

So on failure (any exception, or ``SystemExit`` with a non-zero code) the rank SIGKILLs its
``multiprocessing`` children (data-loader workers, the checkpoint writer's results-queue
Manager) before the exception goes on; a normal end and Megatron's own early exits (which
``sys.exit(0)`` after finishing their saves) are left to the usual shutdown.
"""

from __future__ import annotations

import multiprocessing
import signal
from collections.abc import Callable


def _failed(exc: BaseException) -> bool:
    return not (isinstance(exc, SystemExit) and exc.code in (0, None))


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
        if _failed(exc):
            end_children()
        raise
