"""Real filesystem faults for one command: a tiny tmpfs (a full disk) or a read-only mount.

The command runs in a private user + mount namespace (``unshare --user --map-root-user
--mount``, no privileges needed where user namespaces are enabled, root or not), so the mount
exists only for it and disappears with it. Nothing in the code under test is mocked: writes
fail with the kernel's own ENOSPC / EROFS.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest


def _unshare() -> str:
    unshare = shutil.which("unshare")
    probe = (
        subprocess.run(
            [unshare, "--user", "--map-root-user", "--mount", "true"], capture_output=True
        )
        if unshare
        else None
    )
    if probe is None or probe.returncode != 0:
        if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
            pytest.fail("unshare --user --mount does not work here, but CI is set")
        pytest.skip("user + mount namespaces unavailable (unshare); the fault cannot be injected")
    return unshare


def run_with_mount(
    command: list[str],
    mount_point: Path,
    *,
    size_kib: int = 256,
    read_only: bool = False,
    env: dict[str, str] | None = None,
    timeout: float = 300,
) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """Run ``command`` with a fresh tmpfs of ``size_kib`` on ``mount_point`` (read-only if
    asked); returns the result and what the tmpfs held when the command ended."""
    mount_point.mkdir(parents=True, exist_ok=True)
    options = f"size={size_kib}k" + (",ro" if read_only else "")
    script = (
        f"mount -t tmpfs -o {options} tmpfs {shlex.quote(str(mount_point))} || exit 99; "
        f"{shlex.join(command)}; rc=$?; echo '--- left on the mount:' >&2; "
        f"ls -A {shlex.quote(str(mount_point))} >&2; exit $rc"
    )
    result = subprocess.run(
        [_unshare(), "--user", "--map-root-user", "--mount", "sh", "-c", script],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    assert result.returncode != 99, f"cannot mount a tmpfs: {result.stderr}"
    stderr, _, left = result.stderr.rpartition("--- left on the mount:\n")
    result.stderr = stderr
    return result, left.split()
