"""``--spike-skip-update`` inside Megatron's real step, with the precursor signals on
(``--log-output-z``, ``--signals-attention-logit``): one bad batch is withheld (no parameter,
schedule or baseline change; the detector's incident recovers, no rollback), a streak of bad
batches becomes an incident that ends in a rollback, as without the skip."""

from __future__ import annotations

import json
import math
from pathlib import Path

from megatron_ext.common import exit_codes
from megatron_ext.common.files import SIGNALS_FILE, SPIKE_LEDGER_FILE
from megatron_ext.common.records.signals import SignalRecord, latest_per_iteration, read_signals
from tests.support.harness import TINY_TRAINING, Run, launch

ITERS = 50
BAD = 40  # the drill's first bad iteration (garbage tokens on the only DP rank)
# Gate and detector armed by iteration 20; the detector rolls back 4 iterations after a flag.
SKIP = [
    "--spike-detect",
    "--spike-window",
    "10",
    "--spike-warmup",
    "20",
    "--spike-patience",
    "4",
    "--spike-skip-update",
    "--log-output-z",
    "--signals-attention-logit",
]


def _training() -> list[str]:
    flags = list(TINY_TRAINING)
    # The demo's learning rate: by BAD the model predicts its corpus, so garbage tokens give
    # the grad norm jump a bad batch gives a trained model.
    for flag, value in (("--train-iters", ITERS), ("--lr", "3e-3"), ("--min-lr", "3e-4")):
        flags[flags.index(flag) + 1] = str(value)
    return flags


def _run(work: Path, data_args: list[str], bad: str) -> tuple[Run, dict[int, SignalRecord]]:
    run = launch(
        work,
        [
            *data_args,
            *SKIP,
            "--signals-dir",
            str(work / "signals"),
            "--drill-corrupt-batch",
            f"{bad}:0",
        ],
        training=_training(),
    )
    records = latest_per_iteration(read_signals(work / "signals" / SIGNALS_FILE))
    return run, {r.iteration: r for r in records}


def _ledger(work: Path) -> list[dict]:
    lines = (work / "signals" / SPIKE_LEDGER_FILE).read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_one_bad_batch_is_withheld_and_nothing_moves(tmp_path: Path, data_args) -> None:
    run, by_it = _run(tmp_path, data_args, str(BAD))
    assert run.returncode == 0, run.log[-3000:]
    withheld = [i for i, r in by_it.items() if r.update_skipped]
    assert withheld == [BAD]
    bad, before, after = by_it[BAD], by_it[BAD - 1], by_it[BAD + 1]
    assert bad.skipped_iter and bad.grad_norm > 5 * before.grad_norm
    # Megatron's overflow path: parameters and the schedule stand still for that step (the
    # signals' lr is the rate a step used: the next step runs at the withheld one's).
    assert bad.params_norm == before.params_norm
    assert after.lr == bad.lr != before.lr
    assert f"update withheld at iteration {BAD}" in run.log
    assert "number of skipped iterations:   1" in run.log
    kinds = [e["kind"] for e in _ledger(tmp_path) if e.get("kind") != "config"]
    assert "rollback" not in kinds and "recovered" in kinds
    # The precursor signals are there on every step: log Z and the max attention logit.
    assert all(math.isfinite(r.log_z) and r.max_attention_logit > 0 for r in by_it.values())


def test_a_streak_of_withheld_updates_ends_in_a_rollback(tmp_path: Path, data_args) -> None:
    run, by_it = _run(tmp_path, data_args, f"{BAD}-{BAD + 9}")
    assert run.exits()[0].get("exit_code") == exit_codes.SPIKE_ROLLBACK, run.log[-3000:]
    withheld = sorted(i for i, r in by_it.items() if r.update_skipped)
    assert withheld[0] == BAD and len(withheld) >= 4
    # Every withheld step left the parameters as the last applied update did.
    norms = {by_it[i].params_norm for i in withheld}
    assert norms == {by_it[BAD - 1].params_norm}
    rollback = [e for e in _ledger(tmp_path) if e.get("kind") == "rollback"]
    assert len(rollback) == 1 and rollback[0]["onset"] == BAD
    assert "rollback requested" in run.log
