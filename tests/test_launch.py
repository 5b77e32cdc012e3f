"""Tests for the launch scripts: launch/pretrain_gpt_ext.sbatch, launch/run_single_node.sh
and the launch/common.sh they share.

Nothing here needs Slurm, a GPU or Megatron:

* ``--dry-run`` output is parsed with :func:`shlex.split` and checked word by word.
* Slurm commands are stubs written into a per-test ``bin`` directory that comes
  first on ``PATH``: ``scontrol`` (``show hostnames`` prints ``$FAKE_HOSTNAMES``;
  ``requeue`` is logged), ``srun`` (drops its options and execs the command) and
  ``scancel`` (SIGTERMs the fake training). Every call is appended to ``stub.log``.
  The sbatch script also works without ``scontrol`` (it expands the first entry of
  ``SLURM_JOB_NODELIST`` itself); ``test_sbatch_first_host_without_scontrol``
  covers that path, with no stub on ``PATH``.
* Exit-code handling runs the real scripts with ``LAUNCHER=python`` and
  ``PYTHON=<fake_python>``: a bash script that records its argv and exits with the
  next code of ``$FAKE_CODES``. The torchrun tests use the real ``torchrun`` of
  this environment (CPU, ``--no-python``) to check that the workers' exit codes
  survive torchrun, which itself always exits 1 when a worker fails.
* ``test_shellcheck_clean`` needs ``shellcheck`` (``apt-get install -y shellcheck``):
  skipped when it is missing, unless the ``CI`` environment variable is set
  (non-empty and not 0/false/no), in which case it fails.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SBATCH = REPO / "launch" / "pretrain_gpt_ext.sbatch"
SINGLE = REPO / "launch" / "run_single_node.sh"
COMMON = REPO / "launch" / "common.sh"
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
# (FAKE_CODE_RANK_<RANK> wins under torchrun), or waits for SIGTERM and exits 0
# like Megatron's --exit-signal-handler after saving.
FAKE_PYTHON = r"""#!/bin/bash
d=$FAKE_DIR
n=$(( $(cat "$d/count" 2>/dev/null || echo 0) + 1 ))
echo "$n" >"$d/count"
printf '%s\n' "$@" >"$d/argv.$n"
env >"$d/env.$n"
echo "$$" >"$d/train.pid"
read -r -a codes <<<"${FAKE_CODES:-0}"
code=${codes[$((n - 1))]:-0}
v=FAKE_CODE_RANK_${RANK:-none}
code=${!v:-$code}
if [[ -n ${FAKE_WAIT_FOR_TERM:-} ]]; then
    trap 'echo TERM >>"$d/signals"; sleep "${FAKE_SAVE_SECONDS:-0}"; touch "$d/saved.${RANK:-0}"; exit 0' TERM
    touch "$d/ready" "$d/ready.${RANK:-0}"
    while :; do sleep 0.05; done
fi
echo "fake training run $n rank ${RANK:-none}: exit $code"
exit "$code"
"""


def _write_exe(path: Path, text: str) -> Path:
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
            _write_exe(self.bin / "scontrol", STUB_SCONTROL)
            _write_exe(self.bin / "srun", STUB_SRUN)
            _write_exe(self.bin / "scancel", STUB_SCANCEL)
        self.python = _write_exe(tmp_path / "fake_python", FAKE_PYTHON)
        self.env = {
            "PATH": f"{self.bin}:{SYSTEM_PATH}",
            "HOME": str(tmp_path),
            "LANG": "C.UTF-8",
            "STUB_LOG": str(self.stub_log),
            "FAKE_DIR": str(self.fake),
            "CKPT_DIR": str(self.ckpt),
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


@pytest.fixture
def h(tmp_path: Path) -> Harness:
    return Harness(tmp_path)


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


# ---------------------------------------------------------------------------
# Static properties
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("script", [SBATCH, SINGLE])
def test_scripts_are_executable_and_strict(script: Path):
    assert os.access(script, os.X_OK), f"{script} is not executable"
    text = script.read_text()
    assert text.startswith("#!/bin/bash\n")
    assert "set -euo pipefail" in text
    assert "source " in text and "common.sh" in text


def test_sbatch_directives():
    directives = [l for l in SBATCH.read_text().splitlines() if l.startswith("#SBATCH")]
    joined = "\n".join(directives)
    for want in (
        "--nodes=",
        "--ntasks-per-node=1",
        "--gpus-per-node=8",
        "--exclusive",
        "--signal=B:USR1@300",
        "--requeue",
        "--open-mode=append",
    ):
        assert want in joined, want


@pytest.mark.parametrize("script", [SBATCH, SINGLE])
def test_help_prints_exit_code_table(h: Harness, script: Path):
    r = h.run(script, "--help")
    assert r.returncode == 0, r.stderr
    for want in ("--dry-run", "CKPT_DIR", "MEGATRON_EXT_ON_SPIKE", "MAX_RESTARTS", "MAX_ROLLBACKS"):
        assert want in r.stdout, want
    for code in ("16", "17", "42"):
        assert f"  {code}  " in r.stdout, code
    assert "#SBATCH" not in r.stdout


def test_shellcheck_clean():
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
            pytest.fail("shellcheck is not on PATH but CI is set: apt-get install -y shellcheck")
        pytest.skip("shellcheck not installed (apt-get install -y shellcheck); set CI=1 to fail instead")
    files = sorted(str(p.relative_to(REPO)) for p in (REPO / "launch").glob("*.sh"))
    files += sorted(str(p.relative_to(REPO)) for p in (REPO / "launch").glob("*.sbatch"))
    assert "launch/common.sh" in files and "launch/pretrain_gpt_ext.sbatch" in files
    r = subprocess.run(
        [shellcheck, "-x", *files], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stdout + r.stderr


# ---------------------------------------------------------------------------
# --dry-run: the exact command
# ---------------------------------------------------------------------------


def test_sbatch_dry_run_command(h: Harness):
    h.slurm()
    r = h.run(
        SBATCH,
        "--dry-run",
        "--lr",
        "3e-4",
        "--",
        "--wandb-exp-name",
        "run with spaces",
        MODEL_ARGS="--num-layers 2 --hidden-size 64",
        DATA_ARGS="--mock-data",
        EXTRA_ARGS="--train-iters 10 --z-loss-coeff 1e-4",
    )
    words = dry_run_words(r)
    ckpt = str(h.ckpt)

    assert words[0] == "srun"
    assert "--ntasks-per-node=1" in words and "--nodes=4" in words
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in words
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in words
    assert "NCCL_IB_TIMEOUT=22" in words
    assert any(w.startswith("OMP_NUM_THREADS=") for w in words)
    t = words.index("torchrun")
    assert words.index("CUDA_DEVICE_MAX_CONNECTIONS=1") < t  # env is set for torchrun
    assert follows(words, "--nnodes", "4")
    assert follows(words, "--nproc-per-node", "8")
    assert follows(words, "--rdzv-backend", "c10d")
    assert follows(words, "--rdzv-endpoint", "gpu-a017:29500")
    assert any(w.startswith("77-") for w in words[words.index("--rdzv-id") + 1 : t + 20])
    assert str(REPO / "pretrain_gpt_ext.py") in words
    assert follows(words, "--save", ckpt) and follows(words, "--load", ckpt)
    assert "--exit-signal-handler" in words
    assert follows(words, "--result-rejected-tracker-filename", f"{ckpt}/result_rejected_tracker.txt")
    assert follows(words, "--num-layers", "2", "--hidden-size", "64", "--mock-data")
    assert follows(words, "--train-iters", "10", "--z-loss-coeff", "1e-4", "--lr", "3e-4")
    assert follows(words, "--wandb-exp-name", "run with spaces")  # quoting survives
    assert "--dry-run" not in words and "--" not in words
    # Nothing was started: stubs record every call.
    assert not any(c.startswith(("srun", "scontrol requeue", "scancel")) for c in h.stub_calls)
    assert "scontrol show hostnames gpu-a[017-020]" in h.stub_calls
    assert not h.ckpt.exists()


def test_sbatch_dry_run_via_env_and_overrides(h: Harness):
    h.slurm(SLURM_NNODES="2", SLURM_GPUS_ON_NODE="4")
    r = h.run(
        SBATCH,
        DRY_RUN="1",
        MASTER_ADDR="10.0.0.5",
        MASTER_PORT="6000",
        CUDA_DEVICE_MAX_CONNECTIONS="1",
        EXTRA_ENV="NCCL_DEBUG=WARN",
        SRUN_ARGS="--cpu-bind=none --mpi=none",
    )
    words = dry_run_words(r)
    assert follows(words, "--nnodes", "2")
    assert follows(words, "--nproc-per-node", "4")  # from SLURM_GPUS_ON_NODE
    assert follows(words, "--rdzv-endpoint", "10.0.0.5:6000")
    assert "NCCL_DEBUG=WARN" in words and "--mpi=none" in words
    assert not any(c.startswith("scontrol") for c in h.stub_calls)  # MASTER_ADDR given


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("gpu-[003-005,9],other1", "gpu-003"),
        ("nodeA,nodeB", "nodeA"),
        ("r[1-2]-n[07-08]", "r1-n07"),
        ("single", "single"),
    ],
)
def test_sbatch_first_host_without_scontrol(tmp_path: Path, nodelist: str, first: str):
    h = Harness(tmp_path, slurm_stubs=False)
    if not shutil.which("scontrol", path=h.env["PATH"]):
        h.slurm(SLURM_JOB_NODELIST=nodelist, SLURM_NNODES="2")
        words = dry_run_words(h.run(SBATCH, "--dry-run"))
        assert follows(words, "--rdzv-endpoint", f"{first}:29500")
    # The fallback parser itself, whether or not a real scontrol is installed (CI has one):
    # extract mx_first_host from the sbatch script and run it alone.
    script = (
        'eval "$(sed -n \'/^mx_first_host() {/,/^}/p\' "$1")"; mx_first_host "$2"'
    )
    out = subprocess.run(["bash", "-c", script, "_", str(SBATCH), nodelist],
                         capture_output=True, text=True, check=True).stdout
    assert out == f"{first}\n"


def test_sbatch_dry_run_python_launcher(h: Harness):
    h.slurm(SLURM_NNODES="1").fake_launcher("0")
    words = dry_run_words(h.run(SBATCH, "--dry-run"))
    assert words[0] == "srun" and "torchrun" not in words
    assert words[words.index(str(h.python)) + 1] == str(REPO / "pretrain_gpt_ext.py")
    assert h.launches == 0


def test_sbatch_outside_slurm_fails_clearly(h: Harness):
    r = h.run(SBATCH, "--dry-run")
    assert r.returncode == 2
    assert "SLURM_JOB_NODELIST" in r.stderr


def test_single_node_dry_run_command(h: Harness):
    r = h.run(
        SINGLE,
        "--dry-run",
        "--seed",
        "7",
        GPUS_PER_NODE="4",
        MODEL_ARGS="--num-layers 2",
        EXTRA_ARGS="--train-iters 10",
    )
    words = dry_run_words(r)
    ckpt = str(h.ckpt)
    assert words[0] == "env" and "srun" not in words
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in words
    t = words.index("torchrun")
    assert words.index("CUDA_DEVICE_MAX_CONNECTIONS=1") < t
    assert follows(words, "torchrun", "--standalone", "--nnodes", "1", "--nproc-per-node", "4")
    assert follows(words, "--save", ckpt) and follows(words, "--load", ckpt)
    assert follows(words, "--train-iters", "10", "--seed", "7")
    assert "--num-layers" in words
    assert not h.ckpt.exists()


def test_single_node_relative_ckpt_dir_is_made_absolute(h: Harness):
    words = dry_run_words(h.run(SINGLE, "--dry-run", CKPT_DIR="ck/run1"))
    assert follows(words, "--save", str(h.tmp / "ck/run1"), "--load", str(h.tmp / "ck/run1"))


@pytest.mark.parametrize("bad", ["--save /elsewhere", "--load=/elsewhere"])
@pytest.mark.parametrize("script", [SBATCH, SINGLE])
def test_user_save_load_rejected(h: Harness, script: Path, bad: str):
    h.slurm()
    r = h.run(script, "--dry-run", EXTRA_ARGS=bad)
    assert r.returncode == 2
    assert "CKPT_DIR" in r.stderr


def test_invalid_knobs_rejected(h: Harness):
    assert h.run(SINGLE, "--dry-run", LAUNCHER="mpirun").returncode == 2
    assert h.run(SINGLE, "--dry-run", MAX_RESTARTS="many").returncode == 2
    assert h.run(SINGLE, "--dry-run", DRY_RUN="maybe").returncode == 2


# ---------------------------------------------------------------------------
# Helpers of launch/common.sh, called directly
# ---------------------------------------------------------------------------


def _common(snippet: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [BASH, "-c", f"set -euo pipefail; source {shlex.quote(str(COMMON))}; {snippet}"],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": SYSTEM_PATH},
    )


@pytest.mark.parametrize(
    ("launcher_rc", "rank_codes", "expected"),
    [
        (0, [0, 0], 0),
        (1, [16, 16], 16),
        (1, [16, 143], 16),  # the slower rank was SIGTERMed by torchrun
        (1, [1, 17, 143], 17),  # 17 beats everything
        (1, [42, 16], 42),
        (1, [0, 3, 143], 3),
        (1, [143, 143], 1),  # only signal deaths: keep the launcher's code
        (1, [], 1),  # no worker files (e.g. rendezvous failure)
        (137, [0, 0], 137),
    ],
)
def test_effective_rc(tmp_path: Path, launcher_rc: int, rank_codes: list[int], expected: int):
    for rank, code in enumerate(rank_codes):
        (tmp_path / f"rank-{rank}.rc").write_text(f"{code}\n")
    r = _common(f"mx_effective_rc {launcher_rc} {shlex.quote(str(tmp_path))}")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(expected)


def test_quote_round_trips():
    words = ["plain", "a b", "it's", "", "$HOME", "x=\"y\"", "--opt=1,2", "*"]
    r = _common("mx_quote " + " ".join(shlex.quote(w) for w in words))
    assert r.returncode == 0, r.stderr
    assert shlex.split(r.stdout) == words


# ---------------------------------------------------------------------------
# Exit-code handling with a fake training command (LAUNCHER=python)
# ---------------------------------------------------------------------------


def test_single_exit_0(h: Harness):
    h.fake_launcher("0")
    r = h.run(SINGLE, "--foo", "bar", EXTRA_ARGS="--train-iters 3")
    assert r.returncode == 0, r.stderr
    assert h.launches == 1
    argv = h.argv(1)
    assert argv[0] == str(REPO / "pretrain_gpt_ext.py")
    assert follows(argv, "--save", str(h.ckpt), "--load", str(h.ckpt))
    assert follows(argv, "--train-iters", "3", "--foo", "bar")
    env = (h.fake / "env.1").read_text().splitlines()
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in env
    assert "finished successfully" in r.stderr
    assert h.ckpt.is_dir()


def test_single_exit_16_relaunches_then_finishes(h: Harness):
    h.fake_launcher("16 0")
    r = h.run(SINGLE)
    assert r.returncode == 0, r.stderr
    assert h.launches == 2
    assert "EXIT_CODE_RESUME_TO_DISAMBIGUATE" in r.stderr
    assert "restart 1/10" in r.stderr


def test_single_exit_16_bounded_by_max_restarts(h: Harness):
    h.fake_launcher("16 16 16 16")
    r = h.run(SINGLE, MAX_RESTARTS="2")
    assert r.returncode == 16, r.stderr
    assert h.launches == 3
    assert "MAX_RESTARTS=2" in r.stderr and "giving up" in r.stderr


def test_single_exit_16_counts_slurm_restart_count(h: Harness):
    h.fake_launcher("16 0")
    r = h.run(SINGLE, MAX_RESTARTS="2", SLURM_RESTART_COUNT="2")
    assert r.returncode == 16, r.stderr
    assert h.launches == 1


@pytest.mark.parametrize("script", [SINGLE, SBATCH])
def test_exit_17_stops_and_reports_tracker(h: Harness, script: Path):
    h.slurm().fake_launcher("17 0")
    h.ckpt.mkdir()
    tracker = h.ckpt / "result_rejected_tracker.txt"
    tracker.write_text(
        "ts=2025-01-01 00:00:00 node=gpu-a019 device=3 jobID=77 rank=11 iteration=1200 "
        "status=RerunValidationStatus.RERUN_REPRODUCIBLE result=nan message='loss is NaN'\n"
    )
    r = h.run(script)
    assert r.returncode == 17, r.stderr
    assert h.launches == 1
    assert "EXIT_CODE_FAILED_ON_RESULT_VALIDATION" in r.stderr
    assert str(tracker) in r.stderr
    assert "gpu-a019" in r.stderr  # suspect node from the tracker file
    assert "loss is NaN" in r.stderr
    assert not any("requeue" in c for c in h.stub_calls)


def test_exit_17_custom_tracker_from_user_args(h: Harness):
    h.fake_launcher("17")
    custom = h.tmp / "mytracker.txt"
    r = h.run(SINGLE, "--result-rejected-tracker-filename", str(custom))
    assert r.returncode == 17
    assert str(custom) in r.stderr


@pytest.mark.parametrize("script", [SINGLE, SBATCH])
def test_exit_42_without_hook_stops(h: Harness, script: Path):
    h.slurm().fake_launcher("42 0")
    r = h.run(script)
    assert r.returncode == 42, r.stderr
    assert h.launches == 1
    assert "MEGATRON_EXT_ON_SPIKE is not set" in r.stderr


@pytest.mark.parametrize("script", [SINGLE, SBATCH])
def test_exit_42_runs_hook_and_relaunches(h: Harness, script: Path):
    h.slurm().fake_launcher("42 0")
    marker = h.tmp / "hook.log"
    hook = (
        f'echo "$MEGATRON_EXT_ROLLBACK/$MEGATRON_EXT_MAX_ROLLBACKS $MEGATRON_EXT_CKPT_DIR '
        f'$MEGATRON_EXT_TRAIN_EXIT_CODE" >> {shlex.quote(str(marker))}'
    )
    r = h.run(script, MEGATRON_EXT_ON_SPIKE=hook)
    assert r.returncode == 0, r.stderr
    assert h.launches == 2
    assert marker.read_text().splitlines() == [f"1/5 {h.ckpt} 42"]


def test_exit_42_bounded_by_max_rollbacks(h: Harness):
    h.fake_launcher("42 42 42")
    marker = h.tmp / "hook.log"
    r = h.run(SINGLE, MAX_ROLLBACKS="1", MEGATRON_EXT_ON_SPIKE=f"echo x >> {marker}")
    assert r.returncode == 42
    assert h.launches == 2
    assert marker.read_text() == "x\n"
    assert "MAX_ROLLBACKS=1" in r.stderr


def test_exit_42_hook_failure_stops(h: Harness):
    h.fake_launcher("42 0")
    r = h.run(SINGLE, MEGATRON_EXT_ON_SPIKE="exit 3")
    assert r.returncode == 42
    assert h.launches == 1
    assert "spike hook failed with exit 3" in r.stderr


@pytest.mark.parametrize("code", ["1", "2", "137"])
@pytest.mark.parametrize("script", [SINGLE, SBATCH])
def test_other_exit_codes_stop_with_that_code(h: Harness, script: Path, code: str):
    h.slurm().fake_launcher(f"{code} 0")
    r = h.run(script)
    assert r.returncode == int(code), r.stderr
    assert h.launches == 1
    assert f"training failed with exit code {code}" in r.stderr


def test_sbatch_exit_0_runs_through_srun(h: Harness):
    h.slurm(SLURM_NNODES="1").fake_launcher("0")
    r = h.run(SBATCH, "--foo")
    assert r.returncode == 0, r.stderr
    assert h.launches == 1
    sruns = [c for c in h.stub_calls if c.startswith("srun ")]
    assert len(sruns) == 1 and "--ntasks-per-node=1" in sruns[0]
    assert "--foo" in h.argv(1)


def test_sbatch_exit_16_requeues(h: Harness):
    h.slurm(SLURM_RESTART_COUNT="1").fake_launcher("16 0")
    r = h.run(SBATCH)
    assert r.returncode == 0, r.stderr
    assert h.launches == 1
    assert "scontrol requeue 77" in h.stub_calls
    assert "restart 2/100" in r.stderr


def test_sbatch_exit_16_budget_spent(h: Harness):
    h.slurm(SLURM_RESTART_COUNT="3").fake_launcher("16")
    r = h.run(SBATCH, MAX_RESTARTS="3")
    assert r.returncode == 16, r.stderr
    assert "scontrol requeue 77" not in h.stub_calls
    assert "giving up" in r.stderr


def test_sbatch_exit_16_requeue_failure(h: Harness):
    h.slurm().fake_launcher("16")
    r = h.run(SBATCH, FAKE_REQUEUE_RC="1")
    assert r.returncode == 16, r.stderr
    assert "scontrol requeue 77" in h.stub_calls


def test_sbatch_exit_16_inplace_mode(h: Harness):
    h.slurm().fake_launcher("16 0")
    r = h.run(SBATCH, RESTART_MODE="inplace")
    assert r.returncode == 0, r.stderr
    assert h.launches == 2
    assert "scontrol requeue 77" not in h.stub_calls
    assert len([c for c in h.stub_calls if c.startswith("srun ")]) == 2


# ---------------------------------------------------------------------------
# Signals: preemption / time limit and manual stop
# ---------------------------------------------------------------------------


def _wait_ready(
    h: Harness, proc: subprocess.Popen, names: tuple[str, ...] = ("ready",), timeout: float = 60
) -> None:
    deadline = time.monotonic() + timeout
    while not all((h.fake / n).exists() for n in names):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"fake training never became ready\nstdout:\n{out}\nstderr:\n{err}")
        time.sleep(0.05)


def test_sbatch_usr1_saves_and_requeues(h: Harness):
    h.slurm(SLURM_NNODES="1").fake_launcher("0")
    proc = h.popen(SBATCH, FAKE_WAIT_FOR_TERM="1")
    _wait_ready(h, proc)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert (h.fake / "signals").read_text() == "TERM\n"  # Megatron's exit signal
    assert "scancel --signal=TERM 77" in h.stub_calls  # not SIGTERM to srun
    assert "scontrol requeue 77" in h.stub_calls
    assert h.launches == 1


def test_sbatch_usr1_with_spent_budget_stops_without_requeue(h: Harness):
    h.slurm(SLURM_NNODES="1", SLURM_RESTART_COUNT="5").fake_launcher("0")
    proc = h.popen(SBATCH, FAKE_WAIT_FOR_TERM="1", MAX_RESTARTS="5")
    _wait_ready(h, proc)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGUSR1.value, err
    assert "scancel --signal=TERM 77" in h.stub_calls
    assert "scontrol requeue 77" not in h.stub_calls
    assert "not requeueing" in err


def test_sbatch_sigterm_saves_and_stops_without_requeue(h: Harness):
    h.slurm(SLURM_NNODES="1").fake_launcher("0")
    proc = h.popen(SBATCH, FAKE_WAIT_FOR_TERM="1")
    _wait_ready(h, proc)
    proc.send_signal(signal.SIGTERM)  # e.g. scancel: save, but do not requeue
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM.value, err
    assert (h.fake / "signals").read_text() == "TERM\n"
    assert "scontrol requeue 77" not in h.stub_calls


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_single_signal_forwarded_as_sigterm(h: Harness, sig: signal.Signals):
    h.fake_launcher("0")
    proc = h.popen(SINGLE, FAKE_WAIT_FOR_TERM="1")
    _wait_ready(h, proc)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + sig.value, err
    assert (h.fake / "signals").read_text() == "TERM\n"
    assert "rerun the same command to resume" in err
    assert h.launches == 1


# ---------------------------------------------------------------------------
# torchrun: worker exit codes survive (torchrun itself exits 1)
# ---------------------------------------------------------------------------

needs_torchrun = pytest.mark.skipif(not TORCHRUN.exists(), reason=f"no torchrun at {TORCHRUN}")


@needs_torchrun
def test_single_torchrun_propagates_worker_exit_16(h: Harness):
    h.env.update(PYTHON=str(h.python), TORCHRUN=str(TORCHRUN), GPUS_PER_NODE="2")
    r = h.run(SINGLE, MAX_RESTARTS="0", FAKE_CODE_RANK_0="16", FAKE_CODE_RANK_1="16", timeout=120)
    assert r.returncode == 16, r.stdout + r.stderr
    assert "launcher exited 1; training workers reported exit code 16" in r.stderr
    assert "MAX_RESTARTS=0" in r.stderr
    assert not list((h.ckpt / "launch_state" / "exit_codes").iterdir())  # cleaned up


@needs_torchrun
def test_sbatch_torchrun_rendezvous_and_exit_17(h: Harness):
    h.slurm(SLURM_NNODES="1", SLURM_JOB_NODELIST="localhost", FAKE_HOSTNAMES="localhost")
    h.env.update(
        PYTHON=str(h.python),
        TORCHRUN=str(TORCHRUN),
        GPUS_PER_NODE="2",
        MASTER_PORT=str(free_port()),
    )
    # Megatron exits 17 on every rank (torchrun may SIGTERM the slower ones).
    r = h.run(SBATCH, "--seed", "1", FAKE_CODES="17", timeout=120)
    assert r.returncode == 17, r.stdout + r.stderr
    assert "EXIT_CODE_FAILED_ON_RESULT_VALIDATION" in r.stderr
    argv = h.argv(1)
    assert argv[0] == str(REPO / "pretrain_gpt_ext.py") and "--seed" in argv
    env = (h.fake / "env.1").read_text().splitlines()
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in env
    assert "WORLD_SIZE=2" in env


@needs_torchrun
def test_single_torchrun_sigterm_lets_workers_save(h: Harness):
    h.env.update(PYTHON=str(h.python), TORCHRUN=str(TORCHRUN), GPUS_PER_NODE="2")
    proc = h.popen(SINGLE, FAKE_WAIT_FOR_TERM="1", FAKE_SAVE_SECONDS="1")
    _wait_ready(h, proc, ("ready.0", "ready.1"))
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM.value, err
    # torchrun passed SIGTERM on to both workers and waited for their "save".
    assert (h.fake / "saved.0").exists() and (h.fake / "saved.1").exists(), err
    assert sorted((h.fake / "signals").read_text().split()) == ["TERM", "TERM"]


# ---------------------------------------------------------------------------
# Under sbatch the script runs from Slurm's spool directory
# ---------------------------------------------------------------------------


def test_sbatch_spooled_copy_finds_repo_via_submit_dir(h: Harness):
    spool = h.tmp / "spool" / "job77"
    spool.mkdir(parents=True)
    script = spool / "slurm_script"
    shutil.copy(SBATCH, script)
    h.slurm()
    words = dry_run_words(h.run(script, "--dry-run", SLURM_SUBMIT_DIR=str(REPO)))
    assert str(REPO / "pretrain_gpt_ext.py") in words

    r = h.run(script, "--dry-run", SLURM_SUBMIT_DIR=str(h.tmp))
    assert r.returncode == 2 and "MEGATRON_EXT_ROOT" in r.stderr

    words = dry_run_words(h.run(script, "--dry-run", MEGATRON_EXT_ROOT=str(REPO)))
    assert str(REPO / "pretrain_gpt_ext.py") in words
