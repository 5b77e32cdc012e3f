"""How a training attempt ended, for the supervisor: Megatron exits 0 both at ``--train-iters``
and when it stops early, and only the latter must be relaunched, so rank 0 writes (at
:data:`ENV`'s path) whether ``pretrain`` returned, and why. No file: the training did not say.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from megatron_ext.common.io import atomic_write_json

ENV = "MEGATRON_EXT_ATTEMPT_END_FILE"


@dataclass(frozen=True)
class AttemptEnd:
    complete: bool  # pretrain returned: --train-iters (or --train-samples) reached
    reason: str  # why it stopped, for the supervisor's log line


def record(complete: bool, reason: str) -> None:
    """Write this attempt's end where the supervisor asked (rank 0; nothing when unsupervised)."""
    path = os.environ.get(ENV)
    if path:
        atomic_write_json(path, {"complete": complete, "reason": reason})


def read(path: Path) -> AttemptEnd | None:
    """The recorded end; None when the training wrote none (or the file is damaged)."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(value, dict):
        return None
    complete, reason = value.get("complete"), value.get("reason")
    if not isinstance(complete, bool) or not isinstance(reason, str):
        return None
    return AttemptEnd(complete, reason)
