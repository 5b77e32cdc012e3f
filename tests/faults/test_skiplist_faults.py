"""``megatron-ext skiplist``: a real process killed (SIGKILL) at every step of ``--apply`` and
at random, incidents applied twice, damaged ledgers, trackers and checkpoints.

The run directory is what a spiking run leaves: a signals log and a spike ledger with the
same spike in two attempts (confirm policy: the rollback also writes Megatron's
result-rejected tracker), checkpoints every 5 iterations up to 45, the tracker at 45, and an
earlier skip list. Every command is the real CLI in its own process.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_ext.common.io import KILL_AT_STEP_ENV
from tests.support.faults import fault
from tests.support.incident_run import (
    APPLY_STEPS,
    CHECKPOINTS,
    make_run,
    rerun,
    skiplist_argv,
)

REPO = Path(__file__).resolve().parents[2]


def skiplist(
    root: Path, *extra: str, kill_at: int | None = None
) -> subprocess.CompletedProcess[str]:
    """The real CLI in its own process (killed by itself after step ``kill_at``)."""
    env = dict(os.environ)
    env.pop(KILL_AT_STEP_ENV, None)
    if kill_at is not None:
        env[KILL_AT_STEP_ENV] = str(kill_at)
    return subprocess.run(
        [sys.executable, "-m", "megatron_ext.cli", "skiplist", *skiplist_argv(root, *extra)],
        capture_output=True,
        text=True,
        env=env,
    )


def start_training(root: Path, kill_at: int | None = None) -> subprocess.CompletedProcess[str]:
    """The entry point's start-up up to where Megatron would read the tracker, in its own
    process (rank 0), exactly as the entry point runs it (``megatron_ext.fork.start``)."""
    env = {**os.environ, "RANK": "0", "PYTHONPATH": str(REPO)}
    env.pop(KILL_AT_STEP_ENV, None)
    if kill_at is not None:
        env[KILL_AT_STEP_ENV] = str(kill_at)
    code = (
        "import sys; from megatron_ext.fork.start import prepare_skips; "
        "print(prepare_skips(['--load', sys.argv[1]]))"
    )
    return subprocess.run(
        [sys.executable, "-c", code, str(root / "ckpt")], capture_output=True, text=True, env=env
    )


def state(root: Path) -> dict:
    """Everything an apply changes, in a comparable form."""
    ckpt = root / "ckpt"
    applied = ckpt / "megatron_ext_incidents" / "applied.jsonl"
    return {
        "checkpoints": sorted(p.name for p in ckpt.glob("iter_*")),
        "rolled_back": sorted(str(p.relative_to(ckpt)) for p in ckpt.glob("rolled_back/*/iter_*")),
        "tracker": (ckpt / "latest_checkpointed_iteration.txt").read_text().strip(),
        "skips": (ckpt / "megatron_ext_skipped_iterations.txt").read_text(),
        "rejected": (root / "rejected.txt").read_text(),
        "applied": [json.loads(line)["incident_id"] for line in applied.read_text().splitlines()]
        if applied.exists()
        else [],
        "journal": (ckpt / "megatron_ext_apply_journal.json").exists(),
    }


def assert_consistent(root: Path, where: str) -> None:
    """What must hold after any kill: the tracker names a checkpoint that exists, and every
    checkpoint is in exactly one place."""
    ckpt = root / "ckpt"
    tracker = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert (ckpt / f"iter_{tracker:07d}").is_dir(), f"{where}: tracker names missing {tracker}"
    for iteration in CHECKPOINTS:
        name = f"iter_{iteration:07d}"
        places = [ckpt / name, *ckpt.glob(f"rolled_back/*/{name}")]
        assert sum(p.is_dir() for p in places) == 1, f"{where}: {name} in {places}"


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_run(tmp_path_factory.mktemp("run"))


@pytest.fixture(scope="module")
def outcomes(template: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """The state before and after an uninterrupted apply."""
    done = tmp_path_factory.mktemp("done")
    shutil.copytree(template, done, dirs_exist_ok=True)
    result = skiplist(done, "--apply")
    assert result.returncode == 0, result.stderr
    after = state(done)
    assert after["tracker"] == "35" and after["skips"] == "3\n36-55\n" and not after["journal"]
    assert len(after["rolled_back"]) == 2 and after["rejected"].count("jobID=attempt-") == 2
    return {"before": state(template), "after": after}


def killed(template: Path, work: Path) -> dict[int, Path]:
    """One copy of the run per step boundary, its real `--apply` process SIGKILLed there.

    (Fresh kills per test: the journal records the rejected tracker's absolute path, so a
    copied directory would still point at the original's.)"""
    roots = {}
    for step in range(1, APPLY_STEPS + 1):
        roots[step] = work / f"step{step}"
        shutil.copytree(template, roots[step])
        result = skiplist(roots[step], "--apply", kill_at=step)
        assert result.returncode == -signal.SIGKILL, (step, result.stderr)
        assert_consistent(roots[step], f"killed after step {step}")
    return roots


@fault(
    "`skiplist --apply` killed (kill -9) at each of its step boundaries",
    "the tracker names an existing checkpoint at every point; rerunning --apply finishes it "
    "exactly as an uninterrupted apply",
    area="skiplist",
)
def test_apply_killed_at_every_step_is_finished_by_a_rerun(template, outcomes, tmp_path) -> None:
    for step, root in killed(template, tmp_path).items():
        if step == 1:
            status, output = rerun(root)  # planning on top of a half-done apply
            assert status == 2 and "rerun with --apply to finish it" in output
        status, output = rerun(root, "--apply")
        assert status == 0, (step, output)
        assert state(root) == outcomes["after"], f"killed after step {step}"


@fault(
    "training started after `skiplist --apply` was killed at any step",
    "start-up (rank 0) finishes the apply before Megatron reads the tracker and skips its list",
    area="skiplist",
)
def test_training_start_up_finishes_an_interrupted_apply(
    template, outcomes, tmp_path, capsys
) -> None:
    from megatron_ext.fork.start import prepare_skips

    for step, root in killed(template, tmp_path).items():
        argv = prepare_skips(["--load", str(root / "ckpt")])
        assert "finished the interrupted `skiplist --apply` of incident 001" in (
            capsys.readouterr().out
        )
        assert argv[argv.index("--iterations-to-skip") :][:3] == ["--iterations-to-skip", "3", "36"]
        assert state(root) == outcomes["after"], f"killed after step {step}"


@fault(
    "`skiplist --undo` after --apply was killed at any step",
    "everything is as before the apply: checkpoints back, tracker, skip list and rejected "
    "tracker restored",
    area="skiplist",
)
def test_undo_reverts_an_interrupted_apply(template, outcomes, tmp_path) -> None:
    for step, root in killed(template, tmp_path).items():
        status, output = rerun(root, "--undo")
        assert status == 0 and "undid the interrupted apply" in output, output
        assert state(root) == outcomes["before"], f"killed after step {step}"


@fault(
    "random kill -9 (a step boundary, or a signal at a random time) of --apply, of the rerun, "
    "of the training start-up and of --undo, repeated",
    "consistent after every kill; the last completed command decides the final state",
    area="skiplist",
)
def test_randomized_kill_loop(template, outcomes, tmp_path) -> None:
    seed = int(os.environ.get("MEGATRON_EXT_FAULT_SEED", "20260301"))
    rng = random.Random(seed)
    for round_ in range(8):
        root = tmp_path / f"round{round_}"
        shutil.copytree(template, root)
        expected = "before"
        for attempt in range(6):
            action = rng.choice(["apply", "apply", "start", "undo"])
            kill = rng.choice([None, rng.randint(1, APPLY_STEPS), "timer"])
            where = f"seed {seed} round {round_} attempt {attempt}: {action} kill={kill}"
            was_pending = state(root)["journal"]
            if kill == "timer":
                result = _killed_at_random_time(root, action, rng.uniform(0.05, 0.4))
            elif action == "start":
                result = start_training(root, kill_at=kill)
            else:
                result = skiplist(root, f"--{action}", kill_at=kill)
            assert result.returncode in (0, -signal.SIGKILL), (where, result.stderr)
            assert_consistent(root, where)
            if result.returncode == 0 and (action == "apply" or was_pending):
                expected = "before" if action == "undo" else "after"
        if state(root)["journal"]:
            assert skiplist(root, "--apply").returncode == 0
            expected = "after"
        assert state(root) == outcomes[expected], f"seed {seed} round {round_}"


def _killed_at_random_time(root: Path, action: str, delay: float) -> subprocess.CompletedProcess:
    """Start the command and SIGKILL it after ``delay`` seconds if it is still running."""
    if action == "start":
        argv = [
            sys.executable,
            "-c",
            "import sys; from megatron_ext.fork.start import prepare_skips; "
            "prepare_skips(['--load', sys.argv[1]])",
            str(root / "ckpt"),
        ]
    else:
        argv = [
            sys.executable,
            "-m",
            "megatron_ext.cli",
            "skiplist",
            *skiplist_argv(root, f"--{action}"),
        ]
    env = {**os.environ, "RANK": "0", "PYTHONPATH": str(REPO)}
    env.pop(KILL_AT_STEP_ENV, None)
    process = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    time.sleep(delay)
    if process.poll() is None:
        process.send_signal(signal.SIGKILL)
    stdout, stderr = process.communicate()
    return subprocess.CompletedProcess(argv, process.returncode, stdout, stderr)


def _train_past(root: Path, last: int) -> None:
    """What the restarted run does: save checkpoints up to ``last`` and move the tracker."""
    ckpt = root / "ckpt"
    for iteration in range(40, last + 1, 5):
        (ckpt / f"iter_{iteration:07d}").mkdir(exist_ok=True)
        (ckpt / f"iter_{iteration:07d}" / "metadata.json").write_text("{}")
    (ckpt / "latest_checkpointed_iteration.txt").write_text(str(last))


@fault(
    "`skiplist --apply` rerun after the restarted run trained past the incident (to 60)",
    "refused (exit 2, names the incident and the newer checkpoints); nothing moved, tracker "
    "kept; rerun before any new checkpoint: 'already applied', no change",
    area="skiplist",
)
def test_an_applied_incident_is_not_applied_again(template, tmp_path) -> None:
    root = shutil.copytree(template, tmp_path / "run")
    assert rerun(root, "--apply")[0] == 0
    applied = state(root)
    status, output = rerun(root, "--apply")
    assert status == 0 and "is already applied: rolled back to 35, nothing to do" in output
    assert state(root) == applied
    _train_past(root, 60)
    trained = state(root)
    status, output = rerun(root, "--apply")
    assert status == 2, output
    assert "was already applied as incident 001" in output
    assert "[40, 45, 50, 55, 60] were saved after that rollback" in output
    assert state(root) == trained


@fault(
    "`skiplist` for a rollback request that was never applied but the run trained past",
    "refused (exit 2): the tracker's checkpoint postdates the incident",
    area="skiplist",
)
def test_an_incident_the_run_trained_past_without_apply_is_refused(template, tmp_path) -> None:
    root = shutil.copytree(template, tmp_path / "run")
    _train_past(root, 60)
    before = state(root)
    status, output = rerun(root, "--apply")
    assert status == 2 and "is older than checkpoint 60" in output, output
    assert state(root) == before


def _rewrite_ledger(root: Path, edit) -> None:
    path = root / "signals" / "spikes.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(edit(e)) + "\n" for e in lines))


@fault(
    "a rollback record without `onset` in the spike ledger",
    "refused (exit 2) naming the field and the damaged line; no traceback",
    area="skiplist",
)
def test_a_ledger_rollback_without_onset_is_refused(template, tmp_path) -> None:
    root = shutil.copytree(template, tmp_path / "run")
    _rewrite_ledger(root, lambda e: {k: v for k, v in e.items() if k != "onset"})
    result = skiplist(root, "--apply")
    assert result.returncode == 2, result.stderr
    assert "has onset=None, not an iteration number" in result.stderr
    assert "Traceback" not in result.stderr
    assert state(root)["tracker"] == "45"


@fault(
    "a rollback record without `onset` in the spike ledger when a launcher restarts the "
    "training in place (ft_launcher, torchrun --max-restarts: the start-up applies it)",
    "the start-up refuses naming the field and the damaged line, as `skiplist` does; no "
    "KeyError traceback; nothing changed",
    area="skiplist",
)
def test_a_damaged_pending_request_is_refused_at_start_up(template, tmp_path, monkeypatch):
    from megatron_ext.common.run_lock import TOKEN_ENV
    from megatron_ext.fork.start import prepare_skips
    from megatron_ext.incidents.planner import PlanError

    root = shutil.copytree(template, tmp_path / "run")
    _rewrite_ledger(root, lambda e: {k: v for k, v in e.items() if k != "onset"})
    monkeypatch.delenv(TOKEN_ENV, raising=False)  # no supervisor: the start-up applies it
    monkeypatch.setenv("RANK", "0")
    before = state(root)
    argv = ["--load", str(root / "ckpt"), "--signals-dir", str(root / "signals")]
    with pytest.raises(PlanError, match="has onset=None, not an iteration number"):
        prepare_skips([*argv, "--spike-detect"])
    assert state(root) == before


APPLIED = {
    "incident": 1,
    "incident_id": "attempt1-iteration30-onset28",
    "onset": 28,
    "rollback_to": 25,
    "skip_window": [26, 45],
    "action": "rollback-and-skip",
}


@fault(
    "a hand-edited `megatron_ext_incidents/applied.jsonl`: a record without `rollback_to`, "
    'with `rollback_to: null`, `incident: "one"` or a one-number `skip_window`',
    "refused (exit 2) naming the file, the line and the field; nothing changed; no "
    "KeyError/TypeError/IndexError traceback",
    area="skiplist",
)
@pytest.mark.parametrize(
    ("record", "words"),
    [
        ({k: v for k, v in APPLIED.items() if k != "rollback_to"}, "rollback_to=None"),
        ({**APPLIED, "rollback_to": None}, "rollback_to=None"),
        ({**APPLIED, "incident": "one"}, "incident='one'"),
        ({**APPLIED, "skip_window": [26]}, "skip_window=[26]"),
    ],
)
def test_a_damaged_applied_record_is_refused(template, tmp_path, record, words) -> None:
    root = shutil.copytree(template, tmp_path / "run")
    applied = root / "ckpt" / "megatron_ext_incidents" / "applied.jsonl"
    applied.parent.mkdir()
    other = {**APPLIED, "incident_id": "attempt1-iteration20-onset18", "rollback_to": 15}
    applied.write_text(json.dumps(other) + "\n" + json.dumps(record) + "\n")
    before = state(root)
    status, output = rerun(root, "--apply")
    assert status == 2, output
    assert f"{applied}:2: an applied incident with {words}" in output, output
    assert "incident-NNN.json" in output
    assert state(root) == before


@fault(
    "a typo in the persisted skip list `megatron_ext_skipped_iterations.txt` (`1-3000000`)",
    "`skiplist` refuses (exit 2) as the training's start-up would, before expanding it (no "
    "minutes of CPU and gigabytes of memory); nothing changed",
    area="skiplist",
)
def test_a_huge_persisted_skip_list_is_refused(template, tmp_path) -> None:
    root = shutil.copytree(template, tmp_path / "run")
    (root / "ckpt" / "megatron_ext_skipped_iterations.txt").write_text("3\n1-3000000\n")
    before = state(root)
    status, output = rerun(root, "--apply")
    assert status == 2, output
    assert "megatron_ext_skipped_iterations.txt: skipping 3000000 iterations is more" in output
    assert state(root) == before


@fault(
    "`skiplist --train-iters 0` or a negative value",
    "refused (exit 2) naming the flag; 0 is not taken as 'not given'",
    area="skiplist",
)
def test_train_iters_below_one_is_refused(template, tmp_path) -> None:
    root = shutil.copytree(template, tmp_path / "run")
    before = state(root)
    for bad in ("0", "-1"):
        status, output = rerun(root, "--train-iters", bad, "--apply")
        assert status == 2, output
        assert f"--train-iters {bad}: must be >= 1" in output, output
    assert state(root) == before


@fault(
    '`"NaN"` / `"Infinity"` strings (the JavaScript spellings) in the signals log and ledger',
    "read as floats: the plan is made as with numbers",
    area="skiplist",
)
def test_nan_and_infinity_strings_are_numbers(template, tmp_path) -> None:
    root = shutil.copytree(template, tmp_path / "run")
    _rewrite_ledger(
        root,
        lambda e: {**e, "grad_baseline": "Infinity", "loss_baseline": "Infinity", "loss": "NaN"},
    )
    path = root / "signals" / "signals.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row in rows:
        if row["iteration"] in (38, 39):
            row.update(lm_loss="NaN", grad_norm="NaN", max_local_loss="-Infinity")
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = skiplist(root, "--apply")
    assert result.returncode == 0, result.stderr
    assert "Roll back to checkpoint 35, skip iterations 36-55" in result.stdout


@fault(
    "a garbage `latest_checkpointed_iteration.txt` in the checkpoint directory",
    "`skiplist` refuses (exit 2) naming the file and how to fix it",
    area="skiplist",
)
def test_a_garbage_tracker_is_refused_by_skiplist(template, tmp_path) -> None:
    root = shutil.copytree(template, tmp_path / "run")
    (root / "ckpt" / "latest_checkpointed_iteration.txt").write_text("\x00\x17garbage")
    result = skiplist(root, "--apply")
    assert result.returncode == 2, result.stderr
    assert "latest_checkpointed_iteration.txt holds" in result.stderr
    assert "not an iteration number" in result.stderr and "Traceback" not in result.stderr


def _corrupt(checkpoint: Path) -> None:
    (checkpoint / "metadata.json").write_text(
        json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1})
    )
    (checkpoint / ".metadata").write_bytes(os.urandom(256))


@fault(
    "a corrupt newest checkpoint (metadata.json present, checkpoint data garbage) in "
    "`skiplist` without --train-iters, no older checkpoint with readable args either",
    "refused (exit 2) naming the checkpoints, their errors and the fix (--train-iters); no "
    "CheckpointException traceback (with an older readable one, the plan reads that: "
    "test_rollback_target_faults)",
    area="skiplist",
)
def test_a_corrupt_checkpoint_is_refused_by_skiplist(template, tmp_path) -> None:
    root = shutil.copytree(template, tmp_path / "run")
    newest = root / "ckpt" / "iter_0000045"
    _corrupt(newest)  # the template's older checkpoints hold no Megatron args
    argv = [a for a in skiplist_argv(root, "--apply") if a not in ("--train-iters", "100")]
    command = [sys.executable, "-m", "megatron_ext.cli", "skiplist", *argv]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "no checkpoint's saved args could be read" in result.stderr
    assert f"checkpoint {newest} is unreadable (CheckpointException" in result.stderr
    assert "and 6 more" in result.stderr  # the first three named, not every one
    assert "pass --train-iters" in result.stderr and "Traceback" not in result.stderr
