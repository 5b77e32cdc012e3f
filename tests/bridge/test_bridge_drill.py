"""Megatron-Bridge's real ``pretrain`` with every megatron-ext feature, through the spike drill
(CPU harness, PP=2 with a virtual pipeline of 2, 4 layers, gloo, a two-prefix blend):
``docs/examples/pretrain_bridge.py`` at that layout (tests/bridge/layout_script.py) on
``megatron_ext.bridge.pretrain``, a job of the Slurm launcher (``launch/pretrain_gpt_ext.sbatch``
on a real single-node cluster, ``TRAIN_SCRIPT`` the CPU runner with ``--bridge-script``). The
detector flags the corrupted batches and both pipeline stages exit 42 without saving; the
supervisor runs ``skiplist --apply``, which rolls the run back (Megatron's tracker and Bridge's
``latest_train_state.pt``, one journaled transaction), and relaunches; the resumed run skips
the window through Bridge's ``train.iterations_to_skip``, the first updates on the recovery
lr ramp; ``megatron-ext lookup``, reading the Bridge checkpoint's ``run_config.yaml``,
answers every checked iteration with the sample log's record. The drill at DP 2 (and TP 2) is
tests/bridge/test_bridge_layouts.py's TP 2 row.

One supervised job of two attempts, as tests/e2e/test_fork_example.py runs the fork's
script: the same flags, drill and plan, Bridge's loop.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from megatron_ext.common.files import (
    RUN_LOCK_FILE,
    SIGNALS_FILE,
    SPIKE_LEDGER_FILE,
)
from megatron_ext.common.records.signals import read_signals
from megatron_ext.common.run_lock import Holder
from tests.support.bridge_example import example_config
from tests.support.drill import BAD, TRAIN_ITERS, check_lookup_equals_sample_log
from tests.support.harness import REPO, RUNNER, Run, run_logged
from tests.support.launcher_fakes import free_port
from tests.support.slurm import SBATCH_SCRIPT, SlurmCluster, ensure_cluster

EXAMPLE = REPO / "docs" / "examples" / "pretrain_bridge.py"
GLOBAL_BATCH = 8
PLAN = ["--rollback-iters", "5", "--skip-batches", "12"]  # back to 25, skip 26-37
SKIPPED = range(26, 38)
TRAINED = set(range(1, BAD[0] + 4)) | set(range(SKIPPED[-1] + 1, TRAIN_ITERS + 1))
MEMBERS = ("tiny_text_document", "copy_text_document")
WD_OVERRIDE = "*.linear_fc2.weight=0.5"
# tests/bridge/layout_script.py's flags: PP 2 x VPP 2 (with the overlapped P2P it needs).
SCRIPT = Path(__file__).with_name("layout_script.py")
PIPELINE = ("--pp", "2", "--vpp", "2", "--layers", "4")
RECOVERY_ITERS, RECOVERY_LR_MULT = 3, 0.25


def _features(work: Path, culprit: int = 1) -> list[str]:
    """Every feature: z-loss with the fused output layer + loss and log Z, weight-decay
    overrides, bucket norms with the update ratio, signals (per source on the blend), sample
    log, spike detector and drill, the recovery lr ramp after the rollback, run lock (Bridge's
    checkpoint.save)."""
    return [
        *("--z-loss-coeff", "1e-4", "--log-output-z"),
        *("--fused-output-loss", "--fused-output-loss-chunk-tokens", "48"),
        *("--embedding-weight-decay-mult", "0", "--weight-decay-override", WD_OVERRIDE),
        *("--log-bucket-grad-norms", "--signals-update-ratio"),
        *("--signals-dir", str(work / "signals"), "--sample-log-dir", str(work / "samples")),
        *("--spike-detect", "--spike-window", "10", "--spike-warmup", "20"),
        *("--spike-grad-factor", "1.5", "--spike-mad-k", "3", "--spike-patience", "3"),
        *("--drill-corrupt-batch", f"{BAD[0]}-{BAD[1]}:{culprit}", "--drill-corruption", "garbage"),
        *("--recovery-iters", str(RECOVERY_ITERS), "--recovery-lr-mult", str(RECOVERY_LR_MULT)),
    ]


def _supervised(
    work: Path,
    data: list[str],
    tokenizer: str,
    script: Path = EXAMPLE,
    ranks: int = 2,
    layout: tuple[str, ...] = (),
    slurm: SlurmCluster | None = None,
    culprit: int = 1,
) -> Run:
    """The supervisor with the CPU runner's ``--bridge-script`` as its training script:
    attempts, spike hook (``skiplist --apply``), relaunch; through ``launch/run_single_node.sh``,
    or with ``slurm`` as a job of ``launch/pretrain_gpt_ext.sbatch``. ``script`` and ``layout``:
    tests/bridge/layout_script.py and its flags, on ``ranks`` ranks; the drill's bad batches
    on DP rank ``culprit``."""
    python = sys.executable
    knobs = dict(
        CKPT_DIR=str(work / "ckpt"),
        LAUNCHER="torchrun",
        PYTHON=python,
        TORCHRUN=f"{python} -m torch.distributed.run",
        TRAIN_SCRIPT=str(RUNNER),
        GPUS_PER_NODE=str(ranks),
        MASTER_PORT=str(free_port()),
        OMP_NUM_THREADS="1",
        TORCH_ELASTIC_SHUTDOWN_TIMEOUT="60",
        MODEL_ARGS=" ".join(
            [
                *("--bridge-script", str(script), *layout, "--data-path", *data),
                *("--tokenizer", tokenizer, "--work", str(work)),
                *("--train-iters", str(TRAIN_ITERS), "--save-interval", "5"),
                *("--global-batch-size", str(GLOBAL_BATCH)),
            ]
        ),
        DATA_ARGS="",
        EXTRA_ARGS=" ".join(_features(work, culprit)),
        EXTRA_ENV=f"MEGATRON_EXT_HARNESS_COUNTS={work / 'counts'} PYTHONUNBUFFERED=1",
        SKIPLIST_ARGS=" ".join(PLAN),
    )
    if slurm is None:
        launcher = ["bash", str(REPO / "launch" / "run_single_node.sh")]
        return run_logged(launcher, work, dict(os.environ, **knobs), 600)
    knobs |= {"MEGATRON_EXT_ROOT": str(REPO), "MEGATRON_EXT_PYTHON": python}
    job = slurm.start(SBATCH_SCRIPT, knobs, work, job_name="mx-bridge").result(timeout=600)
    return Run(work, job.returncode, job.output)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory) -> Iterator[SlurmCluster]:
    """A single-node Slurm cluster (tests/support/slurm.py) for the drill's job."""
    cluster = ensure_cluster(tmp_path_factory.mktemp("slurm-cluster"))
    try:
        yield cluster
    finally:
        cluster.stop()


def _stale_lease(ckpt: Path) -> Holder:
    """A run lock left by a training that died on this host (its pid no longer runs)."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    holder = Holder("training", socket.gethostname(), dead.pid, "1", "", 0.0, "f" * 16)
    ckpt.mkdir(parents=True)
    (ckpt / RUN_LOCK_FILE).write_text(json.dumps(asdict(holder)) + "\n")
    return holder


@pytest.fixture(scope="module")
def bridge(tmp_path_factory, data_args, slurm: SlurmCluster) -> dict:
    work = tmp_path_factory.mktemp("bridge")
    document = data_args[data_args.index("--data-path") + 1]
    tokenizer = data_args[data_args.index("--tokenizer-model") + 1]
    copy = work / "data" / MEMBERS[1]
    copy.parent.mkdir(parents=True)
    for suffix in (".bin", ".idx"):
        shutil.copy(document + suffix, str(copy) + suffix)
    stale = _stale_lease(work / "ckpt")
    data = ["0.4", document, "0.6", str(copy)]
    run = _supervised(work, data, tokenizer, SCRIPT, 2, PIPELINE, slurm, culprit=0)
    first, _, second = run.log.partition("attempt 2: launching training")
    return dict(work=work, run=run, first=first, second=second, stale=stale)


def _ledger(work: Path) -> list[dict]:
    lines = (work / "signals" / SPIKE_LEDGER_FILE).read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.mark.timeout(900)
def test_bridge_trains_with_every_feature(bridge: dict) -> None:
    first: str = bridge["first"]
    assert "Starting training loop at iteration 0" in first  # Bridge's own loop
    assert f"taking over the run lock of training pid {bridge['stale'].pid}" in first
    # The overrides reached Bridge's optimizer (OptimizerConfigOverrideProvider).
    assert "embedding.word_embeddings.weight wd_mult=0 <- --embedding-weight-decay-mult" in first
    assert "mlp.linear_fc2.weight wd_mult=0.5 <- --weight-decay-override" in first
    # Both ranks read their batches through the features' reader (Bridge's get_batch).
    exits = bridge["run"].exits()  # the last attempt's
    assert {r: sorted(e["reads"]) for r, e in exits.items()} == {0: ["0"], 1: ["0"]}
    signals = read_signals(bridge["work"] / "signals" / SIGNALS_FILE)
    assert {r.iteration for r in signals} >= TRAINED
    for record in signals:
        assert math.isfinite(record.lm_loss) and record.z_loss is not None, record
        assert record.log_z is not None, record
        assert len(record.bucket_grad_norms) > 1 and record.update_ratio is not None, record
        assert set(record.lm_loss_by_dataset) == set(MEMBERS), record
        assert record.max_loss_dp_rank == 0, record
        assert record.params_norm is not None and record.lr is not None, record
    assert all(bridge["run"].records().values())  # the sample log of each DP rank
    # The features' scalars go to Bridge's own TensorBoard writer (on its state object).
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(bridge["work"] / "tensorboard"))
    tags = events.Reload().Tags()["scalars"]
    assert any(t.startswith("bucket-grad-norm/") for t in tags), tags
    assert {f"lm-loss-by-dataset/{m}" for m in MEMBERS} <= set(tags), tags


@pytest.mark.timeout(900)
def test_the_supervisor_rolls_bridge_back_and_the_resume_skips_the_window(bridge: dict) -> None:
    first, second, run = bridge["first"], bridge["second"], bridge["run"]
    assert "rank 0 on vm exited 42" in first.replace(socket.gethostname(), "vm")
    assert "rank 1 on vm exited 42" in first.replace(socket.gethostname(), "vm")
    assert "exiting with code 42 without saving a checkpoint" in first
    rollback = next(e for e in _ledger(bridge["work"]) if e["kind"] == "rollback")
    assert (rollback["onset"], rollback["culprit_dp_rank"]) == (BAD[0], 0)
    assert "Roll back to checkpoint 25, skip iterations 26-37" in first  # the spike hook
    # Bridge resumes from its own tracker, which the apply rewrote with Megatron's.
    assert "successfully loaded checkpoint from" in second
    assert "at iteration 25" in second.split("successfully loaded checkpoint from", 1)[1]
    assert run.returncode == 0, run.log[-4000:]
    assert "training finished successfully" in second
    assert {e["exit_code"] for e in run.exits().values()} == {0}
    assert "megatron-ext spike detector" not in second
    attempt_end = json.loads(
        (bridge["work"] / "ckpt" / "launch_state" / "attempt_end.json").read_text()
    )
    assert attempt_end["complete"] is True
    trained = {r.iteration for records in run.records().values() for r in records}
    assert trained == TRAINED
    import torch

    final = torch.load(
        bridge["work"] / "ckpt" / f"iter_{TRAIN_ITERS:07d}" / "train_state.pt", weights_only=True
    )
    assert int(final["skipped_train_samples"]) == len(SKIPPED) * GLOBAL_BATCH
    assert int(final["consumed_train_samples"]) == TRAIN_ITERS * GLOBAL_BATCH
    later = [e for e in _ledger(bridge["work"]) if e.get("attempt") == 2]
    assert [e["kind"] for e in later] == ["config"]  # no spike after the skip


def test_the_first_updates_after_the_rollback_take_the_recovery_lr_ramp(bridge: dict) -> None:
    """``--recovery-iters 3 --recovery-lr-mult 0.25`` under Bridge's loop: the resume from the
    applied rollback is recognised, and update k after it trains at the ramp's factor times the
    lr the first attempt had at iteration 25 + k (the schedule stands still over the skipped
    window); then the schedule's own lr."""
    attempts: dict[int, dict[int, Any]] = {}
    for r in read_signals(bridge["work"] / "signals" / SIGNALS_FILE):
        attempts.setdefault(r.attempt, {})[r.iteration] = r
    first, resumed = attempts[1], attempts[2]
    assert (
        "megatron-ext: resumed from the rollback to iteration 25: recovery for 3"
        in (bridge["second"])
    )
    assert not any(r.recovery for r in first.values())
    after = [resumed[i] for i in sorted(resumed) if i > SKIPPED[-1]]
    for k, record in enumerate(after[: RECOVERY_ITERS + 2], start=1):
        factor = RECOVERY_LR_MULT + (1 - RECOVERY_LR_MULT) * (k - 1) / RECOVERY_ITERS
        factor = factor if k <= RECOVERY_ITERS else 1.0
        assert record.lr == pytest.approx(factor * first[SKIPPED[0] - 1 + k].lr, rel=1e-9), k
        expected = {"update": k, "lr_mult": factor} if k <= RECOVERY_ITERS else {}
        assert record.recovery == expected, record


@pytest.mark.timeout(900)
def test_lookup_equals_the_bridge_runs_sample_log(bridge: dict, tmp_path: Path, capsys) -> None:
    """At iterations of both attempts (before the rollback target, the onset and the exit,
    rolled back; after the skipped window): the lookup's answer, read from the Bridge
    checkpoint's run_config.yaml, is what Bridge trained: the same samples with the same
    tokens, except where the drill corrupted DP rank 1's tokens in flight, which it names."""
    check_lookup_equals_sample_log(bridge["run"], bridge["work"], tmp_path, capsys, culprit=0)


def test_a_resume_under_other_weight_decay_multipliers_is_refused(bridge: dict, tmp_path) -> None:
    """The weight-decay resume check at start-up, on the drill's own Bridge checkpoint (the
    flags ride in the overlay's layout file, as Megatron's args carry them under Megatron's
    loop): the run's flags pass; other multipliers, or none, are refused; a fresh optimizer
    (Bridge's ``load_optim=False``) passes."""
    from megatron_ext.bridge import args as bridge_args
    from megatron_ext.weight_decay.adapter import WeightDecayFeature
    from megatron_ext.weight_decay.core import WeightDecayResumeError

    config = example_config(tmp_path)
    config.checkpoint.load = str(bridge["work"] / "ckpt")

    def start(flags: list[str]) -> None:  # what megatron_ext.bridge.pretrain runs first
        WeightDecayFeature().validate(bridge_args.megatron_args(config, flags))

    start(["--embedding-weight-decay-mult", "0", "--weight-decay-override", WD_OVERRIDE])
    for other in (["--embedding-weight-decay-mult", "0.1"], []):
        with pytest.raises(WeightDecayResumeError, match=f"iter_{TRAIN_ITERS:07d} was trained"):
            start(other)
    config.checkpoint.load_optim = False
    start([])
