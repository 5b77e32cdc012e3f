"""What the run lock costs, side by side with what Megatron does anyway, in one run.

- **start-up**: ``acquire`` + ``release`` of the lease on a run directory (rank 0, once per
  launch; it publishes a temporary file with ``link(2)``), and the inherited case (a training
  under the supervisor: read the lease, publish the child file);
- **per checkpoint**: one heartbeat (``Lease.beat``: read the lease, compare tokens, ``utime``;
  inherited: also read and judge the supervisor's lease), which rank 0 runs before every save;
- **reference**: writing Megatron's checkpoint tracker (``latest_checkpointed_iteration.txt``,
  atomically, fsynced), the smallest file Megatron writes at every save.

All on the same filesystem (``--dir``; default a temporary directory: put it on the shared
filesystem of your cluster to measure there), medians of ``--reps``:

    python benchmarks/runlock.py                   # the figures in BENCHMARKS.md
    python benchmarks/runlock.py --dir /lustre/run --reps 200
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from megatron_ext.common import run_lock as runlock
from megatron_ext.common.io import atomic_write


def median_ms(action: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--reps", type=int, default=500)
    options = parser.parse_args()
    root = options.dir or Path(tempfile.mkdtemp(prefix="runlock-bench-"))
    run = root / "run"
    run.mkdir(parents=True, exist_ok=True)

    def start_up() -> None:
        runlock.acquire(run, "training", "bench").release()

    supervisor = runlock.acquire(run, "supervisor", "bench")
    os.environ[runlock.TOKEN_ENV] = supervisor.holder.token

    def inherited_start_up() -> None:
        runlock.acquire(run, "training", "bench").release()

    inherited = median_ms(inherited_start_up, options.reps)
    child = runlock.acquire(run, "training", "bench")
    inherited_beat = median_ms(child.beat, options.reps)
    child.release()
    del os.environ[runlock.TOKEN_ENV]
    supervisor.release()
    own = median_ms(start_up, options.reps)
    lease = runlock.acquire(run, "training", "bench")
    beat = median_ms(lease.beat, options.reps)
    lease.release()
    tracker = run / "latest_checkpointed_iteration.txt"
    reference = median_ms(lambda: atomic_write(tracker, "1000\n"), options.reps)

    print(f"filesystem: {root} ({options.reps} reps, medians)")
    print("| what | ms | / tracker write |")
    print("|---|---:|---:|")
    rows = [
        ("start-up: acquire + release (own lease)", own),
        ("start-up: inherited from the supervisor (child lease)", inherited),
        ("per checkpoint: heartbeat (own lease)", beat),
        ("per checkpoint: heartbeat (inherited, judges the supervisor)", inherited_beat),
        ("reference: Megatron's tracker file, atomic + fsync", reference),
    ]
    for name, ms in rows:
        print(f"| {name} | {ms:.3f} | {ms / reference:.3f} |")
    if options.dir is None:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
