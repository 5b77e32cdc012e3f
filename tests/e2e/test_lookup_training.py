"""``megatron-ext lookup`` agrees with what the real training loop recorded (CPU harness,
DP=2, a two-prefix blend), including a resume that skips iterations."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext.common import versions
from megatron_ext.lookup import cli
from tests.support.harness import TINY_TRAINING, checkpoint_args, launch

SKIPS = (13, 14)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_args):
    """U: 20 iterations uninterrupted; S: resumed from U's iteration-10 checkpoint with
    iterations 13 and 14 skipped. Data: a two-prefix blend of the tiny corpus."""
    root = tmp_path_factory.mktemp("lookup-e2e")
    document = data_args[data_args.index("--data-path") + 1]
    copy = root / "copy_text_document"
    for suffix in (".bin", ".idx"):
        shutil.copy(document + suffix, str(copy) + suffix)
    data = list(data_args)
    data[data.index("--data-path") + 1 : data.index("--data-path") + 2] = [
        "0.4",
        document,
        "0.6",
        str(copy),
    ]
    data[data.index("--data-cache-path") + 1] = str(root / "index-cache")

    def run(name: str, *more: str):
        ckpt = root / name / "ckpt"
        result = launch(
            root / name,
            [*data, "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "10", *more],
            nproc=2,
        )
        assert result.returncode == 0, result.log[-4000:]
        return result

    uninterrupted = run("U")
    shutil.copytree(root / "U" / "ckpt" / "iter_0000010", root / "S" / "ckpt" / "iter_0000010")
    (root / "S" / "ckpt" / "latest_checkpointed_iteration.txt").write_text("10")
    resumed = run("S", "--iterations-to-skip", *map(str, SKIPS))
    return uninterrupted, resumed


def _session(checkpoint: Path) -> cli.Session:
    options = cli.build_parser().parse_args(
        ["--from-checkpoint", str(checkpoint), "--iteration", "1"]
    )
    return cli.Session(options, [])


@pytest.mark.timeout(900)
def test_harness_records_equal_the_tools_answer_including_resume_with_skips(trained) -> None:
    uninterrupted, resumed = trained
    for run, first in ((uninterrupted, 1), (resumed, 11)):
        session = _session(run.workdir / "ckpt")
        recorded = {
            (r.iteration, r.dp_rank, r.microbatch): r
            for records in run.records().values()
            for r in records
        }
        for iteration in range(first, 21):
            batch = session.config.schedule.batch(iteration)
            _, answer = cli.batch_records(session, batch)
            slots = {}
            for sample in answer:
                slot = slots.setdefault(
                    (iteration, sample["dp_rank"], sample["microbatch"]), ([], [])
                )
                slot[0].append(sample["sample_index"])
                slot[1].append(sample["token_sha1"])
            if run is resumed and iteration in SKIPS:
                assert batch.skipped and all(s["skipped"] for s in answer)
                assert not set(slots) & set(recorded), "a skipped iteration was trained"
                continue
            assert not batch.skipped
            for key, (ids, digests) in slots.items():
                assert (recorded[key].sample_ids, recorded[key].token_sha1) == (ids, digests), key
    final = checkpoint_args(resumed.workdir / "ckpt", 20)
    assert final.iterations_to_skip == list(SKIPS)
    assert (
        cli.main(
            [
                "--from-checkpoint",
                str(resumed.workdir / "ckpt"),
                "--iteration",
                "13",
                "--sample-log",
                str(resumed.samples),
            ]
        )
        == 0
    )
    assert (
        cli.main(
            [
                "--from-checkpoint",
                str(uninterrupted.workdir / "ckpt"),
                "--iteration",
                "13",
                "--sample-log",
                str(uninterrupted.samples),
            ]
        )
        == 0
    )


RAMPUP = ["--rampup-batch-size", "4", "4", "64", "--global-batch-size", "16"]
RAMPED = [4, 4, 4, 4, 4, 4, 8, 8, 8, 12, 12, 16]  # 0.17's sizes for RAMPUP (88 samples)


@pytest.mark.compat
@pytest.mark.timeout(900)
def test_lookup_equals_the_sample_log_under_a_rampup(tmp_path, data_args) -> None:
    """--rampup-batch-size as the installed megatron-core trains it: 0.17 ramps the batch up
    (4 x6, 8 x3, 12 x2, 16 over 88 samples), 0.18 on ignore it (16 x5). The lookup, reading
    the checkpoint the run left, answers every iteration with the batch it really trained:
    equal to the sample log, and refused by nothing."""
    ckpt = tmp_path / "ckpt"
    # Sample-based (0.17 asserts a ramp-up is): no --train-iters / --lr-warmup-iters.
    flags = dict(zip(TINY_TRAINING[::2], TINY_TRAINING[1::2], strict=True))
    del flags["--train-iters"], flags["--lr-warmup-iters"]
    training = [*(x for pair in flags.items() for x in pair), "--train-samples", "88"]
    run = launch(
        tmp_path,
        [*data_args, *RAMPUP, "--save", str(ckpt), "--save-interval", "100"],
        nproc=2,
        training=training,
    )
    assert run.returncode == 0, run.log[-4000:]
    ramps = versions.installed().startswith("0.17.")  # the harness trains with it
    expected = RAMPED if ramps else [16] * 5
    saved = checkpoint_args(ckpt, len(expected))
    assert ("step_batch_size_schedule" not in vars(saved)) == ramps  # what the lookup reads
    session = _session(ckpt)
    recorded = {
        (r.iteration, r.dp_rank, r.microbatch): r for rs in run.records().values() for r in rs
    }
    assert {k[0] for k in recorded} == set(range(1, len(expected) + 1))
    for iteration, size in enumerate(expected, start=1):
        batch = session.config.schedule.batch(iteration)
        assert batch.size == size, iteration
        _, answer = cli.batch_records(session, batch)
        slots: dict = {}
        for sample in answer:
            ids, digests = slots.setdefault(
                (iteration, sample["dp_rank"], sample["microbatch"]), ([], [])
            )
            ids.append(sample["sample_index"])
            digests.append(sample["token_sha1"])
        assert set(slots) == {k for k in recorded if k[0] == iteration}, iteration
        for key, (ids, digests) in slots.items():
            assert (recorded[key].sample_ids, recorded[key].token_sha1) == (ids, digests), key
    last = len(expected)
    argv = ["--from-checkpoint", str(ckpt), "--iteration", str(last), "--sample-log"]
    assert cli.main([*argv, str(run.samples)]) == 0


@pytest.mark.timeout(900)
def test_the_sample_log_answer_equals_the_index_answer_without_megatron(trained) -> None:
    """``--from-sample-log`` on a trained checkpoint: a process that imports neither Megatron
    nor torch gives the same samples and token SHA-1s as the index path, every iteration."""
    _, resumed = trained
    ckpt = resumed.workdir / "ckpt"
    code = (
        "import io, json, sys, contextlib\n"
        "from megatron_ext import cli\n"
        "answers = {}\n"
        f"for it in {[i for i in range(11, 21) if i not in SKIPS]}:\n"
        "    out = io.StringIO()\n"
        "    with contextlib.redirect_stdout(out):\n"
        f"        rc = cli.main(['lookup', '--from-checkpoint', {str(ckpt)!r}, '--iteration',"
        " str(it), '--from-sample-log', '--json'])\n"
        "    assert rc == 0, it\n"
        "    answers[it] = json.loads(out.getvalue())['samples']\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('megatron', 'torch'))\n"
        "print(json.dumps({'heavy': heavy[:10], 'answers': answers}))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["heavy"] == []
    session = _session(ckpt)
    keys = ("iteration", "dp_rank", "microbatch", "sample_index", "token_sha1")
    for iteration, logged in report["answers"].items():
        _, answer = cli.batch_records(session, session.config.schedule.batch(int(iteration)))
        expected = [{k: r[k] for k in keys} for r in answer]
        assert [{k: r[k] for k in keys} for r in logged] == expected, iteration
