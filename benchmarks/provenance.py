"""What the provenance sidecar costs ``megatron-ext preprocess``: time and size without it,
with it (file, line, byte offset per document) and with record ids (``--provenance-key id``),
side by side in one run; and what ``megatron-ext provenance rebuild`` takes to write the same
sidecar for the same data afterwards (scan, map, re-tokenise ``--verify`` documents).

The corpus is the synthetic English-like one (``write_tiny_corpus``, ids ``tiny-NNNNN``), the
tokenizer a byte-level BPE trained on it once. Every arm runs in this process (Megatron and
the tokenizer are imported once, before any timing), the arms interleaved, ``--repeat``
times each; the table shows the median wall time and the median CPU time of this process
(one worker: all the work is here; the CPU time is the steadier figure on a shared machine).

    .venv/bin/python benchmarks/provenance.py --docs 20000 --repeat 3
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ARMS = {
    "no sidecar (--no-provenance)": ["--no-provenance"],
    "sidecar: file, line, byte": [],
    "sidecar + ids (--provenance-key id)": ["--provenance-key", "id"],
}


def _quiet(function: Callable[..., int], *args: Any) -> int:
    """Call ``function`` with its prints captured (the table is the output)."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return function(*args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=20000, help="documents in the corpus")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each arm")
    parser.add_argument("--workers", type=int, default=1, help="preprocess --workers")
    args = parser.parse_args()
    import megatron.core.datasets.indexed_dataset  # noqa: F401  imported before any timing

    from megatron_ext.data import preprocess, provenance
    from megatron_ext.data.corpus import write_tiny_corpus
    from megatron_ext.data.tokenizer import train_bpe_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        corpus = write_tiny_corpus(root / "corpus.jsonl", num_docs=args.docs, ids=True)
        texts = (line for line in corpus.read_text(encoding="utf-8").splitlines())
        tokenizer = train_bpe_tokenizer(texts, root / "tok", vocab_size=2048)
        seconds: dict[str, list[float]] = {arm: [] for arm in ARMS}
        cpu: dict[str, list[float]] = {arm: [] for arm in ARMS}
        sizes: dict[str, tuple[int, int, int]] = {}
        for _ in range(args.repeat):
            for arm, flags in ARMS.items():
                prefix = root / f"arm{list(ARMS).index(arm)}"
                command = ["--input", str(corpus), "--output-prefix", str(prefix)]
                command += ["--tokenizer-dir", str(tokenizer), "--workers", str(args.workers)]
                start, start_cpu = time.perf_counter(), time.process_time()
                assert _quiet(preprocess.main, [*command, *flags]) == 0
                seconds[arm].append(time.perf_counter() - start)
                cpu[arm].append(time.process_time() - start_cpu)
                stem = f"{prefix}_text_document"
                sidecar = Path(stem + ".prov")
                sizes[arm] = (
                    Path(stem + ".bin").stat().st_size,
                    Path(stem + ".idx").stat().st_size,
                    sidecar.stat().st_size if sidecar.exists() else 0,
                )
        base = statistics.median(cpu[next(iter(ARMS))])
        mib = corpus.stat().st_size / 2**20
        print(f"corpus: {args.docs} documents, {mib:.1f} MiB JSONL; median of {args.repeat}")
        print("| arm | wall s | CPU s | CPU vs none | .bin | .idx | .prov | .prov bytes/doc |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for arm in ARMS:
            median = statistics.median(cpu[arm])
            bin_size, idx_size, prov = sizes[arm]
            print(
                f"| {arm} | {statistics.median(seconds[arm]):.2f} | {median:.2f} | "
                f"{100 * (median / base - 1):+.1f} % | {bin_size / 2**20:.2f} MiB | "
                f"{idx_size / 2**10:.0f} KiB | {prov / 2**10:.0f} KiB | {prov / args.docs:.1f} |"
            )
        stem = f"{root / 'arm0'}_text_document"  # built without a sidecar: rebuild one
        rebuild = ["rebuild", "--dataset", stem, "--input", str(corpus)]
        rebuild += ["--provenance-key", "id", "--tokenizer-dir", str(tokenizer)]
        start = time.perf_counter()
        assert _quiet(provenance.main, rebuild) == 0
        took = time.perf_counter() - start
        ids = Path(f"{root / 'arm2'}_text_document.prov").read_bytes()
        same = Path(stem + ".prov").read_bytes() == ids
        print(
            f"provenance rebuild of the no-sidecar dataset (with ids, --verify 256): {took:.2f} s;"
            f" identical to preprocess's sidecar: {same}"
        )


if __name__ == "__main__":
    main()
