"""Skip lists that reach the end of training, and absurd ranges."""

from __future__ import annotations

import tracemalloc

import pytest

from megatron_ext.common.records.skip_ranges import MAX_SKIPPED, resolve_argv
from tests.support.faults import fault
from tests.support.harness import checkpoint_args, launch


@pytest.mark.e2e
@fault(
    "`--iterations-to-skip 15-2000000` with `--train-iters 20 --save-interval 10`: the skip "
    "list covers the last iteration (Megatron's loop `continue`s past the interval save and "
    "its final save skips interval multiples: rc 0 and no checkpoint at the end) and runs "
    "far past the end (1.4 GB RSS, a 12 MB checkpoint)",
    "the range is clipped to 15-20 with a message naming it; training skips 15-20 and still "
    "saves the final checkpoint at 20 (tracker 20), whose args hold 6 iterations",
    area="skip lists",
)
def test_a_skip_list_covering_the_end_still_leaves_the_final_checkpoint(
    data_args, tmp_path
) -> None:
    ckpt = tmp_path / "ckpt"
    flags = ["--save", str(ckpt), "--load", str(ckpt), "--save-interval", "10"]
    run = launch(tmp_path, [*data_args, *flags, "--iterations-to-skip", "15-2000000"])
    assert run.returncode == 0, run.log[-3000:]
    assert "--iterations-to-skip 15-2000000 clipped to --train-iters 20" in run.log
    assert "iteration 20, the last, was skipped; saving the final checkpoint" in run.log
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "20"
    assert list(checkpoint_args(ckpt, 20).iterations_to_skip) == list(range(15, 21))
    trained = {r.iteration for records in run.records().values() for r in records}
    assert trained == set(range(1, 15))  # 15-20 skipped, not trained


@fault(
    "`--iterations-to-skip 50-2000000` (or a skip file) with no --train-iters to clip it to "
    "(a run trained by --train-samples)",
    f"refused at start-up, naming the count and the cap ({MAX_SKIPPED}), before anything is "
    "expanded: under 1 MB allocated",
    area="skip lists",
)
def test_an_absurd_skip_range_is_refused_without_expanding_it(tmp_path) -> None:
    tracemalloc.start()
    with pytest.raises(
        ValueError, match=f"skipping 1999951 iterations is more than the {MAX_SKIPPED}"
    ):
        resolve_argv(["--iterations-to-skip", "50-2000000"])
    skip_file = tmp_path / "skips.txt"
    skip_file.write_text("10-20\n30-3000000\n")
    with pytest.raises(ValueError, match=r"skips\.txt: skipping"):
        resolve_argv(["--iterations-to-skip-file", str(skip_file)])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1_000_000  # bytes: the ranges were never expanded (2M ints: ~100 MB)
    argv, sources = resolve_argv(["--train-iters", "100", "--iterations-to-skip", "50-2000000"])
    assert argv[:2] == ["--train-iters", "100"] and sources.union() == list(range(50, 101))
    assert "clipped to --train-iters 100" in sources.describe()
