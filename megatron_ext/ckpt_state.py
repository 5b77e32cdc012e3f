"""A checkpoint's common state (Megatron's saved ``args``, iteration), or a clear refusal.

Both the planner and the lookup read what a run was configured with from its checkpoints.
A damaged or half-copied checkpoint makes megatron-core / torch raise
``torch.distributed.checkpoint.api.CheckpointException``, which derives from
``BaseException`` (so ``except Exception`` does not catch it) and prints a per-rank
traceback. Here every such failure becomes :class:`CheckpointUnreadable`, naming the directory
and what to do. Megatron is imported only when a checkpoint is actually read.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class CheckpointUnreadable(ValueError):
    """The checkpoint's common state cannot be read; the message names it and the fix."""


@contextlib.contextmanager
def _quiet_root_logger() -> Iterator[None]:
    """torch's checkpoint loader logs each failed metadata read with its traceback on the
    *root* logger before raising; the refusal below says it once, readably."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


def load_common_state(directory: str | Path) -> dict[str, Any]:
    """``load_common_state_dict`` of one ``iter_NNNNNNN`` directory, errors made readable."""
    from megatron.core.dist_checkpointing.serialization import load_common_state_dict
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with _quiet_root_logger():
            state = load_common_state_dict(str(directory))
    except (Exception, CheckpointException) as exc:
        detail = str(exc).strip().splitlines()
        reason = next(
            (line.strip() for line in reversed(detail) if line.strip()), type(exc).__name__
        )
        raise CheckpointUnreadable(
            f"checkpoint {directory} is unreadable ({type(exc).__name__}: {reason[:300]}): it "
            "is corrupt or was copied partially. Restore it from a backup, or move it out of "
            "the checkpoint directory so that an older one is used"
        ) from None
    if not isinstance(state, dict) or "args" not in state:
        raise CheckpointUnreadable(
            f"checkpoint {directory} holds no saved Megatron args (not a Megatron training "
            "checkpoint?)"
        )
    return state
