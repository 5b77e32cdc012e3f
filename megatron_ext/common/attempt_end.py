"""How a training attempt ended, in the training's own words, for the supervisor.

Megatron exits 0 both at ``--train-iters`` and when it stops early with a checkpoint saved, and
only the latter must be relaunched: rank 0 writes a small JSON file (at :data:`ENV`'s path)
saying ``pretrain`` returned or raised ``SystemExit(0)``, and why. No file: the training did
not say (a crash, or a script that does not start through ``megatron_ext.fork``).
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
    """Write this attempt's end where the supervisor asked (the caller is rank 0; nothing
    when the training was not started by the supervisor)."""
    path = os.environ.get(ENV)
    if path:
        atomic_write_json(path, {"complete": complete, "reason": reason})


def read(path: Path) -> AttemptEnd | None:
    """The recorded end, or None when the training wrote none (or the file is damaged: then
    the supervisor cannot know either, and says so)."""
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
