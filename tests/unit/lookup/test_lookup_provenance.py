"""The lookup names each document's raw record (shard, line, id) from the provenance sidecar
beside its dataset: for every member of a blend and for per-split data alike, in ``--json``,
the table, the inverse lookup and ``--emit-blocklist``; a sidecar of another ``.idx`` is
refused, never used.

The datasets are megatron-core's own (``IndexedDatasetBuilder``, caches built by
``BlendedMegatronDatasetBuilder``, as in test_lookup_datasets.py); each prefix gets a JSONL
shard whose line ``k + 1`` is document ``k`` (id ``d<p>-<k>``) and a sidecar saying so.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from megatron_ext.common.records.provenance import SUFFIX, shard_entry, write_sidecar
from megatron_ext.lookup import cli
from tests.unit.lookup.test_lookup_datasets import _documents, _flags, _write_prefix


def _shard_and_sidecar(prefix: str, documents: int, name: str) -> Path:
    """A shard ``name.jsonl`` with one record per document (ids ``name-k``) and the sidecar."""
    shard = Path(prefix).parent / f"{name}.jsonl"
    lines = [
        json.dumps({"id": f"{name}-{k}", "text": f"record {k}"}) + "\n" for k in range(documents)
    ]
    shard.write_text("".join(lines))
    offsets = np.concatenate(([0], np.cumsum([len(line) for line in lines])[:-1]))
    blob = "".join(f"{name}-{k}" for k in range(documents)).encode()
    ends = np.cumsum([len(f"{name}-{k}") for k in range(documents)])
    write_sidecar(
        prefix + SUFFIX,
        prefix + ".idx",
        files=[shard_entry(shard)],
        id_key="id",
        columns=(np.zeros(documents), np.arange(1, documents + 1), offsets),
        ids=(ends, blob),
        checked=False,
    )
    return shard


@pytest.fixture
def blend(tmp_path: Path) -> tuple[Path, list[str], list[Path]]:
    rng = np.random.default_rng(7)
    prefixes = [_write_prefix(tmp_path / "data" / f"d{p}", _documents(rng, 60)) for p in range(3)]
    shards = [_shard_and_sidecar(prefix, 60, f"d{p}") for p, prefix in enumerate(prefixes)]
    return tmp_path, prefixes, shards


def _expected(record: dict, shards: list[Path]) -> None:
    """Every document of a lookup record names line document + 1 of its member's shard."""
    for document in record["documents"]:
        source = document["source"]
        member = record["dataset"]
        assert source["file"] == str(shards[member].absolute())
        assert source["line"] == document["document"] + 1
        assert source["id"] == f"d{member}-{document['document']}"


@pytest.mark.parametrize("per_split", [False, True])
def test_blend_and_per_split_lookups_name_raw_records(blend, capsys, per_split: bool) -> None:
    root, prefixes, shards = blend
    flags = _flags(root, prefixes)
    if per_split:  # the same blend as --train-data-path: no --split
        at = flags.index("--split")
        flags = ["--train-data-path", *flags[1:at], *flags[at + 2 :]]
    flags += ["--rebuild-caches"]
    blocklist = root / "block.jsonl"
    assert cli.main([*flags, "--iteration", "4", "--json", "--emit-blocklist", str(blocklist)]) == 0
    captured = capsys.readouterr()
    assert "each names its raw record" in captured.err
    samples = json.loads(captured.out)["samples"]
    assert len({s["dataset"] for s in samples}) == 3, "the batch must read every member"
    for sample in samples:
        _expected(sample, shards)
    blocked = [json.loads(line) for line in blocklist.read_text().splitlines()]
    documents = {(s["dataset_path"], d["document"]) for s in samples for d in s["documents"]}
    assert {(b["dataset_path"], b["document"]) for b in blocked} == documents
    for entry in blocked:
        member = prefixes.index(entry["dataset_path"])
        assert entry["source"]["line"] == entry["document"] + 1
        assert entry["source"]["id"] == f"d{member}-{entry['document']}"
    # The table names them too, and the inverse lookup says where its document came from.
    assert cli.main([*flags, "--iteration", "4", "--dp-rank", "0"]) == 0
    table = capsys.readouterr().out
    first = samples[0]["documents"][0]["source"]
    assert f"    from: {first['file']}:{first['line']} (id {first['id']})" in table
    document = samples[0]["documents"][0]["document"]
    dataset = Path(samples[0]["dataset_path"]).name
    inverse = [*flags, "--document", str(document), "--dataset", dataset, "--json"]
    assert cli.main(inverse) == 0
    assert json.loads(capsys.readouterr().out)["source"] == samples[0]["documents"][0]["source"]


def test_a_sidecar_of_another_idx_is_refused_and_none_is_said(blend, capsys) -> None:
    root, prefixes, _ = blend
    flags = [*_flags(root, prefixes), "--rebuild-caches", "--iteration", "4", "--json"]
    assert cli.main(flags) == 0
    capsys.readouterr()
    stale = Path(prefixes[1] + SUFFIX)
    kept = stale.read_bytes()
    rng = np.random.default_rng(99)
    other = root / "other"
    _write_prefix(other, _documents(rng, 60))
    _shard_and_sidecar(str(other), 60, "other")
    stale.write_bytes(Path(str(other) + SUFFIX).read_bytes())  # another .idx's sidecar
    assert cli.main(flags) == 1
    err = capsys.readouterr().err
    assert f"{prefixes[1]}.prov describes another .idx" in err and "provenance rebuild" in err
    stale.write_bytes(kept[:-3])  # truncated
    assert cli.main(flags) == 1
    assert "cut or appended to" in capsys.readouterr().err
    stale.unlink()  # no sidecar: answered, the documents of d1 name no raw record
    blocklist = root / "block.jsonl"
    assert cli.main([*flags, "--emit-blocklist", str(blocklist)]) == 0
    captured = capsys.readouterr()
    samples = json.loads(captured.out)["samples"]
    member1 = [d for s in samples if s["dataset"] == 1 for d in s["documents"]]
    assert member1 and all(d["source"] is None for d in member1)
    assert f"no provenance sidecar beside {prefixes[1]}" in captured.err
