"""The demo's and ``train --cpu``'s decisions without a launch: what the demo's output filter
shows, when a resume has nothing left to train, which checkpoints it refuses to resume, and
the command ``train --cpu`` runs (the launches themselves: tests/e2e/test_newcomer.py)."""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner

from megatron_ext import demo
from megatron_ext.common.checkpoint_state import COMMON_STATE_KEY
from megatron_ext.common.files import (
    CHECKPOINT_METADATA_FILE,
    CHECKPOINT_TRACKER_FILE,
    checkpoint_dir,
)


def test_the_filter_drops_megatrons_argument_dump_and_memory_report() -> None:
    shown = [
        " [2026-12-01 01:45:44] iteration        1/      40 | consumed samples: 8 | lm loss: 6.8",
        " validation loss at iteration 40 | lm loss value: 3.730514E+00 |",
        "megatron-ext spike detector: spike at iteration 40 (onset 40, culprit DP rank 1)",
        "RuntimeError: something real went wrong",
    ]
    hidden = [
        "  error_injection_rate ............................ 0",
        "  logits_load_ignore_errors ....................... False",
        "[Rank 0] (before save_checkpoint for iteration 5) memory (MB) | allocated: 0.00",
    ]
    assert [line for line in shown + hidden if demo.shown(line)] == shown


def test_a_refusal_is_shown_alone_and_torchrun_s_report_kept_in_the_log() -> None:
    """What a start-up refusal printed on the demo's console: the refusal, then torchrun's
    ChildFailedError traceback (its lines say "error"). The log keeps every line."""
    refusal = "megatron-ext: spike detector: need window >= 3 (got window=2)"
    launcher = [
        "E1203 16:14:57.119000 32051 torch/distributed/elastic/multiprocessing/api.py:1002] "
        "failed (exitcode: 1) local_rank: 0 (pid: 32252) of binary: /venv/bin/python3.12",
        "Traceback (most recent call last):",
        '  File "/venv/torch/distributed/elastic/multiprocessing/errors/__init__.py", line 380',
        "    raise ChildFailedError(",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "  error_file: <N/A>",
        "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html",
    ]
    lines = [" iteration        1/      40 | lm loss: 6.8", refusal, *launcher]
    log = io.StringIO()
    assert list(demo.console([f"{line}\n" for line in lines], log)) == lines[:2]
    assert log.getvalue() == "".join(f"{line}\n" for line in lines)


def _checkpoint(workdir: Path, iteration: int, train_iters: int, global_batch: int) -> None:
    ckpt = workdir / "checkpoints"
    args = argparse.Namespace(train_iters=train_iters, global_batch_size=global_batch)
    blob = io.BytesIO()
    torch.save([{"args": args, "iteration": iteration}], blob)
    target = checkpoint_dir(ckpt, iteration)
    dcp.save(
        {COMMON_STATE_KEY: blob},
        storage_writer=dcp.FileSystemWriter(str(target)),
        planner=MCoreSavePlanner(flatten_state_dict=False),
        no_dist=True,
    )
    (target / CHECKPOINT_METADATA_FILE).write_text("{}")
    (ckpt / CHECKPOINT_TRACKER_FILE).write_text(f"{iteration}\n")


def test_resume_left_to_train_and_refusal_of_another_schedule(tmp_path: Path) -> None:
    assert demo._left_to_train(tmp_path, 40, 8) is None  # fresh
    _checkpoint(tmp_path, 20, 40, 8)
    assert demo._left_to_train(tmp_path, 40, 8) == 20
    _checkpoint(tmp_path, 40, 40, 8)
    assert demo._left_to_train(tmp_path, 40, 8) == 0
    for iters, batch in ((60, 8), (40, 16)):  # the drill's schedule, another --nproc
        with pytest.raises(SystemExit, match="--fresh"):
            demo._left_to_train(tmp_path, iters, batch)


def test_a_resume_is_compared_with_the_flags_given_after_the_separator(
    tmp_path: Path, capsys
) -> None:
    """`demo -- --global-batch-size 16` resumes its own run at 16 (it refused: it compared
    the checkpoint with its default 8); `--iters 5` refuses before Megatron's warm-up assert."""
    _checkpoint(tmp_path, 40, 40, 16)
    given = demo._given(["--global-batch-size", "16"], 40, 8)
    assert given == (40, 16) and demo._left_to_train(tmp_path, *given) == 0
    assert demo.main(["--workdir", str(tmp_path), "--", "--global-batch-size", "16"]) == 0
    assert "already trained all 40 iterations" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--fresh"):
        demo.main(["--workdir", str(tmp_path)])  # the default 8 is another schedule
    for iters in ("5", "1"):
        with pytest.raises(SystemExit) as exit_:
            demo.main(["--workdir", str(tmp_path / "new"), "--iters", iters])
        assert exit_.value.code == 2
        assert "warms the learning rate up over 5 iterations" in capsys.readouterr().err


def test_each_mode_has_its_own_workdir() -> None:
    assert demo.WORKDIRS[False] != demo.WORKDIRS[True]
    assert demo.build_parser().parse_args([]).workdir is None  # chosen by --drill


def test_train_cpu_runs_the_harness_with_cpu_flags_first(monkeypatch, capsys) -> None:
    from megatron_ext import train

    launched: list[list[str]] = []
    monkeypatch.setattr(train.subprocess, "call", lambda command: launched.append(command) or 0)
    assert train.main(["--cpu", "--nproc-per-node", "2", "--", "--num-layers", "2"]) == 0
    command = launched[0]
    runner = command.index(str(train.CPU_RUNNER))
    assert command[runner - 1] == "--nproc-per-node=2"
    assert command[runner + 1 :] == [*train.CPU_FLAGS, "--num-layers", "2"]  # user's flags win

    for argv, message in ((["--", "--num-layers", "2"], "only --cpu"), (["--cpu"], "after --")):
        with pytest.raises(SystemExit):
            train.main(argv)
        assert message in capsys.readouterr().err


def test_train_cpu_runs_the_packages_cpu_runner() -> None:
    from megatron_ext import train

    assert train.CPU_RUNNER == train.REPO / "megatron_ext" / "cpu" / "run.py"
    assert train.CPU_RUNNER.is_file()


def test_train_cpu_without_its_runner_says_how_to_reinstall(monkeypatch) -> None:
    from megatron_ext import train

    monkeypatch.setattr(train, "CPU_RUNNER", train.REPO / "no" / "run.py")
    with pytest.raises(SystemExit, match="reinstall megatron-ext"):
        train.main(["--cpu", "--", "--num-layers", "2"])


def _no_launch(*_args: object) -> list[str]:
    pytest.fail("the demo prepared data and launched training for arguments it should refuse")


def test_iterations_and_processes_below_one_are_refused_not_replaced_by_defaults(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """`--iters 0` trained the default 40 and `--nproc 0` ran the default 1 (a falsy value
    read as "not given"); `--nproc -1` preprocessed, then died in torchrun's AssertionError."""
    monkeypatch.setattr(demo, "training_command", _no_launch)
    for argv, message in (
        (["--iters", "0"], "warms the learning rate up over 5 iterations"),
        (["--iters", "-3", "--drill"], "warms the learning rate up over 5 iterations"),
        (["--nproc", "0"], "--nproc 0: give at least 1 process"),
        (["--nproc", "-1"], "--nproc -1: give at least 1 process"),
    ):
        with pytest.raises(SystemExit) as exit_:
            demo.main(["--workdir", str(tmp_path / "w"), *argv])
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_a_workdir_that_is_a_file_is_refused_and_left_alone(tmp_path: Path, capsys) -> None:
    """A file as --workdir (or above it) ended in NotADirectoryError from mkdir or, with
    --fresh, from the clean-up."""
    taken = tmp_path / "notes.txt"
    taken.write_text("mine\n")
    for workdir, fresh in ((taken, []), (taken, ["--fresh"]), (taken / "sub", [])):
        with pytest.raises(SystemExit) as exit_:
            demo.main(["--workdir", str(workdir), *fresh])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert f"--workdir {workdir}: {taken} is a file" in err and "Traceback" not in err
    assert taken.read_text() == "mine\n"


def test_a_checkpoint_tracker_without_an_iteration_is_refused(tmp_path: Path) -> None:
    """An empty (cut short) or garbled latest_checkpointed_iteration.txt ended in int()'s
    ValueError; it names the file and what to do."""
    _checkpoint(tmp_path, 20, 40, 8)
    tracker = tmp_path / "checkpoints" / CHECKPOINT_TRACKER_FILE
    for text in ("", "2x\n", "release\n"):
        tracker.write_text(text)
        with pytest.raises(SystemExit, match="not an iteration number") as exit_:
            demo._left_to_train(tmp_path, 40, 8)
        assert str(tracker) in str(exit_.value.code) and "--fresh" in str(exit_.value.code)
        assert tracker.read_text() == text
