"""``megatron-ext lookup``: exact against megatron-core's own datasets, refuses changed data,
and its command line (training-loop agreement: tests/e2e/test_lookup_training.py).

Tiny datasets are written with megatron-core's ``IndexedDatasetBuilder`` and their caches built
by ``BlendedMegatronDatasetBuilder`` (the path training takes); the tool then reads only those
caches and the .bin/.idx.
"""

from __future__ import annotations

import json
import shutil
import sys
import tracemalloc
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import pytest
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from megatron.core.tokenizers import MegatronTokenizer
from megatron.training.datasets.data_samplers import (
    MegatronPretrainingSampler,
)

from megatron_ext import cli as megatron_ext_cli
from megatron_ext.common import versions
from megatron_ext.common.io import token_sha1
from megatron_ext.lookup import cli, data, session
from megatron_ext.lookup.config import pad_token_id, process_group
from megatron_ext.lookup.data import DataSpec, find_document, open_train_index
from megatron_ext.lookup.errors import CacheMissing, DataChanged
from megatron_ext.lookup.schedule import Schedule
from tests.support.io_counters import PROC_IO, rchar
from tests.unit.lookup.test_lookup_layers import RANK

# The compatibility tier runs this module on every supported megatron-core (tests/compat).
pytestmark = pytest.mark.compat

VOCAB = 512
SURPLUS = 0.005


def _null_tokenizer():
    return MegatronTokenizer.from_pretrained(
        metadata_path={"library": "null-text"}, vocab_size=VOCAB
    )


def _write_prefix(prefix: Path, documents: list[np.ndarray]) -> str:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for document in documents:
        builder.add_document(document, [len(document)])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def _documents(rng: np.random.Generator, count: int) -> list[np.ndarray]:
    """Random token documents of random lengths, each ending with the EOD id."""
    return [
        np.append(rng.integers(1, VOCAB - 1, int(rng.integers(1, 60))), VOCAB - 1)
        for _ in range(count)
    ]


def _build(
    prefixes: list[str],
    weights: list[float] | None,
    *,
    per_split: bool,
    split: str,
    seed: int,
    seq: int,
    target: int,
    cache: Path,
    extra: bool,
):
    """The train dataset as megatron-core builds it (caches written to ``cache``)."""
    blend = (prefixes, weights)
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq,
        blend=None if per_split else blend,
        blend_per_split=[blend, None, None] if per_split else None,
        split=None if per_split else split,
        path_to_cache=str(cache),
        tokenizer=_null_tokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        mid_level_dataset_surplus=SURPLUS,
        add_extra_token_to_sequence=extra,
    )
    sizes = [target, 0 if per_split else 3, 0]
    with process_group():  # 0.17's BlendedDataset asks torch.distributed for the rank
        return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()[0]


def _spec(prefixes, weights, *, per_split, split, seed, seq, target, cache, extra) -> DataSpec:
    return DataSpec(
        tuple(prefixes),
        None if weights is None else tuple(weights),
        per_split,
        None if per_split else split,
        seed,
        seq,
        target,
        SURPLUS,
        str(cache),
        extra,
    )


# --- exactness: the tool's tokens are megatron-core's dataset[i] for the sampler's ids --------


CASES = [  # prefixes, weighted, per-split, split, add_extra_token
    (3, True, False, "90,10,0", True),
    (4, True, False, "100,0,0", True),
    (3, False, False, "80,20,0", True),
    (1, False, False, "90,10,0", False),
    (3, True, True, None, True),
    (1, True, False, "100,0,0", True),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_tokens_equal_megatron_dataset_for_the_samplers_ids(tmp_path: Path, case: int) -> None:
    rng = np.random.default_rng(1000 + case)
    n_prefix, weighted, per_split, split, extra = CASES[case]
    prefixes = [
        _write_prefix(tmp_path / f"d{p}", _documents(rng, int(rng.integers(10, 30))))
        for p in range(n_prefix)
    ]
    weights = rng.uniform(0.1, 1.0, n_prefix).round(3).tolist() if weighted else None
    seq, mbs, dp = int(rng.integers(8, 40)), int(rng.integers(1, 4)), int(rng.integers(1, 4))
    gbs = mbs * dp * int(rng.integers(1, 4))
    iters = int(rng.integers(10, 20))
    seed = int(rng.integers(0, 10_000))
    kw = dict(
        per_split=per_split,
        split=split,
        seed=seed,
        seq=seq,
        target=iters * gbs,
        cache=tmp_path / "cache",
        extra=extra,
    )
    dataset = _build(prefixes, weights, **kw)
    iters = min(iters, len(dataset) // gbs)  # an unweighted blend may be smaller
    index = open_train_index(_spec(prefixes, weights, **kw))
    assert len(index) == len(dataset)
    schedule = Schedule(mbs, dp, gbs, train_iters=iters)
    pad = pad_token_id(_null_tokenizer(), False)
    for rank in range(dp):
        sampler = MegatronPretrainingSampler(len(dataset), 0, mbs, rank, dp)
        for n, ids in zip(range(iters * (gbs // (mbs * dp))), sampler):
            batch = schedule.batch(n // (gbs // (mbs * dp)) + 1)
            assert schedule.positions(batch, n % batch.num_microbatches, rank).tolist() == ids
            for sample in index.resolve(ids, pad):
                expected = dataset[sample.index]["tokens"].numpy()
                assert np.array_equal(sample.tokens, expected), (case, sample)
                assert token_sha1(sample.tokens) == token_sha1(dataset[sample.index]["tokens"])
    every = index.resolve(range(len(dataset)), pad)
    if weighted or n_prefix == 1:  # an unweighted blend is one epoch of each member
        epochs = [len(m.document_index) // (m.end - m.begin) for m in index.mids]
        assert max(epochs) > 1, "the cases must span several epochs"
    for member in range(n_prefix):
        for document in rng.choice(index.mids[member].end, 3, replace=False).tolist():
            brute = sorted(
                (s.index, span.offset, span.count)
                for s in every
                if s.dataset == member
                for span in s.spans
                if span.document == document
            )
            hits = find_document(index, member, document)
            assert (
                sorted(
                    zip(hits.global_indices.tolist(), hits.offsets.tolist(), hits.counts.tolist())
                )
                == brute
            )


@pytest.mark.skipif(not PROC_IO.is_file(), reason="needs Linux /proc/self/io")
def test_the_inverse_lookup_holds_a_few_chunks_whatever_the_index_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue #24's target, < 1 GiB at 50 M documents (whose document index alone is ~2.8 GB):
    each pass holds a few chunks of the cache it scans, never the whole file: not allocated
    (traced), and not scanned through a mapping, whose touched pages stay in the process
    (3 GiB at that size): each scanned cache is streamed with read(2) (counted). Resident
    pages are not counted: this kernel maps page-cache folios of up to 2 MiB whole, so one
    bisection step into a small cache shows as the whole file. Here each scanned cache is
    ~100 chunks. (The sample index is only bisected: a few pages per read of the document.)"""
    rng = np.random.default_rng(11)
    prefixes = [
        _write_prefix(
            tmp_path / f"d{p}",
            [
                np.append(rng.integers(1, VOCAB - 1, int(rng.integers(1, 4))), VOCAB - 1)
                for _ in range(20_000)
            ],
        )
        for p in range(2)
    ]
    kw = dict(
        per_split=False,
        split="100,0,0",
        seed=5,
        seq=16,
        target=900_000,
        cache=tmp_path / "cache",
        extra=True,
    )
    _build(prefixes, [0.5, 0.5], **kw)
    index = open_train_index(_spec(prefixes, [0.5, 0.5], **kw))
    mid = index.mids[1]
    assert index.blend_files is not None
    scanned = [mid.files["document_index"], mid.files["shuffle_index"], *index.blend_files]
    sizes = [Path(path).stat().st_size for path in scanned]
    smallest = min(sizes)
    chunk = 1 << 12
    monkeypatch.setattr(data, "CHUNK", chunk)
    assert smallest > 64 * chunk * 4, "every scanned cache must span many chunks"
    find_document(index, 1, int(mid.begin))  # once first: lazy imports allocate too
    read = rchar()
    tracemalloc.start()
    try:
        hits = find_document(index, 1, int(mid.end) // 2)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    read = rchar() - read
    epochs = len(mid.document_index) // (mid.end - mid.begin)
    assert len(hits.global_indices) >= epochs > 50, "read once per epoch (and found)"
    # A few chunks, and a pass's lookup table (one byte per value in its targets' range, at
    # most a quarter of a 4-byte cache): reading any one cache whole would exceed this.
    assert peak < smallest / 2, f"allocated {peak} B; the smallest scanned cache: {smallest} B"
    assert read >= sum(sizes), f"read {read} B of the {sum(sizes)} B scanned: a mapped scan?"


# --- refusals: changed, moved, tampered or missing data --------------------------------------


@pytest.fixture
def built(tmp_path: Path):
    rng = np.random.default_rng(7)
    docs = [_documents(rng, 60) for _ in range(3)]
    prefixes = [_write_prefix(tmp_path / "data" / f"d{p}", d) for p, d in enumerate(docs)]
    kw = dict(
        per_split=False,
        split="100,0,0",
        seed=3,
        seq=16,
        target=120,
        cache=tmp_path / "cache",
        extra=True,
    )
    _build(prefixes, [0.5, 0.3, 0.2], **kw)
    return tmp_path, prefixes, docs, _spec(prefixes, [0.5, 0.3, 0.2], **kw)


def test_reordered_data_is_refused_not_misanswered(built) -> None:
    _, prefixes, docs, spec = built
    before = [s.tokens for s in open_train_index(spec).resolve(range(24))]
    order = np.random.default_rng(1).permutation(len(docs[0]))
    _write_prefix(Path(prefixes[0]), [docs[0][i] for i in order])  # same docs, new order
    index = open_train_index(spec)  # counts and sizes still agree...
    with pytest.raises(DataChanged, match="re-preprocessed, reordered or edited"):
        index.resolve(range(24))  # ...but the documents moved under the caches
    _write_prefix(Path(prefixes[0]), docs[0])
    assert all(
        np.array_equal(a, b.tokens)
        for a, b in zip(before, open_train_index(spec).resolve(range(24)))
    )


def test_changed_counts_moved_tampered_and_missing_caches_are_refused(built) -> None:
    root, prefixes, docs, spec = built
    _write_prefix(Path(prefixes[1]), docs[1] + [np.array([5, VOCAB - 1])])  # one more document
    with pytest.raises(DataChanged, match="61 sequences"):
        open_train_index(spec)
    _write_prefix(Path(prefixes[1]), docs[1])
    shutil.move(root / "data", root / "moved")
    with pytest.raises(DataChanged, match="--data-root"):
        open_train_index(spec)
    remapped = open_train_index(spec, data_root=[(str(root / "data"), str(root / "moved"))])
    assert len(remapped.resolve(range(8))) == 8
    shutil.move(root / "moved", root / "data")
    description = next((root / "cache").glob("*-BlendedDataset-train-description.txt"))
    original = description.read_text()
    description.write_text(original.replace('"size": 120', '"size":  120'))  # same JSON
    with pytest.raises(DataChanged, match="md5 of its contents"):
        open_train_index(spec)
    description.write_text(original.replace('"size": 120', '"size": 121'))
    with pytest.raises(CacheMissing, match="do not hash to their names"):
        open_train_index(spec)
    description.unlink()
    with pytest.raises(CacheMissing, match="--rebuild-caches"):
        open_train_index(spec)


# --- the command line ---------------------------------------------------------------------


def _flags(root: Path, prefixes: list[str]) -> list[str]:
    return [
        "--data-path",
        "0.5",
        prefixes[0],
        "0.3",
        prefixes[1],
        "0.2",
        prefixes[2],
        "--split",
        "100,0,0",
        "--seq-length",
        "16",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "12",
        "--train-iters",
        "10",
        "--seed",
        "3",
        "--data-cache-path",
        str(root / "cli-cache"),
        "--data-parallel-size",
        "3",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        str(VOCAB),
        "--iterations-to-skip",
        "4",
    ]


def test_cli_table_json_out_blocklist_and_inverse(built, capsys) -> None:
    root, prefixes, _, _ = built
    flags = _flags(root, prefixes)
    assert cli.main([*flags, "--iteration", "4"]) == 1
    assert "--rebuild-caches" in capsys.readouterr().err
    assert cli.main([*flags, "--iteration", "4", "--rebuild-caches", "--text"]) == 0
    table = capsys.readouterr().out
    assert "SKIPPED" in table and table.count("    text: ") == 12
    rampup = ["--rampup-batch-size", "4", "4", "48"]
    ramps = versions.installed().startswith("0.17.")  # flags only: the installed one
    assert cli.main([*flags, "--iteration", "4", *rampup]) == (1 if ramps else 0)
    if ramps:  # 0.17 ramps up, and refuses a ramp-up with --train-iters
        assert "iteration-based" in capsys.readouterr().err
    else:
        assert "ignored from megatron-core 0.18 on" in capsys.readouterr().out
    assert cli.main([*flags, "--iteration", "4", "--dp-rank", "1", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert [(s["microbatch"], s["sample_index"]) for s in answer["samples"]] == [
        (0, 38),
        (0, 39),
        (1, 44),
        (1, 45),
    ]
    assert answer["batch"]["skipped"] and answer["batch"]["consumed_before"] == 36
    out, blocklist = root / "batch.jsonl", root / "block.jsonl"
    assert (
        cli.main(
            [
                *flags,
                "--consumed-samples",
                "36",
                "--out",
                str(out),
                "--emit-blocklist",
                str(blocklist),
            ]
        )
        == 0
    )
    assert "wrote 12 samples" in capsys.readouterr().err
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["sample_index"] for r in lines] == list(range(36, 48))
    blocked = [json.loads(line) for line in blocklist.read_text().splitlines()]
    assert {(b["dataset_path"], b["document"]) for b in blocked} == {
        (r["dataset_path"], d["document"]) for r in lines for d in r["documents"]
    }
    first = lines[0]["documents"][0]
    assert (
        cli.main(
            [
                *flags,
                "--document",
                str(first["document"]),
                "--dataset",
                Path(lines[0]["dataset_path"]).name,
                "--json",
            ]
        )
        == 0
    )
    hits = json.loads(capsys.readouterr().out)["hits"]
    assert {
        "iteration": 4,
        "dp_rank": 0,
        "microbatch": 0,
        "sample_index": 36,
        "dataset_sample": lines[0]["dataset_sample"],
        "offset": first["offset"],
        "count": first["count"],
        "skipped": True,
    } in hits
    cyclic = [*flags, "--dataloader-type", "cyclic"]
    assert cli.main([*cyclic, "--iteration", "9", "--dp-rank", "2", "--json"]) == 0
    drawn = json.loads(capsys.readouterr().out)["samples"][-1]
    assert drawn["sample_index"] not in range(96, 108)  # the cyclic order is not the stream's
    first = drawn["documents"][0]
    assert (
        cli.main(
            [
                *cyclic,
                "--document",
                str(first["document"]),
                "--dataset",
                str(drawn["dataset"]),
                "--json",
            ]
        )
        == 0
    )
    hits = json.loads(capsys.readouterr().out)["hits"]
    assert {
        "iteration": 9,
        "dp_rank": 2,
        "microbatch": 1,
        "sample_index": drawn["sample_index"],
        "dataset_sample": drawn["dataset_sample"],
        "offset": first["offset"],
        "count": first["count"],
        "skipped": False,
    } in hits
    assert "\n  lookup " in megatron_ext_cli.USAGE  # wired into `megatron-ext lookup`
    assert megatron_ext_cli.main(["lookup", *flags, "--iteration", "11"]) == 1
    assert "beyond --train-iters 10" in capsys.readouterr().err
    assert cli.main([*flags, "--iteration", "2", "--dataloader-type", "external"]) == 1
    assert "external" in capsys.readouterr().err


def test_a_batch_walk_calls_only_down(built, monkeypatch, capsys) -> None:
    """Every call a batch walk (``session.batch_records``, with --text) makes from one lookup
    module into another goes to a lower layer (test_lookup_layers.py), callbacks included."""
    root, prefixes, _, _ = built
    flags = _flags(root, prefixes)
    flags[flags.index("--data-cache-path") + 1] = str(root / "cache")
    calls: Counter[tuple[str, str]] = Counter()

    def lookup_module(frame: FrameType | None) -> str | None:
        """The lookup module of ``frame`` or, through other code, of its nearest caller."""
        while frame is not None:
            name = frame.f_globals.get("__name__", "")
            if name.startswith("megatron_ext.lookup."):
                return name.rsplit(".", 1)[1]
            frame = frame.f_back
        return None

    def profile(frame: FrameType, event: str, _: object) -> None:
        callee = frame.f_globals.get("__name__", "")
        if event == "call" and callee.startswith("megatron_ext.lookup."):
            caller, module = lookup_module(frame.f_back), callee.rsplit(".", 1)[1]
            if caller is not None and caller != module:
                calls[(caller, module)] += 1

    walk = session.batch_records

    def traced(*args: Any, **kwargs: Any) -> Any:
        previous = sys.getprofile()
        sys.setprofile(profile)
        try:
            return walk(*args, **kwargs)
        finally:
            sys.setprofile(previous)

    monkeypatch.setattr(cli, "batch_records", traced)
    assert cli.main([*flags, "--iteration", "5", "--text", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["samples"]) == 12
    up = sorted(f"{a} -> {b}" for a, b in calls if RANK[b] <= RANK[a])
    assert not up, f"a batch walk calls up the layers: {up}"
    assert {("cli", "session"), ("session", "data"), ("session", "schedule")} <= set(calls), calls
