"""Reading a checkpoint's common state without torch or Megatron: the same values Megatron's
``load_common_state_dict`` reads, no code run from the file, and a clean hand-back to
Megatron's loader for anything else (the real-checkpoint comparison: tests/e2e/test_newcomer.py).
"""

from __future__ import annotations

import argparse
import io
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from megatron.core.dist_checkpointing.serialization import load_common_state_dict
from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner
from megatron.core.transformer.enums import AttnBackend

from megatron_ext.common.checkpoint_state import (
    COMMON_STATE_KEY,
    Opaque,
    UnreadableState,
    read_common_state,
)
from megatron_ext.common.files import CHECKPOINT_COMMON_FILE, CHECKPOINT_METADATA_FILE
from megatron_ext.lookup.config import load_checkpoint
from megatron_ext.registry import table as registry


def _state(**extra: object) -> dict:
    args = argparse.Namespace(
        train_iters=40,
        data_path=["0.5", "/d/a", "0.5", "/d/b"],
        seq_length=64,
        lr=3e-3,
        iterations_to_skip=[13, 14],
        attention_backend=AttnBackend.auto,
        params_dtype=torch.float32,
        save=Path("/ckpt"),
    )
    return {
        "args": args,
        "iteration": 40,
        "optimizer": {"state": {"step": torch.ones(3)}},
        "checkpoint_version": 3.0,
        **extra,
    }


def _save_torch_dist(directory: Path, state: dict) -> None:
    """The common state as Megatron's torch_dist strategy stores it: ``torch.save([state])``
    bytes as the DCP byte item ``common_state/shard_0_1``, written with Megatron's own save
    planner (and read back by Megatron's loader below); on megatron-core 0.17/0.18 (registry
    ``checkpoint-common-state``'s variant) ``common.pt`` as their ``save_common`` writes it,
    the only place their loader reads."""
    if registry.assumption("checkpoint-common-state").variant_for() is not None:
        directory.mkdir(parents=True, exist_ok=True)
        torch.save(state, directory / CHECKPOINT_COMMON_FILE)
    else:
        blob = io.BytesIO()
        torch.save([state], blob)
        dcp.save(
            {COMMON_STATE_KEY: blob},
            storage_writer=dcp.FileSystemWriter(str(directory)),
            planner=MCoreSavePlanner(flatten_state_dict=False),
            no_dist=True,
        )
    (directory / CHECKPOINT_METADATA_FILE).write_text('{"sharded_backend": "torch_dist"}')


def _plain_equal(ours: argparse.Namespace, theirs: argparse.Namespace) -> None:
    assert vars(ours).keys() == vars(theirs).keys()
    for key, value in vars(theirs).items():
        mine = vars(ours)[key]
        if isinstance(mine, Opaque) or (isinstance(mine, type) and issubclass(mine, Opaque)):
            assert type(value).__module__.split(".")[0] in ("torch", "megatron"), key
        else:
            assert (mine, type(mine)) == (value, type(value)), key


def test_torch_dist_common_state_reads_as_megatron_reads_it(tmp_path: Path) -> None:
    _save_torch_dist(tmp_path, _state())
    ours, theirs = read_common_state(tmp_path), load_common_state_dict(str(tmp_path))
    assert ours.keys() == theirs.keys()
    assert (ours["iteration"], ours["checkpoint_version"]) == (40, 3.0)
    _plain_equal(ours["args"], theirs["args"])
    assert ours["args"].attention_backend.args == (AttnBackend.auto.value,)


def test_legacy_common_pt_is_read_too(tmp_path: Path) -> None:
    torch.save(_state(), tmp_path / CHECKPOINT_COMMON_FILE)
    _plain_equal(read_common_state(tmp_path)["args"], _state()["args"])


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_no_code_from_the_file_runs(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    torch.save({"args": _Exploit()}, tmp_path / CHECKPOINT_COMMON_FILE)
    with pytest.raises(UnreadableState, match=r"(posix|os)\.system"):
        read_common_state(tmp_path)
    assert not (tmp_path / "pwned").exists()


def test_the_lookup_falls_back_to_megatrons_loader(tmp_path: Path, monkeypatch) -> None:
    import megatron_ext.common.checkpoint_state as checkpoint_state

    _save_torch_dist(tmp_path, _state())

    def unreadable(directory: Path) -> dict:
        raise UnreadableState("a layout from a future torch")

    monkeypatch.setattr(checkpoint_state, "read_common_state", unreadable)
    checkpoint = load_checkpoint(tmp_path)
    assert (checkpoint.iteration, checkpoint.args.attention_backend) == (40, AttnBackend.auto)


def test_truncated_data_file_is_unreadable(tmp_path: Path) -> None:
    _save_torch_dist(tmp_path, _state())
    data = next(tmp_path.glob("*.distcp"), tmp_path / CHECKPOINT_COMMON_FILE)  # 0.17/0.18
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(UnreadableState):
        read_common_state(tmp_path)


def test_a_damaged_bridge_checkpoint_is_refused_by_the_reader_and_left_to_bridge_at_start_up(
    tmp_path: Path,
) -> None:
    """A Bridge ``iter_*`` whose run_config.yaml is empty, a list or lacks ``model:``, or that
    Bridge saved without the overlay (no layout file): the reader refuses in one line (it was
    an AttributeError / KeyError), and the training start-up leaves it to Bridge's own load."""
    import yaml

    from megatron_ext.common.bridge_state import BridgeStateError
    from megatron_ext.common.checkpoint_state import read_saved_args
    from megatron_ext.common.files import BRIDGE_LAYOUT_FILE, BRIDGE_TRAIN_STATE_FILE
    from megatron_ext.common.records.skip_windows import resume_point

    step = tmp_path / "iter_0000004"
    step.mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("4")
    model = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "seq_length": 64}
    config = {"model": model, "train": {"global_batch_size": 8}, "dataset": {"blend": None}}
    counters = {"step": 4, "consumed_train_samples": 32, "skipped_train_samples": 0}
    torch.save({k: torch.tensor(v) for k, v in counters.items()}, step / BRIDGE_TRAIN_STATE_FILE)
    (step / BRIDGE_LAYOUT_FILE).write_text('{"data_parallel_size": 2, "world_size": 2}')
    (step / "run_config.yaml").write_text(yaml.safe_dump(config))
    saved = read_saved_args(step)
    assert (saved.consumed_train_samples, saved.data_parallel_size) == (32, 2)
    assert resume_point(["--load", str(tmp_path)]).consumed == 32
    damaged = {"": "", "- a list\n": "", "train: {}\ndataset: {}\n": ""}
    for text in damaged:
        (step / "run_config.yaml").write_text(text)
        with pytest.raises(BridgeStateError, match="lacks what a Bridge run writes"):
            read_saved_args(step)
        assert resume_point(["--load", str(tmp_path)]) is None
    (step / "run_config.yaml").write_text(yaml.safe_dump(config))
    (step / BRIDGE_LAYOUT_FILE).unlink()  # saved by Bridge alone
    with pytest.raises(BridgeStateError, match="cannot read it as a Megatron-Bridge checkpoint"):
        read_saved_args(step)
    assert resume_point(["--load", str(tmp_path)]) is None
