"""GPU check only (rung 4): count the host syncs megatron-ext's own code adds per step.

Loaded by every Python process that has this directory on PYTHONPATH; does nothing unless
``MEGATRON_EXT_COUNT_SYNCS=FILE`` is set. It turns on PyTorch's sync debug mode (a warning
for every operation that makes the host wait for the GPU), keeps the ones whose Python stack
passes through ``megatron_ext/`` (Megatron's own syncs are not the overlay's), and writes the
count per call site and per training step to FILE (``.rank<N>`` appended) at exit.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import traceback
import warnings

_FILE = os.environ.get("MEGATRON_EXT_COUNT_SYNCS")


def _install(path: str) -> None:
    import torch

    if not torch.cuda.is_available():
        return
    sites: collections.Counter[str] = collections.Counter()
    original = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message).lower():
            return original(message, category, filename, lineno, file, line)
        ours = [f for f in traceback.extract_stack() if "/megatron_ext/" in f.filename]
        if ours:
            sites[f"{ours[-1].filename.split('/megatron_ext/')[-1]}:{ours[-1].lineno}"] += 1
        return None

    warnings.showwarning = showwarning
    warnings.simplefilter("always", UserWarning)
    torch.cuda.set_sync_debug_mode("warn")

    def dump() -> None:
        from megatron.training import get_args

        try:
            steps = max(1, int(get_args().curr_iteration))
        except Exception:  # never initialised (the launcher process)
            return
        rank = os.environ.get("RANK", "0")
        total = sum(sites.values())
        with open(f"{path}.rank{rank}", "w") as out:
            json.dump(
                {
                    "per_step": round(total / steps, 2),
                    "total": total,
                    "steps": steps,
                    "sites": dict(sites),
                },
                out,
            )

    atexit.register(dump)


if _FILE:
    _install(_FILE)
