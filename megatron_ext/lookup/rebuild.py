"""``--rebuild-caches``: rebuild missing index caches with megatron-core's own builder.

Only on explicit request, because a rebuild is only faithful when the data is unchanged and the
config is the run's: the caches are a deterministic function of both (seed, sizes, split, the
.idx), and the lookup's fingerprint checks run on the rebuilt caches like on any others. The
build goes through ``BlendedMegatronDatasetBuilder`` with the ``GPTDatasetConfig`` the entry
point builds (``gpt_step.gpt_dataset_config_from_args``), so names and contents are exactly the
training job's. Megatron logs one line per index it builds; those drive the progress bar.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import tempfile
from collections.abc import Iterator
from typing import Any

from tqdm import tqdm

from megatron_ext.common.records.pair import PairError, check_pair
from megatron_ext.lookup.config import RunConfig, eval_sizes
from megatron_ext.lookup.errors import DataChanged
from megatron_ext.lookup.formats import blend_and_blend_per_split


class _Progress(logging.Handler):
    """Advance a progress bar on Megatron's "Build and save"/"Load the" index messages."""

    def __init__(self, bar: tqdm) -> None:
        super().__init__(logging.INFO)
        self.bar = bar

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        for prefix in ("Build and save the ", "Load the "):
            if message.startswith(prefix) and "indices" in message:
                self.bar.set_postfix_str(message[len(prefix) :].replace(" indices", ""))
                self.bar.update(1)


def _expected_indices(args: Any) -> int:
    """How many GPT/Blended indices the builder will build or load, for the bar's total."""
    from megatron.training.utils import get_blend_and_blend_per_split

    blend, per_split = get_blend_and_blend_per_split(args)
    blends = (
        [blend] * sum(1 for part in args.split.split(",") if float(part) > 0)
        if blend
        else [b for b in per_split if b is not None]
    )
    return sum(
        len(prefixes) + (len(prefixes) > 1 or weights is not None) for prefixes, weights in blends
    )


@contextlib.contextmanager
def process_group() -> Iterator[None]:
    """A one-process gloo group while none exists: megatron-core 0.17's BlendedDataset asks
    torch.distributed for the rank before building its indices (0.18 on check first), and a
    lookup is one process with no group."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory() as directory:
        store = dist.FileStore(f"{directory}/store", 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def _check_data(args: Any) -> None:
    """Every pair the builder will read passes the check training start-up runs: on a
    truncated ``.idx`` the builder dies in a numpy traceback, and on an edited one it builds
    caches that the lookup would then answer from."""
    blend, per_split = blend_and_blend_per_split(args)
    for found in (blend, *(per_split or ())):
        for prefix in found[0] if found else ():
            try:
                check_pair(prefix)
            except PairError as exc:
                raise DataChanged(f"{exc}; no cache was rebuilt") from None


def rebuild_caches(config: RunConfig, phase: int, cache_dir: str | None) -> None:
    """Build (or load, where present) every index cache of the run's datasets for ``phase``."""
    _check_data(config.args)
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset

    from megatron_ext.loop.gpt_step import gpt_dataset_config_from_args

    args = copy.copy(config.args)
    if cache_dir is not None:
        args.data_cache_path = cache_dir
    # Both skip building (they assume caches exist); neither changes names or contents.
    args.dataloader_fast_cache_load = False
    args.dataloader_defer_npy_index_mmap = False
    args.rank = 0
    dataset_config = gpt_dataset_config_from_args(args)
    dataset_config.add_extra_token_to_sequence = config.add_extra_token
    valid, test = eval_sizes(args)
    sizes = [config.train_target(phase), valid, test]
    logger = logging.getLogger("megatron.core.datasets")
    level, propagate = logger.level, logger.propagate
    with tqdm(total=_expected_indices(args), desc="rebuilding index caches", unit="index") as bar:
        handler = _Progress(bar)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False  # the bar reports progress; the log lines would drown it
        try:
            with process_group():
                builder = BlendedMegatronDatasetBuilder(
                    GPTDataset, sizes, lambda: True, dataset_config
                )
                builder.build()
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
            logger.propagate = propagate
