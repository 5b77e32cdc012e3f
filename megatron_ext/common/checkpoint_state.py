"""A checkpoint's common state (Megatron's saved ``args``, ``iteration``, ...) without torch.

The ``torch.save`` archive (a DCP ``.distcp`` item, or a legacy ``common.pt``) is read with a
restricted unpickler: plain objects are rebuilt, torch/numpy/Megatron ones become inert
:class:`Opaque` records, nothing else runs; an unknown layout raises :class:`UnreadableState`.
"""

from __future__ import annotations

import argparse
import builtins
import codecs
import collections
import functools
import io
import json
import logging
import pathlib
import pickle
import signal
import types
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_ext.common import bridge_state
from megatron_ext.common.errors import Refusal
from megatron_ext.common.files import (
    CHECKPOINT_COMMON_FILE,
    CHECKPOINT_METADATA_FILE,
    DCP_METADATA_FILE,
    LEGACY_MODEL_FILE,
    LEGACY_RANK_DIR_GLOB,
)

# ShardedObject("common_state", None, (1,), (0,)).unique_key in megatron-core 0.19.2
# (dist_checkpointing/serialization.py: load_common_state_dict); registry: checkpoint-common-state.
COMMON_STATE_KEY = "common_state/shard_0_1"

_STAND_IN_ROOTS = ("torch", "numpy", "megatron")
_STAND_IN_NAMES = {("io", "BytesIO"), ("_io", "BytesIO")}  # byte items in DCP write plans
_BUILTINS = ("set", "frozenset", "complex", "bytearray", "slice", "range")
_REAL: dict[tuple[str, str], Any] = {
    ("argparse", "Namespace"): argparse.Namespace,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("signal", "Signals"): signal.Signals,
    ("types", "SimpleNamespace"): types.SimpleNamespace,
    ("_codecs", "encode"): codecs.encode,  # how protocol 2 pickles bytes
    **{(module, "PosixPath"): pathlib.PosixPath for module in ("pathlib", "pathlib._local")},
    **{("builtins", name): getattr(builtins, name) for name in _BUILTINS},
}


class UnreadableState(Exception):
    """Not a layout this reader knows: an internal control-flow signal (callers fall back)."""


class CheckpointUnreadable(Refusal, ValueError):
    """Neither reader can read the checkpoint's common state; the message says what to do."""


class Opaque:
    """A torch, numpy or Megatron object in the pickle, kept as its name and arguments."""

    qualified_name = "?"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs, self.state = args, kwargs, None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def field(self, name: str) -> Any:
        """A dataclass-like object's pickled attribute (its ``__dict__`` state)."""
        state = self.state[0] if isinstance(self.state, tuple) else self.state
        if not isinstance(state, dict):
            raise UnreadableState(f"{self.qualified_name} has no field {name!r}")
        return state.get(name)

    def __repr__(self) -> str:
        return f"<{self.qualified_name}{self.args!r}>"


@functools.cache
def stand_in(qualified_name: str) -> type[Opaque]:
    """The :class:`Opaque` class standing in for ``qualified_name`` (one per name)."""
    name = qualified_name.rsplit(".", 1)[-1]
    return type(name, (Opaque,), {"qualified_name": qualified_name})


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        real = _REAL.get((module, name))
        if real is not None:
            return real
        if module.split(".")[0] in _STAND_IN_ROOTS or (module, name) in _STAND_IN_NAMES:
            return stand_in(f"{module}.{name}")
        raise UnreadableState(f"the pickle names {module}.{name}, which this reader does not allow")

    def persistent_load(self, pid: Any) -> Opaque:
        return stand_in("torch.storage")(pid)  # a tensor's storage: never materialised


def _unpickle(data: bytes) -> Any:
    try:
        return _Unpickler(io.BytesIO(data)).load()
    except UnreadableState:
        raise
    except Exception as exc:  # a truncated or foreign pickle can raise almost anything
        raise UnreadableState(f"unreadable pickle: {exc!r}") from exc


def _torch_archive(blob: bytes) -> Any:
    """The object of a ``torch.save`` zip archive (its ``*/data.pkl``), tensors left opaque."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(blob))
        pickles = [n for n in archive.namelist() if n.endswith("/data.pkl")]
        if len(pickles) != 1:
            raise UnreadableState(f"not a torch.save archive (data.pkl entries: {pickles})")
        return _unpickle(archive.read(pickles[0]))
    except zipfile.BadZipFile as exc:
        raise UnreadableState(f"not a torch.save zip archive: {exc}") from exc


@dataclass(frozen=True)
class _Stored:
    """Where torch's FileSystemWriter put one DCP item (``path`` relative to the checkpoint)."""

    fqn: str
    path: str
    offset: int
    length: int
    transforms: Any  # compression or other transforms applied on save (None/empty: none)


def _dcp_index(directory: Path) -> list[_Stored]:
    """Every item's location in a DCP checkpoint, from ``.metadata`` (restricted unpickler)."""
    try:
        metadata = _unpickle((directory / DCP_METADATA_FILE).read_bytes())
    except OSError as exc:
        raise UnreadableState(f"no DCP metadata: {exc}") from exc
    storage = metadata.field("storage_data") if isinstance(metadata, Opaque) else None
    if not isinstance(storage, dict):
        raise UnreadableState(f"{directory / DCP_METADATA_FILE} has no storage_data")
    stored = []
    for index, info in storage.items():
        if not (isinstance(index, Opaque) and isinstance(info, Opaque)):
            raise UnreadableState(f"a storage_data entry is {index!r}: {info!r}")
        fqn = index.field("fqn")
        path, offset, length = (info.field(k) for k in ("relative_path", "offset", "length"))
        if not (isinstance(path, str) and isinstance(offset, int) and isinstance(length, int)):
            raise UnreadableState(f"{fqn!r} has no plain file location: {info.state!r}")
        transforms = info.field("transform_descriptors")
        stored.append(_Stored(str(fqn), path, offset, length, transforms))
    return stored


def _dcp_item(directory: Path, fqn: str) -> bytes:
    """The raw bytes torch's FileSystemWriter stored for one byte item of a DCP checkpoint."""
    found = [item for item in _dcp_index(directory) if item.fqn == fqn]
    if len(found) != 1:
        raise UnreadableState(f"{fqn!r} is stored {len(found)} times in the DCP metadata")
    item = found[0]
    if item.transforms:  # compressed or otherwise transformed on save
        raise UnreadableState(f"{fqn!r} was saved with transforms {item.transforms}")
    try:
        with open(directory / item.path, "rb") as handle:
            handle.seek(item.offset)
            data = handle.read(item.length)
    except OSError as exc:
        raise UnreadableState(f"cannot read {directory / item.path}: {exc}") from exc
    if len(data) != item.length:
        raise UnreadableState(
            f"{directory / item.path} is truncated ({len(data)} of {item.length} bytes)"
        )
    return data


def read_common_state(directory: str | Path) -> dict[str, Any]:
    """The common state dict of one ``iter_NNNNNNN`` (a Bridge one's is made from its run
    configuration, :mod:`megatron_ext.common.bridge_state`)."""
    directory = Path(directory)
    if bridge_state.is_bridge_checkpoint(directory):
        return bridge_state.read_bridge_state(directory)
    legacy = directory / CHECKPOINT_COMMON_FILE
    if legacy.is_file():
        state = _torch_archive(legacy.read_bytes())
    else:
        loaded = _torch_archive(_dcp_item(directory, COMMON_STATE_KEY))
        if not (isinstance(loaded, list) and len(loaded) == 1):
            raise UnreadableState(f"common_state holds {type(loaded).__name__}, not [state]")
        state = loaded[0]
    if not isinstance(state, dict):
        raise UnreadableState(f"the common state is a {type(state).__name__}, not a dict")
    return state


def read_saved_args(directory: str | Path) -> argparse.Namespace:
    """Megatron's saved ``args`` of one checkpoint directory."""
    args = read_common_state(directory).get("args")
    if not isinstance(args, argparse.Namespace):
        raise UnreadableState(f"{directory} holds no saved Megatron args")
    return args


def load_common_state(directory: str | Path) -> dict[str, Any]:
    """The common state (with Megatron's saved ``args``) of one ``iter_NNNNNNN``: read here,
    else by Megatron's ``load_common_state_dict``; any failure is :class:`CheckpointUnreadable`."""
    try:
        state = read_common_state(directory)
    except UnreadableState:
        from megatron.core.dist_checkpointing.serialization import load_common_state_dict
        from torch.distributed.checkpoint.api import CheckpointException

        root = logging.getLogger()  # torch logs each failed read there, with a traceback
        level = root.level
        root.setLevel(logging.ERROR)
        try:
            state = load_common_state_dict(str(directory))
        except (Exception, CheckpointException) as exc:
            detail = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
            reason = detail[-1] if detail else type(exc).__name__
            raise CheckpointUnreadable(
                f"checkpoint {directory} is unreadable ({type(exc).__name__}: {reason[:300]}): "
                "it is corrupt or was copied partially. Restore it from a backup, or move it "
                "out of the checkpoint directory so that an older one is used"
            ) from None
        finally:
            root.setLevel(level)
    if not isinstance(state, dict) or not isinstance(state.get("args"), argparse.Namespace):
        raise CheckpointUnreadable(
            f"checkpoint {directory} holds no saved Megatron args (not a Megatron training "
            "checkpoint?)"
        )
    return state


def _zip_problem(path: Path, directory: Path) -> str | None:
    """What is wrong with a ``torch.save`` archive (None: nothing seen); a truncated one lacks
    its zip directory."""
    name = path.relative_to(directory)
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.namelist()
    except FileNotFoundError:
        return f"{name} is missing"
    except (OSError, zipfile.BadZipFile) as exc:
        return f"{name} is not a complete zip archive ({exc})"
    if not any(member.endswith("/data.pkl") for member in members):
        return f"{name} is not a torch.save archive (no data.pkl)"
    return None


def _dcp_index_by_torch(directory: Path) -> list[_Stored]:
    """The DCP index as torch reads it: for a ``.metadata`` of classes the restricted
    unpickler does not know (a newer torch), so a layout change is not taken for damage."""
    from torch.distributed.checkpoint import FileSystemReader

    storage = FileSystemReader(str(directory)).read_metadata().storage_data
    return [
        _Stored(index.fqn, info.relative_path, info.offset, info.length, info.transform_descriptors)
        for index, info in storage.items()
    ]


def _metadata_problem(directory: Path) -> str | None:
    """``metadata.json`` as ``verify_checkpoint`` reads it, and the DCP index's presence."""
    try:
        config = json.loads((directory / CHECKPOINT_METADATA_FILE).read_text())
    except (OSError, ValueError) as exc:
        return f"{CHECKPOINT_METADATA_FILE} is unreadable ({exc})"
    if not isinstance(config, dict) or "sharded_backend" not in config:
        return f"{CHECKPOINT_METADATA_FILE} names no sharded_backend: {str(config)[:100]}"
    if not (directory / DCP_METADATA_FILE).is_file():
        return f"{DCP_METADATA_FILE} (the index of the data files) is missing"
    return None


def _data_files_problem(directory: Path, index: list[_Stored]) -> str | None:
    """Every file the index names, as long as the furthest byte read from it."""
    ends: dict[str, int] = {}
    for item in index:
        ends[item.path] = max(ends.get(item.path, 0), item.offset + item.length)
    for name, end in sorted(ends.items()):
        try:
            size = (directory / name).stat().st_size
        except FileNotFoundError:
            return f"{name} is missing (named in {DCP_METADATA_FILE})"
        except OSError as exc:
            return f"{name} is unreadable ({exc})"
        if size < end:
            return f"{name} is truncated: {size} bytes, read up to byte {end}"
    return None


def _torch_dist_problem(directory: Path) -> str | None:
    """What keeps Megatron from loading a torch_dist checkpoint: ``metadata.json``, the DCP
    index, its data files, the common state (``common.pt`` if present, else its index item)."""
    problem = _metadata_problem(directory)
    if problem is not None:
        return problem
    try:
        index = _dcp_index(directory)
    except UnreadableState:
        try:
            index = _dcp_index_by_torch(directory)
        except Exception as exc:  # a damaged pickle can raise almost anything
            return f"{DCP_METADATA_FILE} is unreadable ({type(exc).__name__}: {exc})"
    problem = _data_files_problem(directory, index)
    if problem is None and (directory / CHECKPOINT_COMMON_FILE).exists():
        problem = _zip_problem(directory / CHECKPOINT_COMMON_FILE, directory)
    elif problem is None and not any(item.fqn == COMMON_STATE_KEY for item in index):
        problem = (
            f"no common state: neither {CHECKPOINT_COMMON_FILE} nor {COMMON_STATE_KEY!r} in "
            f"{DCP_METADATA_FILE}"
        )
    return problem


def checkpoint_problem(directory: str | Path) -> str | None:
    """Why Megatron could not load checkpoint ``directory`` (an ``iter_NNNNNNN``), or None
    when every file its loader reads is there and whole: torch_dist (``metadata.json``, which
    an unfinished save lacks) as above; legacy: each ``mp_rank_*/`` folder's ``.pt`` files are
    complete zip archives. Small files are read, data files only stat'ed."""
    directory = Path(directory)
    if (directory / CHECKPOINT_METADATA_FILE).exists():
        return _torch_dist_problem(directory)
    ranks = sorted(directory.glob(LEGACY_RANK_DIR_GLOB))
    if not ranks:
        return (
            f"no {CHECKPOINT_METADATA_FILE} (a save that never finished, e.g. an --async-save "
            f"in flight or killed) and no {LEGACY_RANK_DIR_GLOB}/ folders of a legacy checkpoint"
        )
    for rank in ranks:
        model = rank / LEGACY_MODEL_FILE
        for path in (model, *sorted(p for p in rank.glob("*.pt") if p != model)):
            problem = _zip_problem(path, directory)
            if problem:
                return problem
    return None
