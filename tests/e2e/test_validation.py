"""Per-dataset validation loss in the real loop, on the demo's kind of blend (``--data-path``
with weights and ``--split``) of two real, different sources: the demo's prose and Python's
standard library source code.

Launches:

- **blend** (DP=2, so the members' sums are reduced over the data-parallel group): prose
  70 %, code 30 %, 10 iterations, evaluated at 10 in the loop and once more after training
  (2 evaluation iterations of 8 samples each), checkpoint 10;
- **code alone**: the checkpoint evaluated by Megatron alone (``--skip-train``, the
  evaluation-only run, with the overlay's flags on) on the code source alone, with an
  evaluation batch of exactly as many samples as the blend's first evaluation drew from it:
  the same samples (one epoch of the same split, the same shuffle), so Megatron's own number
  is the code member's loss, computed directly.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_ext.common.files import VALIDATION_FILE
from megatron_ext.common.records.validation import ValidationRecord, read_validation
from megatron_ext.telemetry.validation import LOSS_CHECK_RTOL
from tests.support.harness import Run, launch
from tests.support.sources import CODE, PROSE, blend_args, prepare_sources

SEQ, EVAL_ITERS, EVAL_BATCH = 64, 2, 8
EVAL_TOKENS = EVAL_ITERS * EVAL_BATCH * SEQ  # no end-of-document masking: every token counts
MEGATRON_LINE = re.compile(r" validation loss at iteration (\d+)[^|]*\| lm loss value: (\S+) \|")


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> tuple[dict[str, str], list[str], Path]:
    root = tmp_path_factory.mktemp("sources")
    prefixes, tokenizer = prepare_sources(root)
    return prefixes, tokenizer, root


def _ok(run: Run) -> Run:
    assert run.returncode == 0, run.log[-4000:]
    return run


def _records(run: Run) -> list[ValidationRecord]:
    return read_validation(run.workdir / "signals" / VALIDATION_FILE)


@pytest.fixture(scope="module")
def blend(sources, tmp_path_factory) -> Run:
    prefixes, tokenizer, root = sources
    work = tmp_path_factory.mktemp("blend")
    args = [
        *blend_args(prefixes, {PROSE: 0.7, CODE: 0.3}, root / "index-cache"),
        *("--split", "90,10,0", *tokenizer),
        *("--train-iters", "10", "--eval-interval", "10", "--eval-iters", str(EVAL_ITERS)),
        *("--signals-dir", str(work / "signals")),
        *("--save", str(work / "ckpt"), "--save-interval", "10"),
    ]
    return _ok(launch(work, args, nproc=2, sample_log=False))


@pytest.fixture(scope="module")
def code_alone(sources, blend, tmp_path_factory) -> Run:
    prefixes, tokenizer, root = sources
    work = tmp_path_factory.mktemp("code-alone")
    samples = _records(blend)[0].tokens_by_dataset[CODE] // SEQ
    args = [
        *("--data-path", prefixes[CODE], "--split", "90,10,0", *tokenizer),
        *("--data-cache-path", str(root / "index-cache")),
        *("--load", str(blend.workdir / "ckpt"), "--skip-train", "--train-iters", "10"),
        *("--eval-interval", "1", "--eval-iters", "1"),
        *("--eval-global-batch-size", str(samples), "--eval-micro-batch-size", "1"),
        *("--signals-dir", str(work / "signals")),
    ]
    return _ok(launch(work, args, nproc=1, sample_log=False))


def test_each_evaluation_has_both_members_reducing_to_megatrons_lm_loss(blend: Run) -> None:
    records = _records(blend)
    printed = [(int(i), float(v)) for i, v in MEGATRON_LINE.findall(blend.log)]
    # The loop's evaluation at 10 and the one after training, each as Megatron printed it.
    assert [r.iteration for r in records] == [i for i, _ in printed] == [10, 10]
    for record, (_, megatron) in zip(records, printed):
        assert (record.split, record.set_name) == ("valid", None)
        assert record.lm_loss == pytest.approx(megatron, rel=1e-6)  # printed to 7 digits
        assert set(record.lm_loss_by_dataset) == set(record.tokens_by_dataset) == {PROSE, CODE}
        assert sum(record.tokens_by_dataset.values()) == EVAL_TOKENS
        assert 0.15 < record.tokens_by_dataset[CODE] / EVAL_TOKENS < 0.45  # the blend's 30 %
        combined = sum(
            record.lm_loss_by_dataset[n] * t for n, t in record.tokens_by_dataset.items()
        )
        assert combined / EVAL_TOKENS == pytest.approx(record.lm_loss, rel=LOSS_CHECK_RTOL)
    assert f" validation lm loss by dataset at iteration 10 | {PROSE}: " in blend.log
    assert f" at iteration 10 on validation set | {PROSE}: " in blend.log
    assert "megatron-ext WARNING" not in blend.log


def test_a_members_loss_is_megatrons_own_on_that_member_alone(blend, code_alone) -> None:
    alone = _records(code_alone)
    assert [(r.iteration, set(r.lm_loss_by_dataset)) for r in alone] == [(10, {CODE})]
    member, direct = _records(blend)[0], alone[0]
    assert direct.tokens_by_dataset == {CODE: member.tokens_by_dataset[CODE]}
    assert member.lm_loss_by_dataset[CODE] == pytest.approx(direct.lm_loss, rel=1e-5)
    # The members really differ: the check above could not pass with the aggregate.
    assert abs(_records(blend)[0].lm_loss - alone[0].lm_loss) > 1e-3
