"""Bridge's real ``pretrain`` at TP=2 (DP=2, four ranks) and PP=2 with a virtual pipeline
(two ranks) on CPU, each layout one launch with every feature (at TP 2 the supervised spike
drill of test_bridge_drill.py: rollback, resume) and one of Bridge alone
(tests/bridge/layout_script.py, the example at that layout): the first iteration's loss and
grad norm equal Bridge's own, Σ bucket² = grad-norm², the per-source mean is the lm loss, the
sample log is written once per DP rank (TP rank 0 of the last stage) and ``megatron-ext
lookup`` answers its records. At PP 2 x VPP 2 Bridge also evaluates (its own loop's evaluation
at the last iteration, and after training): per-dataset validation reduces to its lm loss.
The CP 2 row (Transformer Engine's layer spec, which CP needs) runs the same checks on two GPUs,
plain torchrun without the CPU runner: rung 11 of the GPU check (tools/gpu_smoke.py);
elsewhere it skips, saying why."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from megatron_ext.common.files import SIGNALS_FILE, VALIDATION_FILE
from megatron_ext.common.records.signals import read_signals
from megatron_ext.common.records.validation import read_validation
from megatron_ext.telemetry.validation import LOSS_CHECK_RTOL
from tests.bridge import test_bridge_drill as drill
from tests.support.drill import check_lookup_equals_sample_log, lookup_equals_records
from tests.support.harness import RUNNER, Run, run_logged

SCRIPT = Path(__file__).with_name("layout_script.py")
MEMBERS = ("tiny_text_document", "copy_text_document")
ITERS, GLOBAL_BATCH, MICRO_BATCH = 3, 8, 2
# An evaluation batch at the last iteration and after training, on a 10 % validation split.
EVAL = ["--eval-iters", "1", "--split", "90,10,0"]
LAYOUTS = {  # name: (ranks, DP size, the ranks reading the batch, the script's layout flags)
    "tp2-dp2": (4, 2, {0: 0, 2: 1}, ["--tp", "2"]),  # TP rank 0 of each DP rank
    "pp2-vpp2": (2, 1, {0: 0, 1: 0}, ["--pp", "2", "--vpp", "2", "--layers", "4", *EVAL]),
}
GPU_LAYOUTS = {"cp2-gpu": (2, 1, {}, ["--cp", "2", "--te", *EVAL])}  # CP ranks read it all
FIRST = re.compile(r"iteration\s+1/.*?\| lm loss: (\S+) \|.*?\| grad norm: (\S+) \|")
VALIDATION = re.compile(r" validation loss at iteration (\d+)[^|]*\| lm loss value: (\S+) \|")


def _launch(work: Path, ranks: int, flags: list[str], gpu: bool = False) -> Run:
    """torchrun of the CPU runner's ``--bridge-script`` on the layout script (``gpu``: of the
    layout script itself, one GPU a rank)."""
    work.mkdir(parents=True)
    env = dict(
        os.environ,
        MEGATRON_EXT_HARNESS_COUNTS=str(work / "counts"),
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        CUDA_DEVICE_MAX_CONNECTIONS="1",  # Megatron asserts it for TP and CP on GPUs
    )
    script = [str(SCRIPT)] if gpu else [str(RUNNER), "--bridge-script", str(SCRIPT)]
    cmd = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
        f"--nproc-per-node={ranks}",
        *(*script, *flags),
        *("--work", str(work), "--train-iters", str(ITERS), "--save-interval", str(ITERS)),
        *("--global-batch-size", str(GLOBAL_BATCH), "--micro-batch-size", str(MICRO_BATCH)),
    ]
    return run_logged(cmd, work, env, timeout=300)


@pytest.fixture(scope="module")
def blend(tmp_path_factory, data_args) -> list[str]:
    """A two-member blend of the tiny corpus and its copy, and the tokenizer."""
    document = data_args[data_args.index("--data-path") + 1]
    tokenizer = data_args[data_args.index("--tokenizer-model") + 1]
    copy = tmp_path_factory.mktemp("blend") / MEMBERS[1]
    for suffix in (".bin", ".idx"):
        shutil.copy(document + suffix, str(copy) + suffix)
    return ["--data-path", "0.4", document, "0.6", str(copy), "--tokenizer", tokenizer]


def _gpus_missing() -> str | None:
    """Why this machine cannot run the GPU rows (None: it can)."""
    te = importlib.util.find_spec("transformer_engine") is not None
    if torch.cuda.device_count() >= 2 and te:
        return None
    return (
        f"needs 2 GPUs and Transformer Engine (CP needs TEDotProductAttention): found "
        f"{torch.cuda.device_count()} GPU(s), TE {'importable' if te else 'not importable'}"
    )


@pytest.fixture(scope="module", params=sorted(LAYOUTS | GPU_LAYOUTS))
def layout(request, tmp_path_factory, blend) -> dict:
    """The overlay's launch (TP 2: the supervised spike drill of test_bridge_drill.py, two
    attempts) and Bridge alone's, at one layout."""
    gpu = request.param in GPU_LAYOUTS
    if gpu and (missing := _gpus_missing()):
        pytest.skip(f"GPU check rung 11: {missing}")
    ranks, dp, readers, flags = (GPU_LAYOUTS if gpu else LAYOUTS)[request.param]
    work = tmp_path_factory.mktemp(request.param)
    plain = _launch(work / "plain", ranks, [*flags, *blend, "--plain"], gpu)
    if request.param == "tp2-dp2":
        data, tokenizer = blend[1 : blend.index("--tokenizer")], blend[-1]
        (work / "ext").mkdir()
        ext = drill._supervised(work / "ext", data, tokenizer, SCRIPT, ranks, tuple(flags))
        return dict(ext=ext, plain=plain, dp=dp, readers=readers, trained=drill.TRAINED, gpu=gpu)
    features = [
        *("--z-loss-coeff", "1e-4", "--log-output-z", "--spike-detect"),
        *("--fused-output-loss", "--fused-output-loss-chunk-tokens", "48"),
        *("--embedding-weight-decay-mult", "0", "--weight-decay-override"),
        "*.linear_fc2.weight=0.5",
        *("--log-bucket-grad-norms", "--signals-update-ratio"),
        *("--signals-dir", str(work / "ext" / "signals")),
        *("--sample-log-dir", str(work / "ext" / "samples")),
    ]
    ext = _launch(work / "ext", ranks, [*flags, *blend, *features], gpu)
    trained = set(range(1, ITERS + 1))
    return dict(ext=ext, plain=plain, dp=dp, readers=readers, trained=trained, gpu=gpu)


@pytest.mark.timeout(1500)
def test_the_overlay_at_a_bridge_layout(layout: dict, tmp_path: Path, capsys) -> None:
    ext, plain = layout["ext"], layout["plain"]
    assert (ext.returncode, plain.returncode) == (0, 0), (ext.log[-3000:], plain.log[-3000:])
    # Bridge's first iteration is the same with the overlay: the lm loss to fp32 rounding
    # (z-loss reports the pure CE; the fused output loss sums in chunks); the grad norm to
    # 2e-3, as z-loss adds 2c·log Z·softmax to the gradient and Bridge alone's fused CE
    # (the recipes' setting) rounds its gradient to bf16, where the fused output loss does not.
    first = [float(v) for v in FIRST.search(ext.log).groups()]
    expected = [float(v) for v in FIRST.search(plain.log).groups()]
    for value, want, rtol in zip(first, expected, (1e-5, 2e-3)):
        assert math.isclose(value, want, rel_tol=rtol), (first, expected, plain.log[-3000:])
    assert "mlp.linear_fc2.weight wd_mult=0.5 <- --weight-decay-override" in ext.log
    assert "megatron-ext WARNING" not in ext.log
    _check_signals(ext, layout["trained"])
    # The sample log: once per DP rank, every micro-batch once; the readers: TP rank 0 of
    # the first and last stage, as under Megatron's loop (the last attempt's).
    records = ext.records()
    per_rank = GLOBAL_BATCH // MICRO_BATCH // layout["dp"]
    assert sorted(records) == list(range(layout["dp"]))
    trained = {r.iteration for rank in records.values() for r in rank}
    assert trained == layout["trained"]
    assert all(len(r) == len(trained) * per_rank for r in records.values())
    if not layout["gpu"]:  # the CPU runner records them
        reads = {rank: sorted(e["reads"]) for rank, e in ext.exits().items() if e["reads"]}
        assert reads == {r: [str(dp)] for r, dp in layout["readers"].items()}
    if layout["trained"] is drill.TRAINED:  # rolled back, resumed, lookup at both attempts
        assert "onset 32, culprit DP rank 1" in ext.log  # the drill's batch on both TP ranks
        assert "Roll back to checkpoint 25, skip iterations 26-37" in ext.log
        check_lookup_equals_sample_log(ext, ext.workdir, tmp_path, capsys)
    else:
        lookup_equals_records(ext, records, 2, tmp_path)
        _check_validation(ext)


def _check_validation(run: Run) -> None:
    """Per-dataset validation under Bridge's evaluation (in its loop at the last iteration
    and after training, one evaluation iteration each): both members, every evaluated token
    once, Σ member loss·tokens / Σ tokens = Bridge's printed lm loss; console, TensorBoard."""
    records = read_validation(run.workdir / "signals" / VALIDATION_FILE)
    printed = [(int(i), float(v)) for i, v in VALIDATION.findall(run.log)]
    assert [r.iteration for r in records] == [i for i, _ in printed] == [ITERS, ITERS]
    for record, (_, bridge) in zip(records, printed):
        assert record.lm_loss == pytest.approx(bridge, rel=1e-6)  # printed to 7 digits
        assert set(record.tokens_by_dataset) == set(record.lm_loss_by_dataset) == set(MEMBERS)
        tokens = sum(record.tokens_by_dataset.values())
        assert tokens == GLOBAL_BATCH * 64, record  # one evaluation batch
        combined = sum(
            record.lm_loss_by_dataset[m] * n for m, n in record.tokens_by_dataset.items()
        )
        assert combined / tokens == pytest.approx(record.lm_loss, rel=LOSS_CHECK_RTOL)
    assert f" validation lm loss by dataset at iteration {ITERS} | {MEMBERS[0]}: " in run.log
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = EventAccumulator(str(run.workdir / "tensorboard")).Reload().Tags()["scalars"]
    assert {f"lm-loss-validation-by-dataset/{m}" for m in MEMBERS} <= set(tags), tags


def _check_signals(run: Run, trained: set[int]) -> None:
    """Σ bucket² = grad-norm²; the per-source mean is the lm loss, each token counted once."""
    signals = read_signals(run.workdir / "signals" / SIGNALS_FILE)
    assert {r.iteration for r in signals} >= trained
    tokens = GLOBAL_BATCH * 64  # the example's sequence length
    for record in (r for r in signals if r.iteration in trained):
        squares = sum(v * v for v in record.bucket_grad_norms.values())
        assert math.isclose(squares, record.grad_norm**2, rel_tol=1e-5), record
        assert sum(record.tokens_by_dataset.values()) == tokens, record
        mean = sum(
            record.lm_loss_by_dataset[m] * n for m, n in record.tokens_by_dataset.items() if n
        )
        assert math.isclose(mean / tokens, record.lm_loss, rel_tol=1e-5), record
        assert None not in (record.z_loss, record.log_z, record.update_ratio), record
