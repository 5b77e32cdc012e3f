"""Each split's documents and tokens as megatron-core's builder splits them, from the ``.idx``
(no Megatron import): ``GPTDataset._get_num_epochs`` loops forever on a split with 0 tokens
(e.g. the test split of ``--split 949,50,1`` on 400 documents) while the other ranks wait.
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


def index_arrays(prefix: str) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """The ``.idx``'s dtype code, sequence lengths, sequence pointers and document starts, as
    megatron-core's ``_IndexReader`` lays them out."""
    idx = f"{prefix}.idx"
    with open(idx, "rb") as handle:
        _, _, code, sequences, documents = HEADER.unpack(handle.read(HEADER.size))

    def array(dtype: type, offset: int, count: int) -> np.ndarray:
        return np.memmap(idx, dtype, "r", offset, (count,)) if count else np.zeros(0, dtype)

    lengths = array(np.int32, HEADER.size, sequences)
    pointers = array(np.int64, HEADER.size + 4 * sequences, sequences)
    return code, lengths, pointers, array(np.int64, HEADER.size + 12 * sequences, documents)


def split_sizes(prefix: str, matrix: list[tuple[float, float] | None]) -> list[SplitSize | None]:
    """Documents and tokens of each split of ``prefix`` (None: the split is not built), with
    the builder's rounding: ``int(round(edge * sequences))``."""
    code, lengths, pointers, _ = index_arrays(prefix)
    itemsize, sequences = ITEM_SIZES.get(code, 2), len(lengths)

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
