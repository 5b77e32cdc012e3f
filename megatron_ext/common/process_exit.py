"""A training rank that fails ends, and takes its helper processes with it: data-loader workers
inherit Megatron's SIGTERM handler, so ``multiprocessing`` would SIGTERM them at exit and wait
forever.
"""

from __future__ import annotations

import multiprocessing
import signal
from collections.abc import Callable


def ending_children_on_failure[T](run: Callable[[], T]) -> T:
    """Run ``run``; if it fails (an exception, a non-zero ``SystemExit``), SIGKILL every live
    ``multiprocessing`` child before re-raising (SIGCHLD reset first: the data loader's
    handler would raise when a worker dies by a signal)."""
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
