"""A small loadable torch_dist checkpoint for tests that need checkpoint directories but no
training: the skip-list tests, whose rollback target must pass the planner's load check
(``megatron_ext.common.checkpoint_state.checkpoint_problem``).

The files are the real format: torch's DCP writer, Megatron's save planner, the common state
as the ``common_state/shard_0_1`` byte item (``torch.save([state])``) and one tensor in a
``.distcp`` file, with the ``metadata.json`` Megatron writes last. Made once per process and
copied (a test may damage its copy).
"""

from __future__ import annotations

import argparse
import functools
import io
import os
import shutil
import tempfile
from pathlib import Path

from megatron_ext.common.checkpoint_state import COMMON_STATE_KEY
from megatron_ext.common.files import CHECKPOINT_METADATA_FILE

METADATA_JSON = '{"sharded_backend": "torch_dist", "sharded_backend_version": 1}'


@functools.cache
def _template(saved_args: tuple[tuple[str, object], ...] = ()) -> Path:
    import torch
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner

    directory = Path(tempfile.mkdtemp(prefix="loadable-checkpoint-"))
    blob = io.BytesIO()
    # No saved args unless asked: the skip-list tests pass --train-iters, and their skip lists
    # stay as planned (no resume point or batch size is read from the checkpoint).
    state: dict[str, object] = {"checkpoint_version": 3.0}
    if saved_args:
        state |= {"args": argparse.Namespace(**dict(saved_args)), "iteration": 0}
    torch.save([state], blob)
    dcp.save(
        {COMMON_STATE_KEY: blob, "weight": torch.arange(64, dtype=torch.float32)},
        storage_writer=dcp.FileSystemWriter(str(directory)),
        planner=MCoreSavePlanner(flatten_state_dict=False),
        no_dist=True,
    )
    (directory / CHECKPOINT_METADATA_FILE).write_text(METADATA_JSON)
    return directory


def write_loadable_checkpoint(
    directory: Path, link: bool = False, saved_args: tuple[tuple[str, object], ...] = ()
) -> None:
    """Fill ``directory`` (an ``iter_NNNNNNN``, created if missing) with the template's files;
    ``link``: hard links (thousands of checkpoints for a benchmark, none damaged later);
    ``saved_args``: Megatron's saved ``args`` as (name, value) pairs."""
    copy = _link_or_copy if link else shutil.copy2
    shutil.copytree(_template(saved_args), directory, dirs_exist_ok=True, copy_function=copy)


def _link_or_copy(source: str, destination: str) -> None:
    try:
        os.link(source, destination)
    except OSError:  # another filesystem
        shutil.copy2(source, destination)
