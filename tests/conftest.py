"""Shared fixtures: one tiny real corpus, tokenized once per session; the real-shaped spike
drill; the e2e and compat markers; which tests share an xdist worker; one CPU thread each; no
C toolchain."""

from __future__ import annotations

import os
import shutil

# One intra-op thread per process, this one and every process a test starts (they inherit it),
# set before torch loads: the tiny models gain nothing from more, and on a busy machine the
# idle OpenMP threads spin (docs/testing.md). torchrun sets 1 itself only from two ranks.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import tempfile
from pathlib import Path

import pytest

from megatron_ext.demo import prepare_tiny_dataset
from tests.compat import SELECTED
from tests.support import toolchain

TESTS = Path(__file__).resolve().parent
E2E = TESTS / "e2e"

# pytest.ini runs the suite on two xdist workers (``--numprocesses 2``), a test file at a time,
# so a module-scoped launch happens once. The files of each set below also share
# session-scoped launches (or, for Slurm, the scheduler daemons and the network namespaces:
# one cluster at a time), so each set runs on one worker. The sets go first, longest first
# (the layout matrix is a set of its own for that): a long unit started last would leave the
# other worker idle.
SHARED = {
    "e2e/test_layouts.py": ("e2e/test_layouts.py",),  # the matrix: the longest file
    # (tests/bridge's drill is a Slurm job too, in the Bridge tier's own session.)
    "slurm": ("e2e/test_slurm.py", "e2e/test_multinode.py", "bridge/test_bridge_drill.py"),
    "tp2": (  # tp2, drill_ddp, distopt_rollback (tests/e2e/conftest.py)
        "e2e/test_pretrain.py",
        "e2e/test_telemetry.py",
        "e2e/test_zloss_training.py",
    ),
    "real-shaped": (
        "e2e/test_spike_drill.py",
        "e2e/test_provenance_drill.py",
        "faults/test_lookup_attempt_faults.py",
        "faults/test_rollback_target_faults.py",
    ),
}
_GROUP = {path: group for group, paths in SHARED.items() for path in paths}
_RANK = {group: rank for rank, group in enumerate(SHARED)}


def unit_of(path: str) -> str:
    """The scheduling unit of a test file (its path under tests/): its set's name, or itself."""
    return _GROUP.get(path, path)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything under tests/e2e/ is a real launch: mark it ``e2e``; the compatibility
    tier's selection (tests/compat/) is marked ``compat``; the sets' tests go first."""
    units = []
    for item in items:
        path = Path(str(item.fspath))
        if E2E in path.parents:
            item.add_marker(pytest.mark.e2e)
        if any(fragment in item.nodeid for fragment in SELECTED):
            item.add_marker(pytest.mark.compat)
        units.append(unit_of(path.relative_to(TESTS).as_posix()))
    order = sorted(range(len(items)), key=lambda i: _RANK.get(units[i], len(_RANK)))
    items[:] = [items[i] for i in order]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """xdist's file-at-a-time scheduling, with each set of :data:`SHARED` one unit."""
    from xdist.scheduler import LoadScopeScheduling

    class SharedLaunches(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid.split("::", 1)[0].removeprefix("tests/"))

    config.option.loadscopereorder = False  # keep the collection's order (the sets first)
    return SharedLaunches(config, log)


# Stand-ins for the C toolchain first on PATH for the whole session, every process a test
# starts included (#46: the suite passes on a machine without a compiler). Set up once, by the
# process that starts the session: xdist workers and the pytest runs tests start inherit it.
_owned: list[Path] = []


def pytest_configure(config: pytest.Config) -> None:
    """Put the toolchain's stand-ins first on ``PATH`` unless an outer session did."""
    if toolchain.CALLS in os.environ:
        return
    folder = Path(tempfile.mkdtemp(prefix="megatron-ext-no-compiler-"))
    calls = folder / "calls.txt"
    os.environ.update(toolchain.stand_ins(folder, calls), **{toolchain.CALLS: str(calls)})
    os.environ["PATH"] = os.pathsep.join([str(folder), os.environ["PATH"]])
    _owned.append(calls)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Fail the session that set the stand-ins up if anything called one, naming the calls."""
    for calls in _owned:
        if calls.exists():
            report = session.config.pluginmanager.get_plugin("terminalreporter")
            report.write_sep("=", "the suite called the C toolchain (#46)")
            report.write_line(calls.read_text())
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        shutil.rmtree(calls.parent)


@pytest.fixture(scope="session")
def data_args(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Megatron data flags for the tiny corpus (real text, real BPE, real .bin/.idx)."""
    root: Path = tmp_path_factory.mktemp("tiny-data")
    document, tokenizer_args = prepare_tiny_dataset(root)
    return [
        "--data-path",
        str(document),
        "--split",
        "100,0,0",
        *tokenizer_args,
        "--data-cache-path",
        str(root / "index-cache"),
    ]


@pytest.fixture(scope="session")
def real_shaped(tmp_path_factory: pytest.TempPathFactory, data_args: list[str]) -> dict:
    """The real-shaped spike drill (tests/support/drill.py): its e2e tests, the lookup's
    attempt faults and the rollback-target faults read the same two launches."""
    from tests.support.drill import real_shaped_drill

    return real_shaped_drill(tmp_path_factory.mktemp("real-shaped"), data_args)
