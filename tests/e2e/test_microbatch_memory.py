"""Memory stays flat across the micro-batches of one iteration, every overlay feature on.

Issue #25: a 1024-sample, seq-4096 first iteration (512 micro-batches on the CPU harness)
grew by ~0.4 GB/min until it was killed at 14 GiB. The cause was the harness, not the
overlay: glibc raises its mmap threshold as large blocks are freed, after which each
micro-batch's activations stayed in the heap (``shims.fix_mmap_threshold``). Plain Megatron
grew the same way; what remains is megatron-core's own replay buffer (``RerunDataIterator``
keeps every micro-batch of the iteration in ``--rerun-mode validate_results``, the default:
here ~0.3 MiB per micro-batch, the attention mask built in the data loader included).

One launch, 72 micro-batches of one iteration; the harness samples this rank's resident set
at every micro-batch read (``MEGATRON_EXT_HARNESS_RSS``). The bound is on growth between
micro-batches 8 and 64, so start-up and the first micro-batches' one-time allocations do not
count. Before the fix the same run grew ~8 MiB per micro-batch (~450 MiB over that span).
"""

from __future__ import annotations

from tests.support.harness import TELEMETRY, launch

MICRO_BATCHES = 72
SEQ_LENGTH = "512"
# Megatron's replay buffer (~0.3 MiB per micro-batch at seq 512) plus allocator noise; a
# micro-batch's activations (~8 MiB) kept per micro-batch, by the overlay or the harness,
# exceeds it several times over.
GROWTH_BOUND = 64 << 20


def test_resident_memory_is_flat_across_microbatches(tmp_path, data_args, monkeypatch) -> None:
    monkeypatch.setenv("MEGATRON_EXT_HARNESS_RSS", "1")
    every_feature = [
        "--z-loss-coeff",
        "1e-4",
        "--embedding-weight-decay-mult",
        "0",
        "--output-layer-weight-decay-mult",
        "0",
        *TELEMETRY,
        "--signals-dir",
        str(tmp_path / "signals"),
        "--spike-detect",
        "--drill-corrupt-batch",
        "1:0",
    ]
    schedule = [
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        str(MICRO_BATCHES),
        "--train-iters",
        "1",
        "--lr-warmup-iters",
        "0",
        "--seq-length",
        SEQ_LENGTH,
        "--max-position-embeddings",
        SEQ_LENGTH,
    ]
    run = launch(tmp_path, [*data_args, *every_feature, *schedule])
    assert run.returncode == 0, run.log[-4000:]
    rss = [resident for iteration, resident in run.exits()[0]["rss"] if iteration == 1]
    assert len(rss) == MICRO_BATCHES, "the harness must sample every micro-batch read"
    records = run.records()[0]
    assert sum(len(r.sample_ids) for r in records) == MICRO_BATCHES, "the sample log ran"
    growth = rss[64] - rss[8]
    assert growth < GROWTH_BOUND, (
        f"resident memory grew {growth / 2**20:.0f} MiB from micro-batch 8 to 64 "
        f"({growth / 56 / 2**10:.0f} KiB per micro-batch; bound {GROWTH_BOUND >> 20} MiB): "
        "something keeps per-micro-batch tensors until the step ends"
    )
