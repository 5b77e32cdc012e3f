"""One real launch per topology, shared by every e2e module that reads it.

Each fixture is a real torchrun of ``pretrain_gpt_ext.py`` through the CPU harness (20
iterations of the tiny model). The features that do not change the numerics (telemetry,
sample log) are on in every launch, so one launch serves the training, telemetry and lookup
checks of its topology:

- ``ws1``: world size 1, checkpoint every 10;
- ``tp2``: TP=2, no z-loss (also the z-loss comparison's plain arm);
- ``tp2_zloss``: TP=2 with ``--z-loss-coeff 1e-4 --log-output-z`` under Megatron's fused
  cross entropy (``--cross-entropy-loss-fusion``);
- ``drill_ddp`` / ``drill_distopt``: DP=2 runs U (uninterrupted), K (SIGKILLed right after
  its iteration-10 checkpoint), R (resumes K) and S (resumes a copy of K with iterations 13
  and 14 skipped), with DDP or the distributed optimizer, each launched on first use (the
  distributed optimizer's kill -9 resume is the layout matrix's ``dp2-pp2-distopt-tied``);
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
from tests.support.layouts import BY_NAME, Matrix


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
                "--log-output-z",
                "--cross-entropy-loss-fusion",  # composed with Megatron's fused CE
                "--signals-dir",
                str(work / "signals"),
            ],
            nproc=2,
        )
    )


class _Drill(dict[str, Run]):
    """The drill's runs by name, each launched the first time a test asks for it (a test
    that reads only U costs one launch, not four)."""

    def __init__(self, root: Path, data_args: list[str], extra: list[str]) -> None:
        super().__init__()
        self.root, self.data_args, self.extra = root, data_args, extra

    def _args(self, name: str, ckpt: Path, *more: str) -> list[str]:
        return [
            *self.data_args,
            *self.extra,
            *_telemetry(self.root / name),
            "--save",
            str(ckpt),
            "--load",
            str(ckpt),
            "--save-interval",
            "10",
            *more,
        ]

    def __missing__(self, name: str) -> Run:
        root = self.root
        if name == "U":
            run = ok(launch(root / "U", self._args("U", root / "U" / "ckpt"), nproc=2))
        elif name == "K":
            run = launch(
                root / "K", self._args("K", root / "K" / "ckpt"), nproc=2, kill_at_checkpoint=10
            )
            # S resumes a copy of K's checkpoints as K left them (R resumes K's own).
            shutil.copytree(root / "K" / "ckpt", root / "S" / "ckpt")
        elif name == "R":
            self["K"]
            run = ok(launch(root / "R", self._args("R", root / "K" / "ckpt"), nproc=2))
        elif name == "S":
            self["K"]
            skip = ["--iterations-to-skip", *map(str, SKIPPED)]
            run = ok(launch(root / "S", self._args("S", root / "S" / "ckpt", *skip), nproc=2))
        else:
            raise KeyError(name)
        self[name] = run
        return run


@pytest.fixture(scope="session")
def drill_ddp(tmp_path_factory, data_args) -> dict[str, Run]:
    return _Drill(tmp_path_factory.mktemp("drill-ddp"), data_args, [])


@pytest.fixture(scope="session")
def drill_distopt(tmp_path_factory, data_args) -> dict[str, Run]:
    return _Drill(
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
def matrix(request: pytest.FixtureRequest, tmp_path_factory, data_args) -> Matrix:
    """Only the bases of the layouts this session runs (a compatibility tier runs two)."""
    names = {
        item.callspec.params["name"]
        for item in request.session.items
        if "name" in getattr(getattr(item, "callspec", None), "params", {})
        and item.path.name == "test_layouts.py"
    }
    models = {BY_NAME[name].model for name in names if name in BY_NAME}
    return Matrix(tmp_path_factory.mktemp("layouts"), data_args, models)
