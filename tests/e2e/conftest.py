"""One real launch per topology, shared by every e2e module that reads it.

Each fixture is a real torchrun of ``pretrain_gpt_ext.py`` through the CPU harness (20
iterations of the tiny model). The features that do not change the numerics (telemetry,
sample log) are on in every launch, so one launch serves the training, telemetry and lookup
checks of its topology:

- ``ws1``: world size 1, checkpoint every 10;
- ``tp2``: TP=2, no z-loss (also the z-loss comparison's plain arm);
- ``tp2_zloss``: TP=2 with ``--z-loss-coeff 1e-4``;
- ``drill_ddp`` / ``drill_distopt``: DP=2 runs U (uninterrupted), K (SIGKILLed right after
  its iteration-10 checkpoint), R (resumes K) and S (resumes a copy of K with iterations 13
  and 14 skipped), with DDP or the distributed optimizer;
- ``distopt_rollback``: U of ``drill_distopt`` rolled back to iteration 10 and relaunched with
  the same signals dir (what the spike pipeline does);
- ``matrix``: the layout matrix (``tests/support/layouts.py``): single-rank bases, one launch
  per layout with every feature on, drill restarts and the kill -9 resume, each launched on
  first use and shared by every test of ``test_layouts.py``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.support.harness import SKIPPED, TELEMETRY, Run, launch
from tests.support.layouts import Matrix


def ok(run: Run) -> Run:
    assert run.returncode == 0, run.log[-4000:]
    return run


def _telemetry(work: Path) -> list[str]:
    return [*TELEMETRY, "--signals-dir", str(work / "signals")]


@pytest.fixture(scope="session")
def ws1(tmp_path_factory, data_args) -> Run:
    work = tmp_path_factory.mktemp("ws1")
    return ok(launch(work, [*data_args, "--save", str(work / "ckpt"), "--save-interval", "10"]))


@pytest.fixture(scope="session")
def tp2(tmp_path_factory, data_args) -> Run:
    work = tmp_path_factory.mktemp("tp2")
    return ok(
        launch(
            work,
            [
                *data_args,
                "--tensor-model-parallel-size",
                "2",
                *_telemetry(work),
                "--save",
                str(work / "ckpt"),
                "--save-interval",
                "10",
            ],
            nproc=2,
        )
    )


@pytest.fixture(scope="session")
def tp2_zloss(tmp_path_factory, data_args) -> Run:
    work = tmp_path_factory.mktemp("tp2-zloss")
    return ok(
        launch(
            work,
            [
                *data_args,
                "--tensor-model-parallel-size",
                "2",
                "--z-loss-coeff",
                "1e-4",
                "--signals-dir",
                str(work / "signals"),
            ],
            nproc=2,
        )
    )


def _drill(root: Path, data_args: list[str], extra: list[str]) -> dict[str, Run]:
    def args(name: str, ckpt: Path, *more: str) -> list[str]:
        return [
            *data_args,
            *extra,
            *_telemetry(root / name),
            "--save",
            str(ckpt),
            "--load",
            str(ckpt),
            "--save-interval",
            "10",
            *more,
        ]

    runs = {"U": ok(launch(root / "U", args("U", root / "U" / "ckpt"), nproc=2))}
    runs["K"] = launch(root / "K", args("K", root / "K" / "ckpt"), nproc=2, kill_at_checkpoint=10)
    shutil.copytree(root / "K" / "ckpt", root / "S" / "ckpt")
    runs["R"] = ok(launch(root / "R", args("R", root / "K" / "ckpt"), nproc=2))
    skip = ["--iterations-to-skip", *map(str, SKIPPED)]
    runs["S"] = ok(launch(root / "S", args("S", root / "S" / "ckpt", *skip), nproc=2))
    return runs


@pytest.fixture(scope="session")
def drill_ddp(tmp_path_factory, data_args) -> dict[str, Run]:
    return _drill(tmp_path_factory.mktemp("drill-ddp"), data_args, [])


@pytest.fixture(scope="session")
def drill_distopt(tmp_path_factory, data_args) -> dict[str, Run]:
    return _drill(
        tmp_path_factory.mktemp("drill-distopt"), data_args, ["--use-distributed-optimizer"]
    )


@pytest.fixture(scope="session")
def distopt_rollback(drill_distopt, tmp_path_factory, data_args) -> Run:
    """U's checkpoints and signals, tracker set back to 10, iteration 20 removed, relaunched."""
    work = tmp_path_factory.mktemp("distopt-rollback")
    source = drill_distopt["U"].workdir
    for part in ("ckpt", "signals"):
        shutil.copytree(source / part, work / part)
    (work / "ckpt" / "latest_checkpointed_iteration.txt").write_text("10")
    shutil.rmtree(work / "ckpt" / "iter_0000020")
    ckpt = str(work / "ckpt")
    return ok(
        launch(
            work,
            [
                *data_args,
                "--use-distributed-optimizer",
                *_telemetry(work),
                "--save",
                ckpt,
                "--load",
                ckpt,
                "--save-interval",
                "10",
            ],
            nproc=2,
        )
    )


@pytest.fixture(scope="session")
def matrix(tmp_path_factory, data_args) -> Matrix:
    return Matrix(tmp_path_factory.mktemp("layouts"), data_args)
