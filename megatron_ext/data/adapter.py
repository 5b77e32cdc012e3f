"""Before distributed init, refuse a blend prefix whose ``.bin``/``.idx`` pair is incomplete,
damaged or not the one recorded, or with a split that cannot hold a sample (:mod:`.checks`).
Every rank checks; rank 0 prints the reason.
"""

from __future__ import annotations

from typing import Any

from megatron_ext.common.features import Feature, FeatureError
from megatron_ext.common.records.pair import PairError, check_pair
from megatron_ext.data.checks import split_sizes, too_small


def _splits(args: Any) -> list[tuple[str, list[tuple[float, float] | None], str]]:
    """(prefix, split matrix, how the split was chosen) for every member of every split."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )
    from megatron.training.utils import get_blend_and_blend_per_split

    blend, per_split = get_blend_and_blend_per_split(args)
    out = []
    if blend is not None:
        matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(args.split))
        out += [(prefix, matrix, f"--split {args.split}") for prefix in blend[0]]
    for index, split_blend in enumerate(per_split or ()):
        if split_blend is None:
            continue
        matrix = [(0.0, 1.0) if i == index else None for i in range(3)]
        out += [(prefix, matrix, "its per-split data path") for prefix in split_blend[0]]
    return out


class DataCheckFeature(Feature):
    """Complete, unmixed, undamaged ``.bin``/``.idx`` pairs; no split too small for a sample."""

    name = "data_check"

    def enabled(self, args: Any) -> bool:
        return not args.mock_data and bool(
            args.data_path
            or args.train_data_path
            or args.valid_data_path
            or args.test_data_path
            or args.data_args_path
            or args.per_split_data_args_path
        )

    def validate(self, args: Any) -> None:
        need = int(args.seq_length) + 1  # add_extra_token_to_sequence, as Megatron-LM trains
        problems = []
        for prefix, matrix, flag in _splits(args):
            if prefix.startswith(("s3://", "msc://")):
                continue  # object storage: nothing local to check
            try:
                check_pair(prefix)
            except PairError as exc:
                problems.append(str(exc))
                continue
            for size in split_sizes(prefix, matrix):
                if size is not None and size.tokens < need:
                    problems.append(too_small(prefix, size, need, flag))
        if not problems:
            return
        if int(getattr(args, "rank", 0) or 0) != 0:
            raise FeatureError("the data check failed; rank 0 printed why")
        raise FeatureError("; ".join(problems))
