"""The run lock in training: global rank 0 holds ``--save`` before anything is written.

The first feature installed: rank 0 takes the lease in ``install``, before distributed init.
Under the supervisor the lease is inherited, and a dead supervisor stops the training with
SIGTERM (save and exit); a training whose own lease was taken over exits without saving.
"""

from __future__ import annotations

import argparse
import atexit
import os
import signal
import sys
from typing import Any

from megatron_ext.common.features import Feature, FeatureError
from megatron_ext.common.run_lock import Lease, RunLockHeld, acquire


class RunLockFeature(Feature):
    name = "run_lock"

    def __init__(self) -> None:
        self.lease: Lease | None = None

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
        try:
            self.lease = acquire(args.save, "training", "training", args.force_run_lock)
        except RunLockHeld as exc:
            raise FeatureError(str(exc).removeprefix("megatron-ext: ")) from None
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
        supervised = self.lease.inherited_from is not None
        then = (
            "stopping the training (SIGTERM: save and exit) so that it does not go on unnoticed"
            if supervised
            else "another writer owns this run directory now, so this training exits without saving"
        )
        print(f"megatron-ext: ERROR: {message}; {then}", file=sys.stderr, flush=True)
        if not supervised:
            os._exit(3)
        os.kill(os.getpid(), signal.SIGTERM)
