"""Resumes that change the layout, skip lists from every source, foreign log lines and
damaged checkpoints, in real training launches (CPU harness) and the real lookup.

One chain of three tiny launches in one run directory (12 iterations, global batch 8,
checkpoint and exit every 4):

- A: DP=2, micro-batch 2, iterations 1-4;
- B: resumed at DP=1 (nodes lost, same global batch), ``--iterations-to-skip-file=F`` (the
  ``=`` spelling) listing 6, ``--iterations-to-skip 7``, and a persisted list in the loaded
  directory (10); a foreign JSON line was appended to its signals log; iterations 5-8;
- C: resumed at DP=1 with micro-batch 1 and no skip flags, iterations 9-12.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from megatron_ext.lookup import cli
from tests.support.faults import fault
from tests.support.harness import Run, checkpoint_args, launch

pytestmark = pytest.mark.e2e

GLOBAL_BATCH = 8
PERSISTED_SKIP = 10


@pytest.fixture(scope="module")
def chain(tmp_path_factory, data_args) -> dict:
    root = tmp_path_factory.mktemp("resize")
    # A private copy of the data and tokenizer, so one test can move it.
    data = root / "data"
    data.mkdir()
    document = Path(data_args[data_args.index("--data-path") + 1])
    tokenizer = Path(data_args[data_args.index("--tokenizer-model") + 1])
    for suffix in (".bin", ".idx"):
        shutil.copy(f"{document}{suffix}", data / f"{document.name}{suffix}")
    shutil.copytree(tokenizer, data / tokenizer.name)
    flags = list(data_args)
    flags[flags.index("--data-path") + 1] = str(data / document.name)
    flags[flags.index("--tokenizer-model") + 1] = str(data / tokenizer.name)
    flags[flags.index("--data-cache-path") + 1] = str(root / "index-cache")
    ckpt, work = root / "ckpt", root / "run"
    common = [
        *flags,
        "--train-iters",
        "12",
        "--save",
        str(ckpt),
        "--load",
        str(ckpt),
        "--save-interval",
        "4",
        "--signals-dir",
        str(work / "signals"),
    ]

    def run(name: str, nproc: int, *more: str) -> Run:
        result = launch(work, [*common, *more], nproc=nproc)
        shutil.copy(work / "log.txt", root / f"log-{name}.txt")
        assert result.returncode == 0, result.log[-4000:]
        return result

    runs = {"A": run("A", 2, "--exit-interval", "4")}
    skip_file = root / "skips.txt"
    skip_file.write_text("# from an incident\n6\n")
    (ckpt / "megatron_ext_skipped_iterations.txt").write_text(f"{PERSISTED_SKIP}\n")
    with open(work / "signals" / "signals.jsonl", "a") as signals:
        signals.write('{"event": "node drained", "by": "ops tooling"}\n')
    runs["B"] = run(
        "B",
        1,
        f"--iterations-to-skip-file={skip_file}",
        "--iterations-to-skip",
        "7",
        "--exit-interval",
        "8",
    )
    runs["C"] = run("C", 1, "--micro-batch-size", "1")
    return {"root": root, "ckpt": ckpt, "runs": runs, "data": data, "samples": work / "samples"}


def _recorded(samples: Path) -> dict:
    """(iteration, DP rank, micro-batch) -> sample ids, the latest record of each."""
    from megatron_ext.common.records.sample_log import read_records

    out = {}
    for path in sorted(samples.glob("samples-dp*.jsonl")):
        for record in read_records(path):
            out[(record.iteration, record.dp_rank, record.microbatch)] = record.sample_ids
    return out


def _answer(ckpt: Path, iteration: int, *extra: str) -> dict:
    options = cli.build_parser().parse_args(
        ["--from-checkpoint", str(ckpt), "--iteration", str(iteration), *extra]
    )
    session = cli.Session(options, [])
    session.use_layout_of(iteration)
    batch = session.config.schedule.batch(iteration)
    _, records = cli.batch_records(session, batch)
    slots: dict = {}
    for sample in records:
        key = (iteration, sample["dp_rank"], sample["microbatch"])
        slots.setdefault(key, []).append(sample["sample_index"])
    return {"batch": batch, "slots": slots, "config": session.config}


@fault(
    "resumes that change DP (2 -> 1, same global batch) and the micro-batch size (2 -> 1), "
    "then `lookup --iteration K --dp-rank R` for iterations of every stretch",
    "each iteration answered with the layout in force then (DP, micro-batches), equal to "
    "the training's own sample log; DP rank 1 of the DP=2 stretch is answered",
    area="lookup",
)
def test_lookup_answers_each_iteration_with_its_own_layout(chain, capsys) -> None:
    recorded = _recorded(chain["samples"])
    skipped = {6, 7, PERSISTED_SKIP}
    for iteration in range(1, 13):
        answer = _answer(chain["ckpt"], iteration)
        layout = answer["config"].schedule
        expected_dp, expected_mbs = (2, 2) if iteration <= 4 else (1, 2 if iteration <= 8 else 1)
        assert (layout.data_parallel_size, layout.micro_batch_size) == (
            expected_dp,
            expected_mbs,
        ), iteration
        assert answer["batch"].skipped == (iteration in skipped), iteration
        if iteration in skipped:
            assert not any(key[0] == iteration for key in recorded), iteration
            continue
        assert answer["slots"] == {k: v for k, v in recorded.items() if k[0] == iteration}
    rank_1 = ["--iteration", "3", "--dp-rank", "1", "--sample-log", str(chain["samples"])]
    assert cli.main(["--from-checkpoint", str(chain["ckpt"]), *rank_1]) == 0
    assert "sample log: 2 micro-batches match" in capsys.readouterr().out
    # consumed samples 16 start iteration 3 (DP=2), 72 start iteration 10 (DP=1, mbs 1)
    for consumed, iteration, dp in ((16, 3, 2), (72, 10, 1)):
        argv = ["--from-checkpoint", str(chain["ckpt"]), "--consumed-samples", str(consumed)]
        assert cli.main([*argv, "--json"]) == 0
        answer = json.loads(capsys.readouterr().out)
        assert answer["batch"]["iteration"] == iteration
        assert {s["dp_rank"] for s in answer["samples"]} == set(range(dp))


@fault(
    "the checkpoints of the DP=2 stretch deleted, then the layout log too",
    "still answered from the layout log (samples-dir/layout.jsonl); without it: refused, "
    "naming the gap in the history",
    area="lookup",
)
def test_layout_history_survives_deleted_checkpoints(chain, tmp_path, capsys) -> None:
    ckpt = shutil.copytree(chain["ckpt"], tmp_path / "ckpt")
    samples = shutil.copytree(chain["samples"], tmp_path / "samples")
    shutil.rmtree(ckpt / "iter_0000004")
    args = ["--from-checkpoint", str(ckpt), "--iteration", "3", "--sample-log", str(samples)]
    assert cli.main([*args, "--dp-rank", "1"]) == 0, capsys.readouterr().err
    assert "sample log: 2 micro-batches match" in capsys.readouterr().out
    (samples / "layout.jsonl").unlink()
    assert cli.main(args) == 1
    err = capsys.readouterr().err
    assert "iteration 3 lies in a gap of the run's layout history" in err, err


@fault(
    "`lookup --sample-log DIR` with DIR missing, empty, or holding no record of the answer",
    "refused (exit 1): nothing was compared; skipped batches are reported as not compared",
    area="lookup",
)
def test_sample_log_check_refuses_when_it_compares_nothing(chain, tmp_path, capsys) -> None:
    base = ["--from-checkpoint", str(chain["ckpt"]), "--iteration", "5"]
    (tmp_path / "empty").mkdir()
    for directory in (tmp_path / "missing", tmp_path / "empty"):
        assert cli.main([*base, "--sample-log", str(directory)]) == 1
        assert "no sample log there" in capsys.readouterr().err
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "samples-dp1.jsonl").write_text("")
    assert cli.main([*base, "--sample-log", str(partial)]) == 1
    assert "nothing was compared" in capsys.readouterr().err
    assert cli.main([*base[:-1], "6", "--sample-log", str(chain["samples"])]) == 0
    assert "4 skipped micro-batch(es) NOT compared" in capsys.readouterr().out


@fault(
    "`--iterations-to-skip-file=PATH` (the = spelling), `--iterations-to-skip 7` and a list "
    "persisted in --load, at a resume; then a resume with no skip flag",
    "training skips the union (6, 7, 10), prints it at start-up and persists it; the next "
    "resume still skips 10",
    area="skip lists",
)
def test_skip_lists_from_every_source_are_unioned_printed_and_persisted(chain) -> None:
    log_b = (chain["root"] / "log-B.txt").read_text()
    assert "megatron-ext: skipping iterations 6-7, 10 (the union of" in log_b
    assert "--iterations-to-skip-file" in log_b and "persisted in" in log_b
    assert checkpoint_args(chain["ckpt"], 8).iterations_to_skip == [6, 7, PERSISTED_SKIP]
    assert (chain["ckpt"] / "megatron_ext_skipped_iterations.txt").read_text() == "6-7\n10\n"
    trained = {key[0] for key in _recorded(chain["samples"])}
    assert trained == set(range(1, 13)) - {6, 7, PERSISTED_SKIP}


@fault(
    "a foreign JSON line appended to signals.jsonl before a resume",
    "training starts and logs on (warning naming the line); readers skip it",
    area="signals",
)
def test_a_foreign_signals_line_does_not_stop_training(chain) -> None:
    log_b = (chain["root"] / "log-B.txt").read_text()
    # Named by its byte offset: start-up reads the log's end, not the whole log.
    assert re.search(r"not signals records\): byte \d+ \(unknown fields \['by', 'event'\]\)", log_b)
    from megatron_ext.common.records.signals import read_signals

    with pytest.warns(UserWarning, match="not signals records"):
        records = read_signals(chain["root"] / "run" / "signals" / "signals.jsonl")
    assert {r.attempt for r in records} == {1, 2, 3} and records[-1].iteration == 12


@fault(
    "a garbage tracker, a corrupt checkpoint (.metadata overwritten) and a partial one (its "
    "data files deleted) in `lookup --from-checkpoint`",
    "refused (exit 1) naming the file or checkpoint and what to do; no traceback",
    area="lookup",
)
def test_lookup_refuses_damaged_trackers_and_checkpoints(chain, tmp_path, capsys) -> None:
    ckpt = shutil.copytree(chain["ckpt"], tmp_path / "ckpt")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("twelve\n")
    assert cli.main(["--from-checkpoint", str(ckpt), "--iteration", "9"]) == 1
    err = capsys.readouterr().err
    assert "latest_checkpointed_iteration.txt holds 'twelve', not an iteration number" in err
    (ckpt / "latest_checkpointed_iteration.txt").write_text("12\n")
    (ckpt / "iter_0000012" / ".metadata").write_bytes(b"\x80garbage" * 8)
    for distcp in (ckpt / "iter_0000008").glob("*.distcp"):
        distcp.unlink()
    for step, name in ((12, "iter_0000012"), (8, "iter_0000008")):
        argv = ["--from-checkpoint", str(ckpt), "--ckpt-step", str(step), "--iteration", "9"]
        assert cli.main(argv) == 1
        err = capsys.readouterr().err
        assert f"checkpoint {ckpt / name} is unreadable" in err, err
        assert "Traceback" not in err


@fault(
    "the data and tokenizer moved after training, `lookup --text --data-root OLD=NEW`",
    "the tokenizer is found through the same remapping; without it, refused naming the "
    "tokenizer file and --data-root",
    area="lookup",
)
def test_lookup_text_remaps_the_moved_tokenizer(chain, capsys) -> None:
    data, moved = chain["data"], chain["data"].with_name("data-moved")
    base = ["--from-checkpoint", str(chain["ckpt"]), "--iteration", "9", "--text", "--json"]
    data.rename(moved)
    try:
        assert cli.main(base) == 1
        err = capsys.readouterr().err
        assert "--text: the run's tokenizer file" in err and "--data-root OLD=NEW" in err, err
        assert cli.main([*base, "--data-root", f"{data}={moved}"]) == 0
        answer = json.loads(capsys.readouterr().out)
        assert answer["samples"] and all(s["text"] for s in answer["samples"])
    finally:
        moved.rename(data)


@fault(
    "the run's --data-cache-path moved with the data, `lookup --data-root OLD=NEW` (no "
    "--cache-dir)",
    "the cache directory is found through the same remapping and the answer equals the one "
    "before the move; without it, refused naming the missing caches",
    area="lookup",
)
def test_lookup_data_root_remaps_the_cache_directory(chain, capsys) -> None:
    cache = Path(chain["ckpt"]).parent / "index-cache"
    moved = cache.with_name("index-cache-moved")
    base = ["--from-checkpoint", str(chain["ckpt"]), "--iteration", "9", "--json"]
    assert cli.main(base) == 0
    before = json.loads(capsys.readouterr().out)["samples"]
    cache.rename(moved)
    try:
        assert cli.main(base) == 1
        assert "Traceback" not in capsys.readouterr().err
        assert cli.main([*base, "--data-root", f"{cache}={moved}"]) == 0
        assert json.loads(capsys.readouterr().out)["samples"] == before
    finally:
        moved.rename(cache)
