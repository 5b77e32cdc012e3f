"""Whole-file writes (tracker, skip lists, plans, reports, plots): modes after a replace, and a
full disk (a real 64 KiB tmpfs) in the middle of one."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

from megatron_ext.common.io import atomic_write
from tests.support.faults import fault
from tests.support.harness import REPO
from tests.support.incident_run import make_run, rerun
from tests.support.sandbox import run_with_mount


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@fault(
    "files written by `skiplist --apply` and `megatron-ext plot` under umask 022, and a "
    "tracker the operator made group-writable (0664)",
    "new files are 0644 (as Megatron's own tracker), a replaced file keeps its mode; "
    "never mkstemp's 0600",
    area="files",
)
def test_atomic_writes_keep_modes(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        root = make_run(tmp_path / "run")
        (root / "ckpt" / "latest_checkpointed_iteration.txt").chmod(0o664)
        (root / "ckpt" / "megatron_ext_skipped_iterations.txt").unlink()
        status, output = rerun(root, "--apply")
        assert status == 0, output
        ckpt = root / "ckpt"
        assert _mode(ckpt / "latest_checkpointed_iteration.txt") == 0o664
        for written in (
            ckpt / "megatron_ext_skipped_iterations.txt",
            ckpt / "megatron_ext_skip.txt",
            ckpt / "megatron_ext_incidents" / "incident-001.json",
            ckpt / "megatron_ext_incidents" / "incident-001.md",
        ):
            assert _mode(written) == 0o644, written
        from megatron_ext.plot.draw import main as plot

        assert plot(["--signals-dir", str(root / "signals"), "--out", str(tmp_path / "s.png")]) == 0
        assert _mode(tmp_path / "s.png") == 0o644
    finally:
        os.umask(old)


@fault(
    "a full disk (64 KiB tmpfs) while a tracker-sized file is being replaced",
    "the write fails with ENOSPC; the old file is intact and no temporary file is left",
    area="files",
)
def test_a_full_disk_never_leaves_a_partial_file(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from megatron_ext.common.io import atomic_write\n"
        "target = Path(sys.argv[1]) / 'latest_checkpointed_iteration.txt'\n"
        "atomic_write(target, '35\\n')\n"
        "try:\n"
        "    atomic_write(target, 'x' * 200_000)\n"
        "except OSError as exc:\n"
        "    print('ERRNO', exc.errno)\n"
        "print('CONTENT', target.read_text().strip())\n"
    )
    result, left = run_with_mount(
        [sys.executable, "-c", code, str(disk)],
        disk,
        size_kib=64,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 0, result.stderr
    assert "ERRNO 28" in result.stdout and "CONTENT 35" in result.stdout
    assert left == ["latest_checkpointed_iteration.txt"]
    atomic_write(tmp_path / "ok.txt", "fine")  # and on a healthy disk it works
    assert (tmp_path / "ok.txt").read_text() == "fine"
