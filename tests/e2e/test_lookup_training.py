"""``megatron-ext lookup`` agrees with what the real training loop recorded (CPU harness,
DP=2, a two-prefix blend), including a resume that skips iterations."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from megatron_ext.lookup import cli
from tests.support.harness import checkpoint_args, launch

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
