"""Skip windows across a change of the global batch, and skip lists that reach back into
iterations the loaded checkpoint already trained, in real training launches (CPU harness).

One run directory (24 iterations planned, checkpoints every 4):

- A: global batch 8, iterations 1-12 (exits at 12); a rollback request at 12 (onset 11) is
  planned and applied by the real ``megatron-ext skiplist --apply``: back to checkpoint 8,
  skip 9-12, which the plan records as samples 64-95 at global batch 8;
- C: the resume with ``--global-batch-size 4`` alone, which Megatron refuses with an
  assertion traceback deep in the checkpoint load;
- B: the resume with ``--global-batch-size 4 --override-opt_param-scheduler`` and a
  hand-made skip file ``6-10`` that reaches back before the resume (iteration 9); runs to 24.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from megatron_ext.common.records.sample_log import SampleRecord
from megatron_ext.common.records.skip_ranges import read_file
from megatron_ext.incidents import cli as skiplist
from megatron_ext.lookup import cli as lookup
from tests.support.faults import fault
from tests.support.harness import Run, checkpoint_args, launch

pytestmark = pytest.mark.e2e

WINDOW_SAMPLES = set(range(64, 96))  # iterations 9-12 at global batch 8, after checkpoint 8


def _records(run: Run) -> list[SampleRecord]:
    return [r for records in run.records().values() for r in records]


@pytest.fixture(scope="module")
def resized(tmp_path_factory, data_args) -> dict:
    root = tmp_path_factory.mktemp("skip-window")
    ckpt, work = root / "ckpt", root / "run"
    common = [
        *data_args,
        "--train-iters",
        "24",
        "--save",
        str(ckpt),
        "--load",
        str(ckpt),
        "--save-interval",
        "4",
        "--signals-dir",
        str(work / "signals"),
    ]
    first = launch(work, [*common, "--exit-interval", "12"])
    assert first.returncode == 0, first.log[-4000:]
    trained_by_a = _records(first)
    signals = [json.loads(line) for line in (work / "signals" / "signals.jsonl").open()]
    request = {
        "kind": "rollback",
        "iteration": 12,
        "onset": 11,
        "consumed_samples": 96,
        "culprit_dp_rank": 0,
        "loss": 9.0,
        "loss_baseline": 5.0,
        "loss_threshold": 5.5,
        "grad_norm": None,
        "grad_baseline": None,
        "classification": "drill: a bad batch",
        "attempt": signals[-1]["attempt"],
    }
    with open(work / "signals" / "spikes.jsonl", "a") as ledger:
        ledger.write(json.dumps(request) + "\n")
    planned = skiplist.main(
        [
            *("--ckpt-dir", str(ckpt), "--signals-dir", str(work / "signals")),
            *("--rollback-iters", "2", "--skip-batches", "4", "--no-lookup", "--apply"),
        ]
    )
    assert planned == 0
    plan = json.loads((ckpt / "megatron_ext_incidents" / "incident-001.json").read_text())
    resize = ["--global-batch-size", "4"]
    refused = launch(root / "refused", [*common, *resize])
    hand_made = root / "skips.txt"
    hand_made.write_text("# by hand, after reading the incident report\n6-10\n")
    resumed = launch(
        work,
        [
            *common,
            *resize,
            "--override-opt_param-scheduler",
            "--iterations-to-skip-file",
            str(hand_made),
        ],
    )
    shutil.copy(work / "log.txt", root / "log-B.txt")
    assert resumed.returncode == 0, resumed.log[-4000:]
    trained_by_b = _records(resumed)[len(trained_by_a) :]
    return {
        "ckpt": ckpt,
        "plan": plan,
        "a": trained_by_a,
        "b": trained_by_b,
        "refused": refused,
        "log": resumed.log,
        "hand_made": hand_made,
        "samples": resumed.samples,
    }


def _lookup(ckpt: Path, samples: Path, iteration: int, capsys) -> tuple[bool, str]:
    """Whether the lookup says ``iteration`` was skipped, and its check against the sample
    log."""
    argv = ["--from-checkpoint", str(ckpt), "--iteration", str(iteration)]
    session = lookup.Session(lookup.build_parser().parse_args(argv), [])
    session.use_layout_of(iteration)
    skipped = session.config.schedule.batch(iteration).skipped
    status = lookup.main([*argv, "--sample-log", str(samples)])
    out = capsys.readouterr()
    assert status == 0, out.err
    return skipped, out.out


@fault(
    "a rollback's skip window planned at global batch 8 (iterations 9-12), resumed with "
    "`--global-batch-size 4 --override-opt_param-scheduler` (Megatron skipped iterations 9-12 "
    "at the new size, other samples, and trained 16 of the window's samples again, silently)",
    "the window is kept in samples (64-95, recorded by the plan) and placed at the new batch: "
    "iterations 9-16 are skipped, announced at start-up; no sample id or token hash of the "
    "window is trained; the persisted list, the checkpoint and the lookup agree with the "
    "sample log",
    area="skip lists",
)
def test_a_skip_window_survives_a_change_of_the_global_batch(resized, capsys) -> None:
    plan = resized["plan"]
    assert plan["global_batch_size"] == 8 and plan["skip_samples"] == [64, 95]
    assert plan["skip_window"] == [9, 12]
    assert (
        "skip window of samples 64-95 (planned as iterations 9-12) is iterations 9-16 at "
        "global batch 4" in resized["log"]
    )
    # Token hashes say "the same data" whatever the index: B's dataset is built for 96 samples,
    # A's for 192 (another cache), and the window must stay out by content, not by number.
    window = [r for r in resized["a"] if 9 <= r.iteration <= 12]
    assert {i for r in window for i in r.sample_ids} == WINDOW_SAMPLES
    bad_tokens = {digest for r in window for digest in r.token_sha1}
    trained = resized["b"]
    assert {r.iteration for r in trained} == set(range(17, 25))
    assert not {i for r in trained for i in r.sample_ids} & WINDOW_SAMPLES
    assert not {digest for r in trained for digest in r.token_sha1} & bad_tokens
    assert {i for r in trained for i in r.sample_ids} == set(range(96, 128))
    ckpt = resized["ckpt"]
    assert (ckpt / "megatron_ext_skipped_iterations.txt").read_text().splitlines()[1:] == [
        "9-16 samples 64-95"
    ]
    assert checkpoint_args(ckpt, 24).iterations_to_skip == list(range(9, 17))
    skipped, out = _lookup(ckpt, resized["samples"], 17, capsys)
    assert not skipped and "sample log: 2 micro-batches match" in out, out
    assert all(_lookup(ckpt, resized["samples"], i, capsys)[0] for i in (9, 16))


@fault(
    "a hand-made skip list `6-10` passed when resuming at iteration 9 (checkpoint 8): 6-8 were "
    "trained already, and the start-up line and the persisted list said all of it is skipped",
    "start-up says `6-8 already trained (resuming at 9): not skipped; 9-10 will be skipped`; "
    "the persisted list, the checkpoint's args and the lookup do not claim 6-8 as skipped",
    area="skip lists",
)
def test_a_skip_list_reaching_back_names_the_part_already_trained(resized, capsys) -> None:
    assert (
        f"--iterations-to-skip-file {resized['hand_made']}: 6-8 already trained (resuming at "
        "9): not skipped; 9-10 will be skipped" in resized["log"]
    )
    ckpt = resized["ckpt"]
    assert read_file(ckpt / "megatron_ext_skipped_iterations.txt") == list(range(9, 17))
    assert checkpoint_args(ckpt, 24).iterations_to_skip == list(range(9, 17))
    assert {r.iteration for r in resized["a"]} >= {6, 7, 8}
    skipped, out = _lookup(ckpt, resized["samples"], 7, capsys)
    assert not skipped and "sample log: 4 micro-batches match" in out, out


@fault(
    "resumed with `--global-batch-size 4` from a checkpoint saved at 8, without "
    "`--override-opt_param-scheduler` (Megatron fails with an AssertionError traceback from "
    "its LR scheduler, deep in the checkpoint load)",
    "refused at start-up in one line naming both batch sizes and the two flags that choose "
    "whose LR schedule wins; Megatron's assertion is never reached",
    area="skip lists",
)
def test_a_changed_global_batch_is_refused_in_one_line(resized) -> None:
    refused = resized["refused"]
    assert refused.returncode != 0
    assert (
        "megatron-ext: --global-batch-size 4 differs from the 8 of the checkpoint at iteration "
        "8, and Megatron's LR schedule (counted in samples) would refuse it with an assertion: "
        "add --override-opt_param-scheduler" in refused.log
    ), refused.log[-3000:]
    assert "OptimizerParamScheduler" not in refused.log
