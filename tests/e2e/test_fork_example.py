"""The fork example (``docs/examples/pretrain_gpt_fork.py``: a pretrain script of its own on
``megatron_ext.fork``) trains with every feature through the real loop (CPU harness, DP=2,
a two-prefix blend), through the spike drill: the detector flags the bad batch and every rank
exits 42, ``skiplist --apply`` rolls back and the resumed run skips the window; and
``megatron-ext lookup`` answers every checked iteration with the sample log's record.

Two launches (the drill's and the resume's), as tests/e2e/test_spike_drill.py runs
``pretrain_gpt_ext.py``: the same flags, drill and plan, another script.
"""

from __future__ import annotations

import json
import math
import shutil
import socket
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from megatron_ext.common.files import RUN_LOCK_FILE, SIGNALS_FILE, SPIKE_LEDGER_FILE
from megatron_ext.common.records.signals import read_signals
from megatron_ext.common.run_lock import Holder
from megatron_ext.registry import patching
from tests.support.drill import BAD, TRAIN_ITERS, check_lookup_equals_sample_log, drill_args
from tests.support.harness import (
    GLOBAL_BATCH,
    REPO,
    TELEMETRY,
    Run,
    checkpoint_args,
    launch,
    run_skiplist,
)
from tests.support.layouts import FUSED_FLAGS

EXAMPLE = REPO / "docs" / "examples" / "pretrain_gpt_fork.py"

pytestmark = pytest.mark.skipif(
    not patching.installed_version().startswith("0.19."),
    reason="the example is written against megatron-core 0.19's batch helpers, as a fork's "
    "script is against its own version",
)

# Every feature: z-loss with the fused output layer + loss and log Z, weight-decay overrides,
# bucket norms with the update ratio, the attention logit, signals (per source on the blend),
# the sample log (the harness's default), the spike detector and drill (drill_args), the run
# lock (on with --save).
FEATURES = [
    "--z-loss-coeff",
    "1e-4",
    *FUSED_FLAGS,
    "--log-output-z",
    "--signals-attention-logit",
    "--embedding-weight-decay-mult",
    "0",
    "--weight-decay-override",
    "*.linear_fc2.weight=0.5",
    *TELEMETRY,
]
PLAN = ["--rollback-iters", "5", "--skip-batches", "12"]  # back to 25, skip 26-37
SKIPPED = range(26, 38)
# Attempt 1 trains up to its exit (the onset + patience); attempt 2 resumes past the window.
TRAINED = set(range(1, BAD[0] + 4)) | set(range(SKIPPED[-1] + 1, TRAIN_ITERS + 1))
MEMBERS = ("tiny_text_document", "copy_text_document")


def _blend(data_args: list[str], root: Path) -> list[str]:
    """The tiny corpus and a copy of it as two blend members (0.4 / 0.6)."""
    at = data_args.index("--data-path")
    document = data_args[at + 1]
    copy = root / "data" / MEMBERS[1]
    copy.parent.mkdir(parents=True)
    for suffix in (".bin", ".idx"):
        shutil.copy(document + suffix, str(copy) + suffix)
    data = list(data_args)
    data[at + 1 : at + 2] = ["0.4", document, "0.6", str(copy)]
    data[data.index("--data-cache-path") + 1] = str(root / "index-cache")
    return data


def _stale_lease(ckpt: Path) -> Holder:
    """A run lock left by a training that died on this host (its pid no longer runs)."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    holder = Holder("training", socket.gethostname(), dead.pid, "1", "", 0.0, "f" * 16)
    ckpt.mkdir(parents=True)
    (ckpt / RUN_LOCK_FILE).write_text(json.dumps(asdict(holder)) + "\n")
    return holder


@pytest.fixture(scope="module")
def fork(tmp_path_factory, data_args) -> dict:
    work = tmp_path_factory.mktemp("fork-example")
    args = [*drill_args(_blend(data_args, work), work, f"{BAD[0]}-{BAD[1]}:1", 3), *FEATURES]
    stale = _stale_lease(work / "ckpt")
    first = launch(work, args, nproc=2, script=EXAMPLE)
    first_exits = first.exits()
    plan = run_skiplist(work, *PLAN, "--apply")
    second = launch(work, args, nproc=2, script=EXAMPLE)
    return dict(work=work, first=first, exits=first_exits, plan=plan, second=second, stale=stale)


def _ledger(work: Path) -> list[dict]:
    lines = (work / "signals" / SPIKE_LEDGER_FILE).read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.mark.timeout(900)
def test_the_fork_example_trains_with_every_feature(fork: dict) -> None:
    first: Run = fork["first"]
    assert f"taking over the run lock of training pid {fork['stale'].pid}" in first.log
    assert "building the fork's GPT model" in first.log  # the script's own model provider
    assert "embedding.word_embeddings.weight wd_mult=0 <- --embedding-weight-decay-mult" in (
        first.log
    )
    assert "mlp.linear_fc2.weight wd_mult=0.5 <- --weight-decay-override" in first.log
    # Both ranks read their batches through the script's get_batch (Forward.read).
    assert {r: sorted(e["reads"]) for r, e in fork["exits"].items()} == {0: ["0"], 1: ["1"]}
    signals = read_signals(fork["work"] / "signals" / SIGNALS_FILE)
    assert {r.iteration for r in signals} >= TRAINED
    for record in signals:
        assert math.isfinite(record.lm_loss) and record.z_loss is not None, record
        assert record.log_z is not None and record.max_attention_logit is not None, record
        assert len(record.bucket_grad_norms) > 1 and record.update_ratio is not None, record
        assert set(record.lm_loss_by_dataset) == set(MEMBERS), record
        assert record.max_loss_dp_rank in (0, 1), record
    assert all(fork["second"].records().values())  # the sample log of each DP rank


@pytest.mark.timeout(900)
def test_the_drill_rolls_the_fork_back_and_the_resume_skips_the_window(fork: dict) -> None:
    assert {e["exit_code"] for e in fork["exits"].values()} == {42}
    assert "exiting with code 42 without saving a checkpoint" in fork["first"].log
    rollback = next(e for e in _ledger(fork["work"]) if e["kind"] == "rollback")
    assert (rollback["onset"], rollback["culprit_dp_rank"]) == (BAD[0], 1)
    plan = fork["plan"]
    assert plan.returncode == 0, plan.stderr
    assert "Roll back to checkpoint 25, skip iterations 26-37" in plan.stdout
    second: Run = fork["second"]
    assert second.returncode == 0, second.log[-4000:]
    assert "megatron-ext spike tracker" not in second.log
    trained = {r.iteration for records in second.records().values() for r in records}
    assert trained == TRAINED
    final = checkpoint_args(fork["work"] / "ckpt", TRAIN_ITERS)
    assert final.skipped_train_samples == len(SKIPPED) * GLOBAL_BATCH
    assert final.consumed_train_samples == TRAIN_ITERS * GLOBAL_BATCH
    later = [e for e in _ledger(fork["work"]) if e.get("attempt") == 2]
    assert [e["kind"] for e in later] == ["config"]  # no spike after the skip


@pytest.mark.timeout(900)
def test_lookup_equals_the_fork_examples_sample_log(fork: dict, tmp_path: Path, capsys) -> None:
    """At iterations of both attempts (before the rollback target, the onset and the exit,
    rolled back; after the skipped window): the lookup's answer, read from the checkpoint's
    args, is what the script trained: the same samples with the same tokens, except where the
    drill corrupted DP rank 1's tokens in flight, which the lookup names."""
    check_lookup_equals_sample_log(fork["second"], fork["work"], tmp_path, capsys)
