"""A long signals log from a shorter one, for timing ``megatron-ext plot`` at 5 M iterations.

Why: writing 5 M records through ``SignalRecord`` takes a quarter of an hour on 2 cores; this
repeats an existing log (``benchmarks/scale.py``'s 1 M-iteration one) with its iterations
shifted, in a minute. Every line keeps the writer's exact shape: only the leading
``"iteration":N`` changes, and ``--buckets K`` keeps the first K bucket norms (fewer bytes a
line, closer to a smaller model's log). The last 1000 lines (the benchmark's spike) go last.

    python benchmarks/repeat_signals.py SRC/signals.jsonl DST/signals.jsonl --copies 5 --buckets 4
"""

from __future__ import annotations

import argparse
import re

KEY = re.compile(rb'^\{"iteration":(\d+),')
TAIL = 1000


def _bucket_filter(keep: int) -> re.Pattern[bytes]:
    """Bucket entries ``"bK:..."`` with K >= keep (any later entry of the object)."""
    return re.compile(rb',"b(?:[1-9]\d+|[' + str(keep).encode() + rb'-9]):[^"]*":[^,}]*')


def _shifted(line: bytes, shift: int) -> bytes:
    return KEY.sub(lambda m: b'{"iteration":%d,' % (int(m[1]) + shift), line, count=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source")
    parser.add_argument("target")
    parser.add_argument("--copies", type=int, default=5)
    parser.add_argument("--buckets", type=int, help="keep this many bucket norms (at most 9)")
    options = parser.parse_args()
    with open(options.source, "rb") as handle:
        lines = handle.read().split(b"\n")[:-1]
    if options.buckets is not None:
        drop = _bucket_filter(options.buckets)
        lines = [drop.sub(b"", line) for line in lines]
    body, tail = lines[:-TAIL], lines[-TAIL:]
    parts = [(body, copy * len(body)) for copy in range(options.copies)]
    parts.append((tail, options.copies * len(body) - (len(lines) - TAIL)))
    with open(options.target, "wb") as out:
        for part, shift in parts:
            out.write(b"".join(_shifted(line, shift) + b"\n" for line in part))
    print(f"wrote {options.copies * len(body) + len(tail)} lines to {options.target}")


if __name__ == "__main__":
    main()
