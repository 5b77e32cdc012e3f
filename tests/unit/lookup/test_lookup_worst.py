"""``megatron-ext lookup --worst``: ranking a batch's samples by the loss training recorded.

The sample log is written with the real writer (``SampleLog``); the lookup records are shaped
as ``batch_records`` returns them. The end-to-end path (caches, documents, text) runs in the
real-shaped drill (tests/e2e/test_spike_drill.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext.common.records.sample_log import SampleLog, SampleRecord
from megatron_ext.lookup import cli
from megatron_ext.lookup.crosscheck import attach, ranked_samples, worst_lines, worst_table
from megatron_ext.lookup.errors import ConfigError, DataChanged, PositionError
from tests.support.checkpoints import write_loadable_checkpoint


def _write(directory: Path, iteration: int, losses: dict[tuple[int, int], list[float]]) -> None:
    for (rank, mb), values in losses.items():
        ids = [100 * iteration + 10 * rank + 2 * mb + k for k in range(len(values))]
        SampleLog(directory, rank).write(
            SampleRecord(
                iteration=iteration,
                dp_rank=rank,
                microbatch=mb,
                sample_ids=ids,
                token_sha1=[f"sha{i}" for i in ids],
                loss_sum=0.0,
                num_tokens=0,
                sample_losses=values,
            )
        )


def _lookup_records(iteration: int, ranks: int = 2, mbs: int = 2) -> list[dict]:
    return [
        {
            "iteration": iteration,
            "dp_rank": r,
            "microbatch": m,
            "sample_index": 100 * iteration + 10 * r + 2 * m + k,
            "token_sha1": f"sha{100 * iteration + 10 * r + 2 * m + k}",
            "dataset_path": "/data/web_text_document",
            "dataset_sample": 7,
            "documents": [{"document": 40 + k, "offset": 0, "count": 65}],
            "text": "some  text\nwith spaces",
        }
        for m in range(mbs)
        for r in range(ranks)
        for k in range(2)
    ]


def test_samples_are_ranked_by_their_loss_and_a_replay_wins(tmp_path: Path) -> None:
    _write(
        tmp_path,
        7,
        {(0, 0): [3.0, 3.1], (0, 1): [2.9, 3.0], (1, 0): [6.5, 3.2], (1, 1): [3.0, 7.0]},
    )
    _write(tmp_path, 8, {(0, 0): [9.0, 9.0]})  # another iteration: not read
    ranked = ranked_samples(tmp_path, 7)
    assert [(r.dp_rank, r.microbatch, r.position, r.loss) for r in ranked[:3]] == [
        (1, 1, 1, 7.0),
        (1, 0, 0, 6.5),
        (1, 0, 1, 3.2),
    ]
    assert len(ranked) == 8
    _write(tmp_path, 7, {(1, 1): [3.0, 3.0]})  # a rollback replay of the same slot
    assert ranked_samples(tmp_path, 7)[0].loss == 6.5
    assert {r.dp_rank for r in ranked_samples(tmp_path, 7, dp_rank=0)} == {0}


def test_refusals(tmp_path: Path) -> None:
    with pytest.raises(PositionError, match="no record of iteration 3"):
        ranked_samples(tmp_path, 3)
    SampleLog(tmp_path, 0).write(  # an older log, without per-sample losses
        SampleRecord(
            iteration=3,
            dp_rank=0,
            microbatch=0,
            sample_ids=[1, 2],
            token_sha1=["a", "b"],
            loss_sum=6.0,
            num_tokens=128,
        )
    )
    with pytest.raises(ConfigError, match="no per-sample losses"):
        ranked_samples(tmp_path, 3)


def test_the_ranked_samples_get_their_documents_and_a_changed_id_is_refused(
    tmp_path: Path,
) -> None:
    _write(
        tmp_path,
        7,
        {(0, 0): [3.0, 3.1], (0, 1): [2.9, 3.0], (1, 0): [6.5, 3.2], (1, 1): [3.0, 7.0]},
    )
    records = _lookup_records(7)
    records[3]["token_sha1"] = "corrupted in flight"  # dp 1, mb 0, position 1
    top, changed = attach(ranked_samples(tmp_path, 7)[:3], records)
    assert [(r["sample_index"], r["rank_by_loss"], r["loss"]) for r in top] == [
        (713, 1, 7.0),
        (710, 2, 6.5),
        (711, 3, 3.2),
    ]
    assert changed == 1 and top[2]["trained_tokens_differ"]
    table = worst_table(worst_lines(top, changed, 8, "sample log X"), top)
    assert "worst 3 of 8 samples by token-averaged loss (sample log X)" in table
    assert "#1   loss 7.0000  dp 1 mb 1  sample 713" in table and "[trained tokens differ]" in table
    assert "text: some text with spaces" in table
    name = Path(top[0]["dataset_path"]).name
    assert f"sample 713  source {name}#{top[0]['dataset_sample']}" in table  # its blend member
    records[2]["sample_index"] = 999  # the indices no longer give what training read
    with pytest.raises(DataChanged, match="training logged sample 710, the indices give 999"):
        attach(ranked_samples(tmp_path, 7), records)


def test_from_sample_log_answers_without_megatron_or_torch(tmp_path: Path) -> None:
    """``--from-sample-log``: the log's records in the index answer's order and field names,
    and a lookup process that imports neither Megatron nor torch."""
    _write(tmp_path, 7, {(0, 0): [3.0, 3.1], (0, 1): [2.9, 3.0], (1, 0): [6.5, 3.2]})
    code = (
        "import io, json, sys, contextlib\n"
        "from megatron_ext import cli\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n"
        f"    rc = cli.main(['lookup', '--sample-log', {str(tmp_path)!r}, '--iteration', '7',"
        " '--from-sample-log', '--json'])\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('megatron', 'torch'))\n"
        "print(json.dumps({'rc': rc, 'heavy': heavy[:10], 'answer': json.loads(out.getvalue())}))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["rc"] == 0 and report["heavy"] == []
    assert report["answer"]["lines"][1].startswith(f"source: sample log {tmp_path}")
    keys = ("iteration", "dp_rank", "microbatch", "sample_index", "token_sha1")
    expected = [
        {k: r[k] for k in keys}
        for r in _lookup_records(7)
        if (r["dp_rank"], r["microbatch"]) != (1, 1)
    ]
    assert [{k: r[k] for k in keys} for r in report["answer"]["samples"]] == expected
    assert [r["loss"] for r in report["answer"]["samples"]][:2] == [3.0, 3.1]


def test_from_sample_log_refuses_what_needs_the_indices(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--sample-log", str(tmp_path), "--iteration", "7", "--from-sample-log", "--text"])
    with pytest.raises(SystemExit):  # Megatron flags cannot change what the log recorded
        cli.main(["--sample-log", str(tmp_path), "--iteration", "7", "--from-sample-log", "--x"])
    assert cli.main(["--sample-log", str(tmp_path), "--iteration", "7", "--from-sample-log"]) == 1
    assert "no record of iteration 7" in capsys.readouterr().err


def test_worst_of_a_run_without_a_sample_log_is_refused_before_megatron(tmp_path: Path) -> None:
    """The planner's report asks ``--worst`` on every rollback; a run that wrote no sample log
    is refused from the checkpoint's args, in a process that imports neither Megatron nor
    torch (it spent seconds importing them before)."""
    ckpt = tmp_path / "ckpt"
    write_loadable_checkpoint(ckpt / "iter_0000006", saved_args=(("sample_log_dir", None),))
    argv = ["lookup", "--from-checkpoint", str(ckpt), "--ckpt-step", "6", "--iteration", "7"]
    code = (
        "import json, sys\n"
        "from megatron_ext import cli\n"
        f"rc = cli.main({[*argv, '--worst', '3', '--text', '--json']!r})\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('megatron', 'torch'))\n"
        "print(json.dumps({'rc': rc, 'heavy': heavy[:10]}))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert json.loads(result.stdout) == {"rc": 1, "heavy": []}, result.stderr[-2000:]
    assert "refused: --worst reads the sample log training wrote" in result.stderr


def test_an_out_file_that_cannot_be_written_is_refused(tmp_path: Path, capsys) -> None:
    """``--out`` (and ``--emit-blocklist``) to a directory, or under a file: a refusal naming
    the path, not an OSError traceback; nothing is left beside it."""
    logs, blocker = tmp_path / "logs", tmp_path / "a-file"
    _write(logs, 7, {(0, 0): [3.0, 3.1]})
    blocker.write_text("keep\n")
    flags = ["--sample-log", str(logs), "--iteration", "7", "--from-sample-log", "--out"]
    for target in (logs, blocker / "batch.jsonl"):
        assert cli.main([*flags, str(target)]) == 1
        err = capsys.readouterr().err
        assert f"refused: cannot write {target}" in err and "Traceback" not in err
    assert blocker.read_text() == "keep\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "logs"]
    assert not [p for p in logs.iterdir() if p.name.startswith(".")]


def test_a_checkpoint_path_that_is_a_file_is_refused(tmp_path: Path, capsys) -> None:
    """``--from-checkpoint`` naming a file of the checkpoint (its tracker, ``metadata.json``):
    the refusal says to pass the directory, not a NotADirectoryError traceback."""
    ckpt = tmp_path / "ckpt"
    write_loadable_checkpoint(ckpt / "iter_0000006", saved_args=(("sample_log_dir", None),))
    (ckpt / "latest_checkpointed_iteration.txt").write_text("6\n")
    for path in (ckpt / "latest_checkpointed_iteration.txt", ckpt / "iter_0000006/metadata.json"):
        argv = ["--from-checkpoint", str(path), "--iteration", "7", "--worst", "3"]
        assert cli.main(argv) == 1
        err = capsys.readouterr().err
        assert f"refused: {path} is a file" in err and "iter_NNNNNNN directory" in err


@pytest.mark.parametrize("iteration", ["0", "-3"])
def test_an_iteration_below_1_is_a_usage_error(tmp_path: Path, capsys, iteration: str) -> None:
    """Iterations are 1-indexed: 0 or a negative one is said so, not answered with a gap of
    the layout history or a sample log lacking it."""
    _write(tmp_path, 7, {(0, 0): [3.0, 3.1]})
    for more in (["--from-sample-log"], ["--data-parallel-size", "1"]):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["--sample-log", str(tmp_path), "--iteration", iteration, *more])
        assert exit_.value.code == 2
        assert f"--iteration must be >= 1 (iterations are 1-indexed), got {iteration}" in (
            capsys.readouterr().err
        )


def test_a_nan_or_infinite_loss_ranks_worst(tmp_path: Path) -> None:
    """A diverged sample (loss NaN or inf, as the sample log writes them) is the worst, not
    sorted at random: a NaN key used to scramble the whole ranking (3.0 came first)."""
    nan, inf = float("nan"), float("inf")
    _write(tmp_path, 7, {(0, 0): [3.0, nan], (0, 1): [2.9, 7.0], (1, 0): [6.5, inf]})
    ranked = ranked_samples(tmp_path, 7)
    assert [(r.dp_rank, r.microbatch, r.position) for r in ranked[:4]] == [
        (0, 0, 1),
        (1, 0, 1),
        (0, 1, 1),
        (1, 0, 0),
    ]
    assert [r.loss for r in ranked[2:]] == [7.0, 6.5, 3.0, 2.9]
