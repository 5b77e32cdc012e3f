"""Sample-id lookup: time to answer a 1,024-sample global batch, and inverse-scan throughput,
on two indexes whose sizes differ 100x, side by side in one run.

Each index is a 3-prefix weighted blend written with megatron-core's ``IndexedDatasetBuilder``
and cached by ``BlendedMegatronDatasetBuilder`` (as training does), sized so the train split
reads each member's documents 80-200 times (epochs):

- ``open``: find the run's caches by their descriptions, verify md5s, counts and sizes against
  the .bin/.idx, memory-map everything (what every lookup pays first);
- ``lookup``: one global batch of 1,024 samples at a random iteration, resolved to documents,
  spans and model-input tokens, with the per-sample stream check;
- ``inverse``: every global sample that read one document (one pass over ``document_index``,
  ``shuffle_index`` and the blend's indexes); throughput = global samples in the train
  dataset / scan time.

Times are wall clock, median and best of ``--repeat`` rounds, each round on freshly opened
caches (page cache warm, mappings new, as in a fresh ``megatron-ext lookup`` process).
Python and Megatron import time (seconds, paid once per ``megatron-ext lookup`` process) is not
in these figures.

    python benchmarks/lookup.py                       # the figures in BENCHMARKS.md
    python benchmarks/lookup.py --workdir /tmp/lk-bench   # keep the data between runs
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

WEIGHTS = (0.5, 0.3, 0.2)
SEQ_LENGTH = 128
GLOBAL_BATCH = 1024
SEED = 1234
SIZES = {"small": 1_000, "large": 100_000}  # documents per prefix; samples scale with them
SAMPLES_PER_DOCUMENT = 67  # train-split samples requested per document of the blend


@dataclass
class Size:
    """One index under test and its measurements (seconds per round)."""

    name: str
    documents: int
    spec: Any = None
    target: int = 0
    samples: int = 0
    cache_bytes: int = 0
    times: dict[str, list[float]] = field(default_factory=dict)

    def record(self, what: str, clock: str, seconds: float) -> None:
        self.times.setdefault(f"{what} {clock}", []).append(seconds)


def _write(prefix: Path, documents: int, rng: np.random.Generator) -> str:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    lengths = rng.integers(16, 113, documents)
    tokens = rng.integers(1, 50_000, int(lengths.sum())).astype(np.uint16)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    start = 0
    for length in lengths.tolist():
        builder.add_document(tokens[start : start + length], [length])
        start += length
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def _prepare(root: Path, documents: int):
    """Write the data and build its caches once (reused on later runs)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.tokenizers import MegatronTokenizer

    from megatron_ext.lookup.data import DataSpec

    rng = np.random.default_rng(documents)
    root.mkdir(parents=True, exist_ok=True)
    prefixes = [str(root / f"part{i}") for i in range(len(WEIGHTS))]
    if not all(Path(p + ".idx").exists() for p in prefixes):
        prefixes = [_write(root / f"part{i}", documents, rng) for i in range(len(WEIGHTS))]
    target = documents * len(WEIGHTS) * SAMPLES_PER_DOCUMENT // GLOBAL_BATCH * GLOBAL_BATCH
    config = GPTDatasetConfig(
        random_seed=SEED,
        sequence_length=SEQ_LENGTH,
        blend=(prefixes, list(WEIGHTS)),
        split="100,0,0",
        path_to_cache=str(root / "cache"),
        tokenizer=MegatronTokenizer.from_pretrained(
            metadata_path={"library": "null-text"}, vocab_size=50_304
        ),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )
    BlendedMegatronDatasetBuilder(GPTDataset, [target, 0, 0], lambda: True, config).build()
    return DataSpec(
        tuple(prefixes),
        WEIGHTS,
        False,
        "100,0,0",
        SEED,
        SEQ_LENGTH,
        target,
        0.005,
        str(root / "cache"),
    ), target


def _round(size: Size, rng: np.random.Generator) -> None:
    """Open, one batch lookup and one inverse scan on ``size``, timed on both clocks."""
    from megatron_ext.lookup.data import find_document, open_train_index
    from megatron_ext.lookup.schedule import Schedule

    def timed(what: str, work: Callable[[], Any]) -> Any:
        wall, cpu = time.perf_counter(), time.process_time()
        result = work()
        size.record(what, "wall", time.perf_counter() - wall)
        size.record(what, "cpu", time.process_time() - cpu)
        return result

    gc.collect()  # the previous round's caches are unmapped outside the timed regions
    index = timed("open", lambda: open_train_index(size.spec))
    schedule = Schedule(
        micro_batch_size=4,
        data_parallel_size=32,
        global_batch_size=GLOBAL_BATCH,
        train_iters=size.target // GLOBAL_BATCH,
    )
    batch = schedule.batch(int(rng.integers(1, size.target // GLOBAL_BATCH + 1)))
    ids = [
        i
        for m in range(batch.num_microbatches)
        for r in range(32)
        for i in schedule.positions(batch, m, r).tolist()
    ]
    assert len(timed("lookup", lambda: index.resolve(ids))) == GLOBAL_BATCH
    member, document = int(rng.integers(0, 3)), int(rng.integers(0, size.documents))
    timed("inverse", lambda: find_document(index, member, document))
    size.samples = len(index)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="keep data and caches here between runs (default: a temp dir)",
    )
    parser.add_argument("--repeat", type=int, default=9)
    args = parser.parse_args()
    sizes = [Size(name, documents) for name, documents in SIZES.items()]
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="lookup-bench-") as temporary:
        root = args.workdir or Path(temporary)
        for size in sizes:
            size.spec, size.target = _prepare(root / size.name, size.documents)
            size.cache_bytes = sum(p.stat().st_size for p in (root / size.name).glob("cache/*.npy"))
        for _ in range(args.repeat):  # interleaved, so both sizes see the same machine load
            for size in sizes:
                _round(size, rng)
    small, large = sizes

    def row(name: str, a: float, b: float, fmt: str) -> str:
        return f"{name:40}{fmt.format(a):>16}{fmt.format(b):>16}{b / a:>12.2f}x"

    print(f"{'':40}{'small':>16}{'large':>16}{'large/small':>13}")
    print(row("global samples in the train blend", small.samples, large.samples, "{:,}"))
    print(row("documents (3 prefixes)", 3 * small.documents, 3 * large.documents, "{:,}"))
    print(row("cache .npy bytes", small.cache_bytes, large.cache_bytes, "{:,}"))
    labels = {
        "open": "open + verify caches (s)",
        "lookup": f"lookup {GLOBAL_BATCH:,}-sample batch (s)",
        "inverse": "inverse scan, one document (s)",
    }
    for clock in ("wall", "cpu"):
        for reduce, how in ((statistics.median, "median"), (min, "best")):
            print(f"-- {clock} clock, {how} of {args.repeat}")
            for what, label in labels.items():
                key = f"{what} {clock}"
                print(row(label, reduce(small.times[key]), reduce(large.times[key]), "{:.4f}"))
            scans = [size.samples / reduce(size.times[f"inverse {clock}"]) / 1e6 for size in sizes]
            print(row("inverse throughput (M samples/s)", *scans, "{:.1f}"))


if __name__ == "__main__":
    main()
