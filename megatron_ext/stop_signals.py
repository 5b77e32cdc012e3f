"""The initializer of the checkpoint writer's results-queue Manager (see the
``ckpt-results-queue-survives-sigterm`` fix in :mod:`megatron_ext.fixes`).

Its own module, importing nothing heavy: the Manager's server is a fresh (spawned) Python
that imports this module to run it, and importing ``megatron_ext.fixes`` there (torch) made
every run's first checkpoint save ~2.5-7 s slower.
"""

from __future__ import annotations

import signal


def ignore_stop_signals() -> None:
    """Runs in the Manager's process: SIGTERM/SIGINT are for the training, not for it."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
