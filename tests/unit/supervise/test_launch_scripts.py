"""The launch scripts themselves: strict bash glue that execs ``megatron-ext supervise``, the
sbatch directives, ``--help``, shellcheck, ``--dry-run`` command lines (Slurm stubs on
PATH), host lists and the knobs' validation."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext.supervise.commands import expand_hostlist
from tests.support.launcher_fakes import (
    REPO,
    SBATCH,
    SINGLE,
    Harness,
    dry_run_words,
    follows,
    write_exe,
)


@pytest.fixture
def h(tmp_path: Path) -> Harness:
    return Harness(tmp_path)


# ---------------------------------------------------------------------------
# Static properties
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("script", [SBATCH, SINGLE])
def test_scripts_are_executable_and_strict(script: Path):
    assert os.access(script, os.X_OK), f"{script} is not executable"
    text = script.read_text()
    assert text.startswith("#!/bin/bash\n")
    assert "set -euo pipefail" in text
    assert "exec " in text and "-m megatron_ext.supervise --scheduler" in text


def test_sbatch_directives():
    directives = [line for line in SBATCH.read_text().splitlines() if line.startswith("#SBATCH")]
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


PYTHON_311 = """#!/bin/bash
# python from PATH on a fresh machine: 3.11, as the launchers' version probes see it
case "$*" in *print*) echo 3.11 ;; *) exit 1 ;; esac
"""


@pytest.mark.parametrize("script", [SBATCH, SINGLE])
def test_without_an_activated_virtualenv_the_checkout_s_venv_runs_or_one_line_says_why(
    h: Harness, script: Path
):
    """README's `launch/run_single_node.sh --help` from a fresh set-up, the virtualenv not
    activated: `python` on PATH was 3.11 and the package's first import died in a SyntaxError
    traceback. The checkout's .venv runs it; without one, one line says what to set."""
    del h.env["MEGATRON_EXT_PYTHON"]
    write_exe(h.bin / "python", PYTHON_311)
    if (REPO / ".venv" / "bin" / "python").exists():
        r = h.run(script, "--help")
        assert r.returncode == 0 and "MAX_RESTARTS" in r.stdout, r.stderr
    bare = h.tmp / "checkout"  # a checkout without .venv
    (bare / "megatron_ext" / "supervise").mkdir(parents=True)
    (bare / "megatron_ext" / "supervise" / "runner.py").touch()
    (bare / "launch").mkdir()
    shutil.copy(REPO / "launch" / "python.sh", bare / "launch")
    r = h.run(script, "--help", MEGATRON_EXT_ROOT=str(bare))
    assert r.returncode == 2 and r.stdout == "", r.stdout
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"{script.name}: megatron-ext needs Python >= 3.12 and python is 3.11" in r.stderr
    assert "set MEGATRON_EXT_PYTHON" in r.stderr


def test_shellcheck_clean():
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
            pytest.fail("shellcheck is not on PATH but CI is set: apt-get install -y shellcheck")
        pytest.skip(
            "shellcheck not installed (apt-get install -y shellcheck); set CI=1 to fail instead"
        )
    files = sorted(str(p.relative_to(REPO)) for p in (REPO / "launch").glob("*.sh"))
    files += sorted(str(p.relative_to(REPO)) for p in (REPO / "launch").glob("*.sbatch"))
    files += sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("*.sh"))
    files += [*sorted(str(p.relative_to(REPO)) for p in (REPO / "tools").glob("*.sh")), ".ci/run"]
    assert "launch/run_single_node.sh" in files and "launch/pretrain_gpt_ext.sbatch" in files
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
    assert follows(
        words, "--result-rejected-tracker-filename", f"{ckpt}/result_rejected_tracker.txt"
    )
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
    ("nodelist", "hosts"),
    [
        ("gpu-[003-005,9],other1", ["gpu-003", "gpu-004", "gpu-005", "gpu-9", "other1"]),
        ("gpu[001-004,010]", ["gpu001", "gpu002", "gpu003", "gpu004", "gpu010"]),
        ("nodeA,nodeB", ["nodeA", "nodeB"]),
        ("r[1-2]-n[07-08]", ["r1-n07", "r1-n08", "r2-n07", "r2-n08"]),
        ("single", ["single"]),
    ],
)
def test_hostlist_expansion_matches_scontrol(nodelist: str, hosts: list[str]):
    assert expand_hostlist(nodelist) == hosts
    real = shutil.which("scontrol")
    if real and os.environ.get("SLURM_CONF"):  # a configured Slurm expands it the same way
        out = subprocess.run(
            [real, "show", "hostnames", nodelist], capture_output=True, text=True, check=True
        ).stdout.split()
        assert out == hosts


def test_sbatch_dry_run_without_a_working_scontrol(tmp_path: Path):
    """scontrol installed but unconfigured (a laptop, CI before the cluster starts): the
    rendezvous host comes from the supervisor's own host-list expansion."""
    h = Harness(tmp_path, slurm_stubs=False)
    write_exe(
        h.bin / "scontrol", "#!/bin/bash\necho 'scontrol: error: s_p_parse_file' >&2\nexit 1\n"
    )
    h.slurm(SLURM_JOB_NODELIST="gpu[001-004,010]", SLURM_NNODES="5")
    words = dry_run_words(h.run(SBATCH, "--dry-run"))
    assert follows(words, "--rdzv-endpoint", "gpu001:29500")
    assert follows(words, "--nnodes", "5")


# Slurm 22.05's scontrol, like this one, retries a missing configuration file for 60 s.
SCONTROL_WITHOUT_CONFIG = """#!/bin/bash
echo "scontrol $*" >>"$STUB_LOG"
echo "scontrol: error: s_p_parse_file: cannot stat file $SLURM_CONF, retrying in 1sec" \
    "up to 60sec" >&2
sleep 60
exit 1
"""


@pytest.mark.parametrize("scontrol", ["stub retrying 60 s", "installed"])
def test_sbatch_dry_run_multi_host_without_a_slurm_config(tmp_path: Path, scontrol: str):
    """--dry-run for 5 nodes (``gpu[001-004,010]``) where SLURM_CONF names no file: torchrun
    once per node, 5 nodes, rendezvous at the first host, without waiting for scontrol."""
    h = Harness(tmp_path, slurm_stubs=False)
    if scontrol == "installed":
        if shutil.which("scontrol", path=h.env["PATH"]) is None:
            pytest.skip("Slurm's scontrol is not installed (tools/setup.sh installs it)")
    else:
        write_exe(h.bin / "scontrol", SCONTROL_WITHOUT_CONFIG)
    h.slurm(SLURM_JOB_NODELIST="gpu[001-004,010]", SLURM_NNODES="5", SLURM_JOB_ID="91")
    r = h.run(SBATCH, "--dry-run", SLURM_CONF=str(tmp_path / "no-such" / "slurm.conf"))
    words = dry_run_words(r)
    srun = words[: words.index("torchrun")]
    assert srun[0] == "srun"
    assert "--nodes=5" in srun and "--ntasks=5" in srun and "--ntasks-per-node=1" in srun
    assert follows(words, "--nnodes", "5", "--nproc-per-node", "8")
    assert follows(words, "--rdzv-id", "91-0-1", "--rdzv-backend", "c10d")
    assert follows(words, "--rdzv-endpoint", "gpu001:29500")
    assert not h.stub_calls, "scontrol must not be asked without its configuration file"
    assert not h.ckpt.exists()


def test_sbatch_dry_run_python_launcher(h: Harness):
    h.slurm(SLURM_NNODES="1").fake_launcher("0")
    words = dry_run_words(h.run(SBATCH, "--dry-run"))
    assert words[0] == "srun" and "torchrun" not in words
    assert words[words.index(str(h.python)) + 1] == str(REPO / "pretrain_gpt_ext.py")
    assert h.launches == 0


@pytest.mark.parametrize("script", [SBATCH, SINGLE])
def test_a_relative_script_path_with_cdpath_exported_finds_the_checkout(h: Harness, script: Path):
    """`checkout/launch/...` with CDPATH exported (a .bashrc's `export CDPATH=.:~`): `cd`
    printed the directory it found, the checkout's path came out twice, and the launcher said
    the repository itself was not a megatron-ext checkout."""
    h.slurm()
    (h.tmp / "checkout").symlink_to(REPO)
    relative = Path("checkout") / script.relative_to(REPO)
    words = dry_run_words(h.run(relative, "--dry-run", CDPATH=f"{h.tmp / 'elsewhere'}:."))
    assert str(h.tmp / "checkout" / "pretrain_gpt_ext.py") in words


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


def test_unusable_paths_and_python_are_refused_without_a_traceback(h: Harness):
    h.fake_launcher("0")
    (h.tmp / "afile").write_text("")
    r = h.run(SINGLE, "--dry-run", PYTHON="/opt/my python'3/bin/python")
    assert r.returncode == 2 and "PYTHON: No closing quotation" in r.stderr, r.stderr
    for knob in ("CKPT_DIR", "LAUNCH_STATE_DIR", "TRACKER_FILE"):
        r = h.run(SINGLE, **{knob: str(h.tmp / "afile" / "x")})
        assert r.returncode == 2, r.stderr
        assert "cannot create the run's directories" in r.stderr and "afile" in r.stderr
        assert "Traceback" not in r.stderr
    assert h.launches == 0


def test_scheduler_given_with_an_equals_sign_or_without_a_value(h: Harness):
    supervise = [sys.executable, "-m", "megatron_ext.cli", "supervise"]
    run = functools.partial(
        subprocess.run, env=h.env, cwd=h.tmp, capture_output=True, text=True, timeout=60
    )
    r = run([*supervise, "--scheduler=slurm", "--dry-run"])
    assert r.returncode == 2 and "SLURM_JOB_NODELIST is not set" in r.stderr, r.stderr
    r = run([*supervise, "--scheduler"])
    assert r.returncode == 2 and "--scheduler must be local or slurm, got ''" in r.stderr
    assert h.launches == 0


# ---------------------------------------------------------------------------
# Helpers of launch/common.sh, called directly
# ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------
# Exit-code handling with a fake training command (LAUNCHER=python)
# ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------
# Signals: preemption / time limit and manual stop
# ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------
# torchrun: worker exit codes survive (torchrun itself exits 1)
# ---------------------------------------------------------------------------


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
