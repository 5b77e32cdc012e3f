"""``skiplist --apply`` on a Megatron-Bridge checkpoint directory: Bridge resumes from
``latest_train_state.pt`` before Megatron's tracker, so the journaled apply rewrites it with the
rollback target's ``train_state.pt`` (and an undo puts the old one back). Files only; the
Bridge tier (tests/bridge) proves a real Bridge resume reads it."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from megatron_ext.common.files import (
    BRIDGE_TRACKER_FILE,
    BRIDGE_TRAIN_STATE_FILE,
    CHECKPOINT_TRACKER_FILE,
)
from megatron_ext.common.io import atomic_write_json
from megatron_ext.incidents import transaction


def _bridge_run(ckpt: Path) -> None:
    for step in (25, 30):
        (ckpt / f"iter_{step:07d}").mkdir(parents=True)
        (ckpt / f"iter_{step:07d}" / BRIDGE_TRAIN_STATE_FILE).write_bytes(b"state-%d" % step)
    (ckpt / BRIDGE_TRACKER_FILE).write_bytes(b"state-30")
    (ckpt / CHECKPOINT_TRACKER_FILE).write_text("30\n")


def _journal() -> transaction.Journal:
    return transaction.Journal(
        incident=1,
        incident_id="i1",
        rollback_to=25,
        tracker_before="30\n",
        skips_before=None,
        skips_after="26-37\n",
        moves=[["iter_0000030", "rolled_back/incident-001/iter_0000030"]],
        applied={"incident_id": "i1"},
    )


def test_apply_points_bridges_tracker_at_the_rollback_target(tmp_path: Path) -> None:
    _bridge_run(tmp_path)
    transaction.apply(tmp_path, _journal())
    assert (tmp_path / CHECKPOINT_TRACKER_FILE).read_text() == "25\n"
    assert (tmp_path / BRIDGE_TRACKER_FILE).read_bytes() == b"state-25"
    assert not (tmp_path / "iter_0000030").exists()


def test_undo_restores_bridges_tracker(tmp_path: Path) -> None:
    _bridge_run(tmp_path)
    journal = _journal()
    journal.bridge_tracker_before = "c3RhdGUtMzA="  # base64 of b"state-30"
    atomic_write_json(transaction.journal_path(tmp_path), asdict(journal))
    (tmp_path / BRIDGE_TRACKER_FILE).write_bytes(b"state-25")  # killed after the rewrite
    assert transaction.undo_pending(tmp_path) is not None
    assert (tmp_path / BRIDGE_TRACKER_FILE).read_bytes() == b"state-30"
    assert (tmp_path / CHECKPOINT_TRACKER_FILE).read_text() == "30\n"
