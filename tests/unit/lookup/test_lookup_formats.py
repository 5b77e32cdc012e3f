"""The lookup's Megatron-free readers give megatron-core 0.19.2's answers on the same inputs:
the flag spec (against Megatron's parser), the .idx/.bin reader, blend and split rules; and the
lookup process itself starts without importing Megatron or torch."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron.core.datasets.utils import get_blend_from_list
from megatron.training.utils import get_blend_and_blend_per_split

from megatron_ext.common.checkpoint_state import Opaque
from megatron_ext.common.versions import VERIFIED
from megatron_ext.lookup import flagspec, formats
from megatron_ext.lookup.errors import ConfigError

# The compatibility tier runs this module on every supported megatron-core (tests/compat).
pytestmark = pytest.mark.compat


REPO = Path(__file__).resolve().parents[3]


def _opaque(value: object) -> bool:
    return isinstance(value, Opaque) or (isinstance(value, type) and issubclass(value, Opaque))


def test_the_shipped_flag_spec_is_the_installed_megatrons_parser() -> None:
    """Run in every CI tier: the installed version's shipped spec is what its parser gives,
    so the fast path is taken (and exact) on each supported version."""
    live = flagspec.generate()
    path = flagspec.spec_file(live["megatron_core"])
    assert path.is_file(), f"no flag spec shipped for megatron-core {live['megatron_core']}"
    shipped = json.loads(path.read_text())
    assert shipped == json.loads(flagspec.dump(live)), (
        f"{path} is stale: regenerate it under megatron-core {live['megatron_core']} with "
        "`python -m megatron_ext.lookup.flagspec`"
    )
    assert len(shipped["actions"]) > 700
    assert flagspec._spec() == shipped["actions"]  # the one parse() takes


def test_one_flag_spec_per_verified_version() -> None:
    """Every verified megatron-core ships its own spec (and nothing else is shipped), each
    naming the version whose parser generated it; the parsers do differ between them."""
    assert flagspec.shipped_versions() == sorted(VERIFIED)
    flags = {}
    for version in VERIFIED:
        spec = json.loads(flagspec.spec_file(version).read_text())
        assert spec["megatron_core"] == version
        flags[version] = {a["dest"] for a in spec["actions"]}
    assert "step_batch_size_schedule" not in flags["0.17.1"]
    assert "chat_template" in flags["0.18.2"] - flags["0.17.1"]
    assert "dataloader_inter_document_masking" in flags["0.19.2"] - flags["0.18.2"]


ARGVS = [
    "",
    "--data-path 0.3 a 0.7 b --seq-length 128 --micro-batch-size 2 --global-batch-size 16 "
    "--train-iters 100 --split 98,2,0 --iterations-to-skip 3 4 --no-data-sharding "
    "--dataloader-type cyclic --bf16 --rl-persist-cuda-graphs --hidden-dropout 0",
    "--train-samples 1000 --rampup-batch-size 4 4 100 --no-rl-persist-cuda-graphs "
    "--phase-transition-iterations 10,20 --save-interval 5 --not-a-flag x",
]


@pytest.mark.parametrize("command_line", ARGVS, ids=range(len(ARGVS)))
def test_spec_parser_parses_like_megatrons(command_line: str) -> None:
    argv = command_line.split()
    base = argparse.Namespace(seq_length=64, seed=7)  # as a checkpoint's args: values kept
    ours, our_unknown = flagspec.parse(argv, argparse.Namespace(**vars(base)))
    theirs, their_unknown = flagspec.megatron_parser().parse_known_args(
        argv, namespace=argparse.Namespace(**vars(base))
    )
    assert our_unknown == their_unknown
    assert vars(ours).keys() == vars(theirs).keys()
    for key, value in vars(theirs).items():
        if _opaque(vars(ours)[key]):  # a Megatron object default (AttnBackend.auto, SIGTERM)
            assert type(value) not in (bool, int, float, str, list, type(None)), key
            continue
        assert (vars(ours)[key], type(vars(ours)[key])) == (value, type(value)), key


def test_flags_megatron_converts_itself_go_to_megatrons_parser() -> None:
    argv = ["--seq-length", "9", "--attention-backend", "flash"]
    ours, _ = flagspec.parse(argv, argparse.Namespace())
    theirs, _ = flagspec.megatron_parser().parse_known_args(argv, namespace=argparse.Namespace())
    assert type(ours.attention_backend).__name__ == "AttnBackend"  # Megatron's real enum
    assert vars(ours) == vars(theirs)  # nothing left over from the abandoned fast parse


def test_a_spec_for_another_megatron_core_is_not_used(monkeypatch, tmp_path: Path) -> None:
    installed = flagspec.installed_version()
    stale = json.loads(flagspec.spec_file(installed).read_text())
    stale["megatron_core"] = "0.0.1"  # a file under the installed name, from another parser
    stale["actions"] = [a for a in stale["actions"] if a["dest"] != "seq_length"]
    monkeypatch.setattr(flagspec, "SPEC_DIR", tmp_path)
    flagspec.spec_file(installed).write_text(json.dumps(stale))
    parsed, unknown = flagspec.parse(["--seq-length", "9"], argparse.Namespace())
    assert (parsed.seq_length, unknown) == (9, [])
    flagspec.spec_file(installed).unlink()  # no spec for the installed version at all
    assert flagspec._spec() is None
    parsed, unknown = flagspec.parse(["--seq-length", "9"], argparse.Namespace())
    assert (parsed.seq_length, unknown) == (9, [])


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.uint8])
def test_indexed_data_reads_what_megatron_reads(tmp_path: Path, dtype: type) -> None:
    rng = np.random.default_rng(3)
    prefix = str(tmp_path / "d")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for _ in range(3):
        for _ in range(int(rng.integers(1, 4))):
            document = rng.integers(0, 200, int(rng.integers(1, 50)))
            builder.add_document(document, [len(document)])
        builder.end_document()
    builder.finalize(prefix + ".idx")
    ours, theirs = formats.IndexedData(prefix), IndexedDataset(prefix, mmap=True)
    assert ours.dtype == np.dtype(theirs.index.dtype)
    for name in ("sequence_lengths", "sequence_pointers", "document_indices"):
        assert np.array_equal(getattr(ours, name), getattr(theirs.index, name)), name
    for sequence in range(len(theirs)):
        length = int(theirs.sequence_lengths[sequence])
        assert np.array_equal(ours.get(sequence), theirs.get(sequence))
        offset = length // 2
        tail = length - offset
        assert np.array_equal(ours.get(sequence, offset, tail), theirs.get(sequence, offset, tail))
    (tmp_path / "bad.idx").write_bytes(b"NOTANIDX" + bytes(40))
    with pytest.raises(ValueError, match="bad header"):
        formats.IndexedData(str(tmp_path / "bad"))


BLENDS = [
    None,
    ["a"],
    [" a ", "b", "c"],
    ["0.3", "a", "0.7", "b"],
    ["30", "a ", "70", " b"],
    ["a", "b"],
    ["0.5", "a", "b", "c"],  # one weight, then a prefix: Megatron keeps the whole list as prefixes
    ["1e-3", "a", "2", "b"],
]


@pytest.mark.parametrize("blend", BLENDS, ids=range(len(BLENDS)))
def test_blend_rules_equal_megatrons(blend: list[str] | None) -> None:
    assert formats.blend_from_list(blend) == get_blend_from_list(blend)


@pytest.mark.parametrize("blend", [[], ["a", "b", "0.5", "c"]])
def test_blends_megatron_rejects_are_refused(blend: list[str]) -> None:
    with pytest.raises((AssertionError, ValueError)):
        get_blend_from_list(blend)
    with pytest.raises(ConfigError):
        formats.blend_from_list(blend)


def test_blend_and_blend_per_split_equal_megatrons(tmp_path: Path) -> None:
    args_file = tmp_path / "data-args.txt"
    args_file.write_text("0.2 x\n0.8 y\n")
    per_split = tmp_path / "per-split.json"
    per_split.write_text(json.dumps({"train": "1 t1 3 t2", "valid": ["v"], "test": None}))
    empty = dict.fromkeys(
        (
            "data_path",
            "data_args_path",
            "train_data_path",
            "valid_data_path",
            "test_data_path",
            "per_split_data_args_path",
        )
    )
    cases = [
        {},
        {"data_path": ["0.4", "p", "0.6", "q"]},
        {"data_args_path": str(args_file)},
        {"train_data_path": ["t"], "test_data_path": ["2", "u", "1", "w"]},
        {"per_split_data_args_path": str(per_split)},
    ]
    for case in cases:
        args = argparse.Namespace(**{**empty, **case})
        assert formats.blend_and_blend_per_split(args) == get_blend_and_blend_per_split(args), case


SPLITS = ["98,2,0", "969, 30, 1", "1", "100,0,0", "0.5,0.25,0.25", "1/2/3"]


@pytest.mark.parametrize("split", SPLITS)
def test_split_matrix_equals_megatrons(split: str) -> None:
    theirs = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    assert formats.split_matrix(split) == theirs
    assert [type(v) for v in formats.split_matrix(split)] == [type(v) for v in theirs]


def test_a_lookup_process_imports_neither_megatron_nor_torch() -> None:
    """What keeps ``megatron-ext lookup`` under a second of imports: the whole CLI path up to
    its answer loads no Megatron and no torch (single dataloader, no --text)."""
    code = (
        "import sys\n"
        "from megatron_ext import cli\n"
        "import megatron_ext.lookup.cli, megatron_ext.lookup.session\n"
        "from megatron_ext.lookup import config\n"
        "config.megatron_namespace(['--seq-length', '8', '--data-path', 'x'], None)\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('megatron', 'torch'))\n"
        "assert not heavy, heavy[:10]\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
