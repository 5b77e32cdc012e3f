"""The run lock in training: global rank 0 holds ``--save`` before anything is written.

:class:`RunLockFeature` is the first feature installed (``loop.all_features``), so on rank 0
the lease is taken in ``install``, after the flags are validated and before distributed
initialisation, the skip list, the signals or sample logs or any checkpoint are written. One
process per job takes it (global rank 0, on whichever node it runs); the other ranks write
only after rank 0 has joined the process group, which it does only when holding the lease.

Under the supervisor the lease is the supervisor's (its token is in the environment); rank 0
then heartbeats a child file and watches the supervisor: when the supervisor is dead, the
training is stopped with SIGTERM, so Megatron's ``--exit-signal-handler`` (which the
supervisor always passes) saves and exits instead of training on unnoticed. A training whose
own lease was taken over (``--force-run-lock`` elsewhere) stops at once without saving.
"""

from __future__ import annotations

import argparse
import atexit
import os
import signal
import sys
import time
from typing import Any

from megatron_ext.common.features import Feature, FeatureError
from megatron_ext.common.run_lock import Lease, RunLockHeld, acquire


class RunLockFeature(Feature):
    name = "run_lock"

    def __init__(self) -> None:
        self.lease: Lease | None = None
        self.acquire_s = 0.0

    def add_args(self, group: argparse._ArgumentGroup) -> None:
        group.add_argument(
            "--force-run-lock",
            action="store_true",
            help="Take over the run lock of --save even though its holder looks alive (only "
            "for a holder known to be dead, e.g. its node is gone). Without it a second "
            "training on the same --save refuses at start-up, naming the holder.",
        )

    def enabled(self, args: Any) -> bool:
        return bool(args.save)

    def install(self, args: Any) -> None:
        if args.rank != 0:
            return
        start = time.perf_counter()
        try:
            self.lease = acquire(args.save, "training", "training", args.force_run_lock)
        except RunLockHeld as exc:
            raise FeatureError(str(exc).removeprefix("megatron-ext: ")) from None
        self.acquire_s = time.perf_counter() - start
        atexit.register(self.lease.release)
        self.lease.watch(self._lost)

    def on_checkpoint(self, iteration: int) -> bool:
        """Renew and verify the lease before every save (rank 0): a training that lost its
        lease stops before it writes a checkpoint into another writer's directory."""
        if self.lease is not None and (lost := self.lease.beat()):
            self._lost(lost)
        return True

    def _lost(self, message: str) -> None:
        assert self.lease is not None
        if self.lease.inherited_from is not None:
            print(
                f"megatron-ext: ERROR: {message}; stopping the training (SIGTERM: save and "
                "exit) so that it does not go on unnoticed",
                file=sys.stderr,
                flush=True,
            )
            os.kill(os.getpid(), signal.SIGTERM)
            return
        print(
            f"megatron-ext: ERROR: {message}; another writer owns this run directory now, "
            "so this training exits without saving",
            file=sys.stderr,
            flush=True,
        )
        os._exit(3)
