"""The rollback target is a checkpoint Megatron can load: the load check
(``checkpoint_state.checkpoint_problem``) on real-format torch_dist and legacy checkpoints, and
the planner's lazy walk over the candidates (``planner.choose_target``). The same damage in a
real run's checkpoints, through the real CLI: tests/faults/test_rollback_target_faults.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from megatron_ext.common import checkpoint_state
from megatron_ext.common.checkpoint_state import UnreadableState, checkpoint_problem
from megatron_ext.common.files import (
    CHECKPOINT_COMMON_FILE,
    CHECKPOINT_METADATA_FILE,
    DCP_METADATA_FILE,
    LEGACY_MODEL_FILE,
)
from megatron_ext.incidents.planner import NAMED, PlanConfig, PlanError, choose_target, make_plan
from tests.support.checkpoints import write_loadable_checkpoint
from tests.support.spike_curves import events, records


@pytest.fixture
def loadable(tmp_path: Path) -> Path:
    write_loadable_checkpoint(tmp_path / "iter_0000010")
    return tmp_path / "iter_0000010"


def _data_file(directory: Path) -> Path:
    return next(directory.glob("*.distcp"))


def test_a_whole_torch_dist_checkpoint_passes(loadable: Path) -> None:
    assert checkpoint_problem(loadable) is None


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (lambda d: _data_file(d).unlink(), "is missing (named in .metadata)"),
        (lambda d: os.truncate(_data_file(d), 10), "is truncated: 10 bytes, read up to byte"),
        (lambda d: (d / DCP_METADATA_FILE).unlink(), ".metadata (the index of the data files)"),
        (lambda d: (d / DCP_METADATA_FILE).write_bytes(b"\x80\x04\x95"), ".metadata is unreadable"),
        (lambda d: (d / CHECKPOINT_METADATA_FILE).write_text("{"), "metadata.json is unreadable"),
        (lambda d: (d / CHECKPOINT_METADATA_FILE).write_text("{}"), "names no sharded_backend"),
        (lambda d: (d / CHECKPOINT_COMMON_FILE).write_bytes(b"PK"), "common.pt is not a complete"),
        (lambda d: (d / CHECKPOINT_METADATA_FILE).unlink(), "a save that never finished"),
    ],
)
def test_each_damage_is_named(loadable: Path, damage, problem: str) -> None:
    damage(loadable)
    found = checkpoint_problem(loadable)
    assert found is not None and problem in found, found


def test_an_index_the_restricted_reader_does_not_know_is_read_by_torch(
    loadable: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A newer torch's ``.metadata`` is not damage: torch's own reader decides."""

    def unknown(directory: Path) -> list:
        raise UnreadableState("a class from a future torch")

    monkeypatch.setattr(checkpoint_state, "_dcp_index", unknown)
    assert checkpoint_problem(loadable) is None
    os.truncate(_data_file(loadable), 10)
    assert "is truncated" in (checkpoint_problem(loadable) or "")


def _legacy(directory: Path, ranks: int = 2, distributed_optimizer: bool = True) -> Path:
    for rank in range(ranks):
        folder = directory / f"mp_rank_00_{rank:03d}"
        folder.mkdir(parents=True)
        torch.save({"model": torch.ones(1000)}, folder / LEGACY_MODEL_FILE)
        if distributed_optimizer:
            torch.save({"state": torch.ones(1000)}, folder / "distrib_optim.pt")
    return directory


def test_a_whole_legacy_checkpoint_passes(tmp_path: Path) -> None:
    assert checkpoint_problem(_legacy(tmp_path)) is None


@pytest.mark.parametrize("name", [LEGACY_MODEL_FILE, "distrib_optim.pt"])
def test_a_truncated_or_missing_legacy_file_is_named(tmp_path: Path, name: str) -> None:
    path = _legacy(tmp_path) / "mp_rank_00_001" / name
    os.truncate(path, path.stat().st_size - 100)
    assert f"mp_rank_00_001/{name} is not a complete zip archive" in checkpoint_problem(tmp_path)
    path.unlink()
    if name == LEGACY_MODEL_FILE:
        assert checkpoint_problem(tmp_path) == f"mp_rank_00_001/{name} is missing"
    else:
        assert checkpoint_problem(tmp_path) is None  # only with the distributed optimizer


def test_the_walk_verifies_only_what_it_reaches() -> None:
    checked: list[int] = []
    damaged = {30: "x is missing"}

    def problem(iteration: int) -> str | None:
        checked.append(iteration)
        return damaged.get(iteration)

    def older():
        raise AssertionError("the older checkpoints are read only when all listed are damaged")
        yield 0

    target, passed = choose_target([20, 30, 40], 35, problem, older())
    assert (target, checked) == (20, [30, 20])
    assert passed == [{"checkpoint": 30, "problem": "x is missing"}]


def test_the_walk_goes_on_past_the_listed_checkpoints_and_moves_what_it_passed() -> None:
    curve = records(200, {i: (5.0, 6.0 if i == 150 else 1.0) for i in range(150, 200)})
    ledger = [e.as_json() for e in events(curve)]
    damaged = {100, 90}
    plan = make_plan(
        ledger,
        curve,
        [100, 140],
        [],
        PlanConfig(rollback_iters=40, skip_batches=120),
        1000,
        "/c",
        problem=lambda c: "damaged" if c in damaged else None,
        older=iter([90, 80, 70]),
    )
    assert plan.rollback_to == 80 and plan.moved_checkpoints == [90, 100, 140]
    assert [p["checkpoint"] for p in plan.passed_over] == [100, 90]
    assert "passed over checkpoint 100, which cannot be loaded: damaged" in plan.summary


def test_no_loadable_candidate_is_refused_naming_the_newest_few() -> None:
    listed = list(range(10, 10 * (NAMED + 3), 10))
    with pytest.raises(PlanError) as refused:
        choose_target(listed, listed[-1], lambda c: f"{c} is gone", iter([5]))
    message = str(refused.value)
    assert f"{listed[-1]}: {listed[-1]} is gone" in message and "10: 10 is gone" not in message
    assert "and 3 older ones" in message and "Nothing was changed" in message
