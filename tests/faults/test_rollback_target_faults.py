"""``skiplist --apply`` when the checkpoint it would roll back to cannot be loaded.

The run is the real-shaped drill's (tests/support/drill.py, the session's ``real_shaped``):
DP=2, torch_dist checkpoints every 5 iterations, each with two data files (``__0_0.distcp``,
``__1_0.distcp``) indexed by ``.metadata``; the spike's onset is 32 and every rank exits 42 at
35. Each test copies what the first attempt left before its plan (checkpoints 5-30, the tracker
at 30, the first attempt's signals and spike ledger), damages the copy for real and runs the
real CLI in its own process. With ``--rollback-iters 5`` the target is 25, with 30 newer.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import pytest

from megatron_ext.common.files import (
    CHECKPOINT_COMMON_FILE,
    CHECKPOINT_METADATA_FILE,
    CHECKPOINT_TRACKER_FILE,
    DCP_METADATA_FILE,
    checkpoint_dir,
)
from tests.support.faults import fault
from tests.support.harness import run_skiplist

pytestmark = pytest.mark.e2e

CHECKPOINTS = range(5, 31, 5)
PLAN = ["--rollback-iters", "5", "--skip-batches", "20", "--no-lookup", "--apply"]


@pytest.fixture(scope="module")
def before_plan(real_shaped: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The drill's run as its first attempt left it, before ``skiplist`` (which the drill then
    applied: checkpoint 30 is kept as it was under ``first/``)."""
    work, root = real_shaped["work"], tmp_path_factory.mktemp("before-plan")
    for iteration in CHECKPOINTS:
        source = checkpoint_dir(work / "ckpt", iteration)
        if iteration == 30:
            source = checkpoint_dir(work / "first" / "ckpt", iteration)
        shutil.copytree(source, checkpoint_dir(root / "ckpt", iteration))
    (root / "ckpt" / CHECKPOINT_TRACKER_FILE).write_text("30")
    (root / "signals").mkdir()
    for name in ("signals.jsonl", "spikes.jsonl"):
        lines = (work / "signals" / name).read_text().splitlines(keepends=True)
        first = [line for line in lines if json.loads(line).get("attempt") == 1]
        (root / "signals" / name).write_text("".join(first))
    return root


def _copy(before_plan: Path, tmp_path: Path) -> Path:
    return shutil.copytree(before_plan, tmp_path / "run")


def _state(root: Path) -> dict:
    ckpt = root / "ckpt"
    return {
        "checkpoints": sorted(p.name for p in ckpt.glob("iter_*")),
        "rolled_back": sorted(str(p.relative_to(ckpt)) for p in ckpt.glob("rolled_back/*/*")),
        "tracker": (ckpt / CHECKPOINT_TRACKER_FILE).read_text(),
        "skips": sorted(p.name for p in ckpt.glob("megatron_ext_skip*")),
        "applied": (ckpt / "megatron_ext_incidents" / "applied.jsonl").exists(),
    }


def _load_everything(directory: Path) -> int:
    """Read back every item of a torch_dist checkpoint as Megatron's load does (its common
    state by megatron-core's ``load_common_state_dict``, every tensor and byte item through
    torch DCP, without a model to shard into); the checkpoint's iteration."""
    import torch
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.serialization import load_common_state_dict
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(directory)).read_metadata()
    items = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        if isinstance(meta, TensorStorageMetadata)
        else io.BytesIO()
        for key, meta in metadata.state_dict_metadata.items()
    }
    dcp.load(items, checkpoint_id=str(directory), no_dist=True)
    return int(load_common_state_dict(str(directory))["iteration"])


def _unloadable(directory: Path) -> bool:
    """Whether loading fails (torch's CheckpointException derives from BaseException)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        _load_everything(directory)
    except (Exception, CheckpointException):
        return True
    return False


def _falls_back(root: Path, damaged: str) -> None:
    """The apply passes over 25 (its problem named in the plan and on the console), rolls
    back to 20, moves 25 and 30 aside, and the tracker names a checkpoint that loads; a rerun
    has nothing left to do."""
    ckpt = root / "ckpt"
    assert _unloadable(checkpoint_dir(ckpt, 25))  # the damage is real: Megatron would crash
    result = run_skiplist(root, *PLAN)
    assert result.returncode == 0, result.stderr[-3000:]
    note = f"passed over checkpoint 25, which cannot be loaded: {damaged}"
    assert note in result.stdout and "Roll back to checkpoint 20" in result.stdout
    plan = json.loads((ckpt / "megatron_ext_incidents" / "incident-001.json").read_text())
    assert plan["rollback_to"] == 20 and plan["moved_checkpoints"] == [25, 30]
    assert [p["checkpoint"] for p in plan["passed_over"]] == [25]
    assert damaged in plan["passed_over"][0]["problem"]
    aside = ckpt / "rolled_back" / "incident-001"
    assert _state(root)["checkpoints"] == [f"iter_{i:07d}" for i in (5, 10, 15, 20)]
    assert sorted(p.name for p in aside.iterdir()) == ["iter_0000025", "iter_0000030"]
    assert _load_everything(aside / "iter_0000030") == 30  # the newer good one, kept whole
    tracker = int((ckpt / CHECKPOINT_TRACKER_FILE).read_text())
    assert tracker == 20 and _load_everything(checkpoint_dir(ckpt, tracker)) == 20
    again = run_skiplist(root, *PLAN)  # the supervisor's rerun: nothing left to do
    assert again.returncode == 0 and "is already applied: rolled back to 20" in again.stdout


@fault(
    "the rollback target's data file deleted (`__1_0.distcp`; its `metadata.json` kept)",
    "`skiplist --apply` passes it over, naming it and the missing file (console and plan "
    "`passed_over`), rolls back to the next older loadable checkpoint and moves the damaged and "
    "newer ones aside; the tracker names a checkpoint that loads",
    area="skiplist",
)
def test_a_target_without_a_data_file_is_passed_over(before_plan, tmp_path) -> None:
    root = _copy(before_plan, tmp_path)
    (checkpoint_dir(root / "ckpt", 25) / "__1_0.distcp").unlink()
    _falls_back(root, f"__1_0.distcp is missing (named in {DCP_METADATA_FILE})")


@fault(
    "the rollback target's data file truncated (`__0_0.distcp` cut to half)",
    "passed over, naming the file, its length and the byte it is read up to; rolled back to "
    "the next older loadable checkpoint, the tracker names a checkpoint that loads",
    area="skiplist",
)
def test_a_target_with_a_truncated_data_file_is_passed_over(before_plan, tmp_path) -> None:
    root = _copy(before_plan, tmp_path)
    data = checkpoint_dir(root / "ckpt", 25) / "__0_0.distcp"
    size = data.stat().st_size
    os.truncate(data, size // 2)
    _falls_back(root, f"__0_0.distcp is truncated: {size // 2} bytes, read up to byte")


@fault(
    "the rollback target's `.metadata` (torch DCP's index of the data files) deleted",
    "passed over, naming the missing index; rolled back to the next older loadable "
    "checkpoint, the tracker names a checkpoint that loads",
    area="skiplist",
)
def test_a_target_without_its_dcp_index_is_passed_over(before_plan, tmp_path) -> None:
    root = _copy(before_plan, tmp_path)
    (checkpoint_dir(root / "ckpt", 25) / DCP_METADATA_FILE).unlink()
    _falls_back(root, f"{DCP_METADATA_FILE} (the index of the data files) is missing")


@fault(
    "an `--async-save` that never finished at the rollback target, as megatron-core 0.17/0.18 "
    "leave it (`common.pt` and data files written, no `.metadata`, no `metadata.json`)",
    "never the target: passed over as a save that never finished; rolled back to the next "
    "older loadable checkpoint",
    area="skiplist",
)
def test_an_unfinished_async_save_is_never_the_target(before_plan, tmp_path) -> None:
    import torch
    from megatron.core.dist_checkpointing.serialization import load_common_state_dict

    root = _copy(before_plan, tmp_path)
    target = checkpoint_dir(root / "ckpt", 25)
    # Their torch_dist save writes common.pt first (save_common, synchronously), the data files
    # in the background, then .metadata and metadata.json in the finalize that never ran.
    torch.save(load_common_state_dict(str(target)), target / CHECKPOINT_COMMON_FILE)
    (target / CHECKPOINT_METADATA_FILE).unlink()
    (target / DCP_METADATA_FILE).unlink()
    _falls_back(root, f"no {CHECKPOINT_METADATA_FILE} (a save that never finished")


@fault(
    "every checkpoint before the onset damaged (data file deleted or truncated, `.metadata` "
    "or `metadata.json` unreadable, `common.pt` of an unfinished save)",
    "refused (exit 2) naming each checkpoint and what is wrong with it; nothing moved, tracker "
    "and skip list unchanged, no incident recorded",
    area="skiplist",
)
def test_no_loadable_target_is_refused_and_nothing_moves(before_plan, tmp_path) -> None:
    root = _copy(before_plan, tmp_path)
    ckpt = root / "ckpt"
    (checkpoint_dir(ckpt, 25) / DCP_METADATA_FILE).unlink()
    (checkpoint_dir(ckpt, 20) / "__1_0.distcp").unlink()
    os.truncate(checkpoint_dir(ckpt, 15) / "__0_0.distcp", 4096)
    (checkpoint_dir(ckpt, 10) / DCP_METADATA_FILE).write_bytes(b"\x80\x04garbage")
    (checkpoint_dir(ckpt, 5) / CHECKPOINT_METADATA_FILE).unlink()
    (checkpoint_dir(ckpt, 5) / CHECKPOINT_COMMON_FILE).write_bytes(b"PK half written")
    before = _state(root)
    result = run_skiplist(root, *PLAN)
    assert result.returncode == 2, result.stdout + result.stderr[-3000:]
    assert "no loadable checkpoint at or before iteration 27: every one is damaged" in (
        result.stderr
    )
    for named in (
        f"25: {DCP_METADATA_FILE} (the index of the data files) is missing",
        f"20: __1_0.distcp is missing (named in {DCP_METADATA_FILE})",
        "15: __0_0.distcp is truncated: 4096 bytes",
        f"10: {DCP_METADATA_FILE} is unreadable",
        f"5: no {CHECKPOINT_METADATA_FILE}",
    ):
        assert named in result.stderr, (named, result.stderr)
    assert "Traceback" not in result.stderr
    assert _state(root) == before and before["tracker"] == "30" and not before["skips"]
    assert not (ckpt / "rolled_back").exists()
    assert not (ckpt / "megatron_ext_incidents").exists()


@fault(
    "the newest checkpoint's DCP index (`.metadata`, which holds its saved args) deleted and no "
    "`--train-iters` "
    "given (the planner read the run's length from the newest checkpoint's args and refused "
    "the plan that would have moved it aside)",
    "the run's length is read from the newest checkpoint that reads (25); the plan rolls back "
    "to 25 and moves the damaged 30 aside",
    area="skiplist",
)
def test_a_damaged_newest_checkpoint_does_not_refuse_the_plan(before_plan, tmp_path) -> None:
    root = _copy(before_plan, tmp_path)
    (checkpoint_dir(root / "ckpt", 30) / DCP_METADATA_FILE).unlink()
    result = run_skiplist(root, *PLAN)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Roll back to checkpoint 25" in result.stdout
    plan = json.loads((root / "ckpt" / "megatron_ext_incidents" / "incident-001.json").read_text())
    assert plan["rollback_to"] == 25 and plan["moved_checkpoints"] == [30]
    assert _load_everything(checkpoint_dir(root / "ckpt", 25)) == 25
