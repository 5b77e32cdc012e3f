"""Checks on a run's datasets before anything is built: complete pairs, and splits that can
hold a sample.

megatron-core 0.19.2 builds a ``GPTDataset`` for every split with a non-zero weight, even one
asked for zero samples, and ``GPTDataset._get_num_epochs`` adds epochs until the split's
tokens cover the request: with 0 tokens (a split that got 0 documents, e.g. the test split
of ``--split 949,50,1`` on a 400-document corpus) it loops forever on rank 0 while every
other rank waits in a barrier: no iteration, no message. Each split that will be built must
hold at least one sample (``seq_length + 1`` tokens); :func:`split_sizes` computes each
split's documents and tokens the way the builder splits them, from two reads of the ``.idx``
(the document count in its header, the byte pointers at the split edges). No Megatron import.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_ext.common.records.pair import HEADER, ITEM_SIZES

SPLIT_NAMES = ("train", "validation", "test")


@dataclass(frozen=True)
class SplitSize:
    name: str
    documents: int
    tokens: int
    of_documents: int  # in the whole prefix


def split_sizes(prefix: str, matrix: list[tuple[float, float] | None]) -> list[SplitSize | None]:
    """Documents and tokens of each split of ``prefix`` (None: the split is not built), with
    the builder's rounding: ``int(round(edge * sequences))``."""
    with open(f"{prefix}.idx", "rb") as handle:
        _, _, code, sequences, _ = HEADER.unpack(handle.read(HEADER.size))
    itemsize = ITEM_SIZES.get(code, 2)
    lengths = pointers = np.zeros(0, dtype=np.int64)
    if sequences:
        lengths = np.memmap(
            f"{prefix}.idx", dtype=np.int32, mode="r", offset=HEADER.size, shape=(sequences,)
        )
        pointers = np.memmap(
            f"{prefix}.idx",
            dtype=np.int64,
            mode="r",
            offset=HEADER.size + 4 * sequences,
            shape=(sequences,),
        )

    def byte(position: int) -> int:
        if position < sequences:
            return int(pointers[position])
        return int(pointers[-1]) + int(lengths[-1]) * itemsize if sequences else 0

    sizes: list[SplitSize | None] = []
    for name, edges in zip(SPLIT_NAMES, matrix):
        if edges is None:
            sizes.append(None)
            continue
        begin, end = (round(edge * float(sequences)) for edge in edges)  # as the builder
        tokens = (byte(end) - byte(begin)) // itemsize if end > begin else 0
        sizes.append(SplitSize(name, max(0, end - begin), tokens, sequences))
    return sizes


def too_small(prefix: str, size: SplitSize, need: int, split_flag: str) -> str:
    """The refusal for a split without one sample: which split, its size, and the fixes."""
    return (
        f"the {size.name} split of {prefix} gets {size.documents} of its {size.of_documents} "
        f"documents ({size.tokens} tokens) with {split_flag}, fewer than one sample "
        f"(--seq-length + 1 = {need} tokens); megatron-core would loop forever building it "
        f"(GPTDataset._get_num_epochs), with no message. Give the {size.name} split a larger "
        "weight, set its weight to 0 (e.g. --split 99,1,0) if you do not evaluate on it, or use "
        "a larger corpus"
    )
