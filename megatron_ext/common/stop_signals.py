"""The initializer of the checkpoint writer's results-queue Manager (the
``ckpt-results-queue-survives-sigterm`` fix in :mod:`megatron_ext.registry.fixes`), in a module
that imports nothing heavy: the Manager's spawned server imports it.
"""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def ignore_stop_signals(parent: int) -> None:
    """Runs in the Manager's process: SIGTERM/SIGINT are for the training, not for it (a stop
    signal reaches the whole process group, and the rank still needs the queue to finish its
    save). It ends with the rank instead: SIGKILLed when the thread that started it ends (by
    any signal, kill -9 included, or a normal exit), at once if it already has."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the rank died before the line above took effect
        os._exit(0)
