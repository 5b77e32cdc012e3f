"""Fakes for testing the launchers (launch/* -> ``megatron-ext supervise``) without Slurm, a
GPU or Megatron.

* ``--dry-run`` output is parsed with :func:`shlex.split` and checked word by word.
* Slurm commands are stubs written into a per-test ``bin`` directory that comes first on
  ``PATH``: ``scontrol`` (``show hostnames`` prints ``$FAKE_HOSTNAMES``; ``requeue`` is
  logged), ``srun`` (drops its options and execs the command) and ``scancel`` (SIGTERMs the
  fake training). Every call is appended to ``stub.log``.
* Exit-code handling runs the real scripts with ``LAUNCHER=python`` and
  ``PYTHON=<fake_python>``: a bash script that records its argv and exits with the next code
  of ``$FAKE_CODES``; the supervisor itself runs under this interpreter
  (``MEGATRON_EXT_PYTHON``). The torchrun tests use the real ``torchrun`` of this environment
  (CPU, ``--no-python``) to check that the workers' exit codes survive torchrun, which itself
  always exits 1 when a worker fails.
"""

from __future__ import annotations

import shlex
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "launch" / "pretrain_gpt_ext.sbatch"
SINGLE = REPO / "launch" / "run_single_node.sh"
BASH = shutil.which("bash") or "/bin/bash"
SYSTEM_PATH = "/usr/bin:/bin"
TORCHRUN = Path(sys.executable).parent / "torchrun"


STUB_SCONTROL = r"""#!/bin/bash
echo "scontrol $*" >>"$STUB_LOG"
case "$1" in
    show) [[ $2 == hostnames ]] && printf '%s\n' ${FAKE_HOSTNAMES:-node-a node-b} ;;
    requeue) exit "${FAKE_REQUEUE_RC:-0}" ;;
esac
"""


STUB_SRUN = r"""#!/bin/bash
echo "srun $*" >>"$STUB_LOG"
while [[ $# -gt 0 && $1 == -* ]]; do shift; done
exec "$@"
"""


STUB_SCANCEL = r"""#!/bin/bash
echo "scancel $*" >>"$STUB_LOG"
kill -TERM "$(cat "$FAKE_DIR/train.pid")"
"""


# Fake training: records argv, then exits with the next code of $FAKE_CODES
# (FAKE_CODE_RANK_<RANK> wins under torchrun; FAKE_KILL_RANK_<RANK> set: SIGKILLs itself,
# as the out-of-memory killer would, and the other ranks exit after it), or waits for
# SIGTERM and exits 0 like Megatron's --exit-signal-handler after saving. Rank 0 records how
# the attempt ended where the supervisor asks, as pretrain_gpt_ext.py does: complete on exit 0,
# stopped early after a TERM or when FAKE_EARLY_EXIT lists this run's number (then it leaves a
# checkpoint tracker at 10 x its number in $CKPT_DIR, unless FAKE_NO_PROGRESS is set).
FAKE_PYTHON = r"""#!/bin/bash
d=$FAKE_DIR
ended() {
    if [[ -n ${MEGATRON_EXT_ATTEMPT_END_FILE:-} && ${RANK:-0} == 0 ]]; then
        printf '{"complete": %s, "reason": "%s"}' "$1" "$2" >"$MEGATRON_EXT_ATTEMPT_END_FILE"
    fi
}
n=$(( $(cat "$d/count" 2>/dev/null || echo 0) + 1 ))
echo "$n" >"$d/count"
printf '%s\n' "$@" >"$d/argv.$n"
env >"$d/env.$n"
echo "$$" >"$d/train.pid"
read -r -a codes <<<"${FAKE_CODES:-0}"
code=${codes[$((n - 1))]:-0}
v=FAKE_CODE_RANK_${RANK:-none}
code=${!v:-$code}
k=FAKE_KILL_RANK_${RANK:-none}
if [[ -n ${!k:-} ]]; then
    touch "$d/killed"
    kill -KILL $$
fi
if [[ -n ${FAKE_KILL_RANK_0:-}${FAKE_KILL_RANK_1:-} ]]; then
    # A peer of a killed rank fails only after the kill, as a real one would (it loses its
    # partner): never first, which would make torchrun stop the other rank before its kill.
    for _ in $(seq 400); do [[ -e $d/killed ]] && break; sleep 0.05; done
    rm -f "$d/killed"
fi
if [[ -n ${FAKE_WAIT_FOR_TERM:-} ]]; then
    trap 'echo TERM >>"$d/signals"; sleep "${FAKE_SAVE_SECONDS:-0}"
          touch "$d/saved.${RANK:-0}"; ended false "a stop signal"; exit 0' TERM
    touch "$d/ready" "$d/ready.${RANK:-0}"
    while :; do sleep 0.05; done
fi
if [[ $code == 0 ]]; then
    if [[ " ${FAKE_EARLY_EXIT:-} " == *" $n "* ]]; then
        # A checkpoint saved at iteration 10 * n (FAKE_NO_PROGRESS: none) before the exit.
        t=$CKPT_DIR/latest_checkpointed_iteration.txt
        [[ -n ${FAKE_NO_PROGRESS:-} ]] || echo "$((10 * n))" >"$t"
        ended false "--exit-duration-in-mins 1"
    else
        ended true "pretrain returned"
    fi
fi
echo "fake training run $n rank ${RANK:-none}: exit $code"
exit "$code"
"""


def write_exe(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


class Harness:
    """A temp dir with stubs, a fake python and a controlled environment."""

    def __init__(self, tmp_path: Path, slurm_stubs: bool = True):
        self.tmp = tmp_path
        self.bin = tmp_path / "bin"
        self.bin.mkdir()
        self.fake = tmp_path / "fake"
        self.fake.mkdir()
        self.ckpt = tmp_path / "ckpt"
        self.stub_log = tmp_path / "stub.log"
        if slurm_stubs:
            write_exe(self.bin / "scontrol", STUB_SCONTROL)
            write_exe(self.bin / "srun", STUB_SRUN)
            write_exe(self.bin / "scancel", STUB_SCANCEL)
        self.python = write_exe(tmp_path / "fake_python", FAKE_PYTHON)
        self.env = {
            "PATH": f"{self.bin}:{SYSTEM_PATH}",
            "HOME": str(tmp_path),
            "LANG": "C.UTF-8",
            "STUB_LOG": str(self.stub_log),
            "FAKE_DIR": str(self.fake),
            "CKPT_DIR": str(self.ckpt),
            "MEGATRON_EXT_PYTHON": sys.executable,
        }

    def slurm(self, **extra: str) -> Harness:
        self.env.update(
            SLURM_JOB_ID="77",
            SLURM_JOB_NODELIST="gpu-a[017-020]",
            SLURM_NNODES="4",
            SLURM_RESTART_COUNT="0",
            FAKE_HOSTNAMES="gpu-a017 gpu-a018 gpu-a019 gpu-a020",
        )
        self.env.update(extra)
        return self

    def fake_launcher(self, codes: str) -> Harness:
        self.env.update(LAUNCHER="python", PYTHON=str(self.python), FAKE_CODES=codes)
        return self

    def run(self, script: Path, *args: str, timeout: float = 60, **env: str):
        full_env = {**self.env, **env}
        return subprocess.run(
            [BASH, str(script), *args],
            env=full_env,
            cwd=self.tmp,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def popen(self, script: Path, *args: str, **env: str) -> subprocess.Popen:
        return subprocess.Popen(
            [BASH, str(script), *args],
            env={**self.env, **env},
            cwd=self.tmp,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    @property
    def launches(self) -> int:
        count = self.fake / "count"
        return int(count.read_text()) if count.exists() else 0

    def argv(self, n: int = 1) -> list[str]:
        return (self.fake / f"argv.{n}").read_text().splitlines()

    @property
    def stub_calls(self) -> list[str]:
        return self.stub_log.read_text().splitlines() if self.stub_log.exists() else []


def dry_run_words(result: subprocess.CompletedProcess) -> list[str]:
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines, f"no command printed; stderr:\n{result.stderr}"
    assert all(line.startswith("+ ") for line in lines), result.stdout
    assert len(lines) == 1, result.stdout
    return shlex.split(lines[0][2:])


def follows(words: list[str], *seq: str) -> bool:
    """True when ``seq`` occurs in ``words`` as consecutive words."""
    n = len(seq)
    return any(tuple(words[i : i + n]) == seq for i in range(len(words) - n + 1))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(
    h: Harness, proc: subprocess.Popen, names: tuple[str, ...] = ("ready",), timeout: float = 60
) -> None:
    deadline = time.monotonic() + timeout
    while not all((h.fake / n).exists() for n in names):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"fake training never became ready\nstdout:\n{out}\nstderr:\n{err}")
        time.sleep(0.05)
