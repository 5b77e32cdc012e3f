"""Parquet shards, as pretraining corpora ship (FineWeb, DCLM): ``preprocess`` reads them with
pyarrow into the same ``.bin``/``.idx`` as the same records in JSONL; the sidecar names each
document's shard, row group and row; ``provenance rebuild`` writes the same sidecar for a
Parquet-built dataset; ``blocklist apply`` writes a Parquet copy without the named rows, and
the lookup names the row through megatron-core's own datasets.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_ext import cli
from megatron_ext.common.records.provenance import SUFFIX, open_sidecar, place
from megatron_ext.data.corpus import write_tiny_corpus
from megatron_ext.data.tokenizer import train_bpe_tokenizer
from megatron_ext.lookup import cli as lookup_cli

GROUP_ROWS = 7  # rows per row group: 24 rows make groups of 7, 7, 7, 3


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """24 records (one with empty text) as JSONL and as Parquet, a tokenizer, both datasets."""
    root = tmp_path_factory.mktemp("parquet")
    jsonl = write_tiny_corpus(root / "raw" / "shard.jsonl", num_docs=24, seed=5, ids=True)
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    rows[10]["text"] = ""  # preprocess skips it in both formats
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = pa.table({"id": [r["id"] for r in rows], "text": [r["text"] for r in rows]})
    table = table.append_column("score", pa.array(np.arange(24, dtype=np.float32)))
    parquet = root / "raw" / "shard.parquet"
    pq.write_table(table, parquet, row_group_size=GROUP_ROWS)
    tokenizer = train_bpe_tokenizer((r["text"] for r in rows), root / "tok", vocab_size=300)
    prefixes = {}
    for name, shard in (("j", jsonl), ("p", parquet)):
        command = ["preprocess", "--input", str(shard), "--output-prefix", str(root / name)]
        assert (
            cli.main([*command, "--tokenizer-dir", str(tokenizer), "--provenance-key", "id"]) == 0
        )
        prefixes[name] = f"{root / name}_text_document"
    return {"root": root, "rows": rows, "parquet": parquet, "tok": tokenizer, **prefixes}


def test_parquet_tokenizes_like_jsonl_and_the_sidecar_names_row_group_and_row(
    corpus: dict,
) -> None:
    jsonl, parquet = IndexedDataset(corpus["j"]), IndexedDataset(corpus["p"])
    assert len(parquet) == len(jsonl) == 23
    assert all(parquet[d].tolist() == jsonl[d].tolist() for d in range(23))
    provenance = open_sidecar(corpus["p"], checked=True)
    assert provenance is not None and provenance.files[0]["row_groups"] == [7, 7, 7, 3]
    for document in range(23):
        row = document + (document >= 10)  # row 10 had no text
        source = provenance.source(document)
        assert source["format"] == "parquet" and source["file"] == str(corpus["parquet"])
        assert (source["row"], source["row_group"]) == (row, row // GROUP_ROWS)
        assert source["group_row"] == row % GROUP_ROWS
        assert source["id"] == corpus["rows"][row]["id"]
    assert place(provenance.source(12)) == f"{corpus['parquet']} row 13 (row group 1, row 6)"


def test_rebuild_of_a_parquet_built_dataset_equals_what_preprocess_wrote(
    corpus: dict, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    sidecar = Path(corpus["p"] + SUFFIX)
    written = sidecar.read_bytes()
    rebuild = ["provenance", "rebuild", "--dataset", corpus["p"], "--provenance-key", "id"]
    rebuild += ["--tokenizer-dir", str(corpus["tok"]), "--input", str(corpus["parquet"])]
    sidecar.unlink()
    try:
        assert cli.main([*rebuild, "--verify", "100"]) == 0
        assert "23 of its 23 documents with tokens re-tokenised" in capsys.readouterr().out
        assert sidecar.read_bytes() == written
    finally:
        sidecar.write_bytes(written)
    # Rows in another order: the re-tokenised documents differ, refused, nothing written.
    table = pq.read_table(corpus["parquet"])
    shuffled = tmp_path / "shuffled.parquet"
    pq.write_table(table.take(np.random.default_rng(1).permutation(24)), shuffled)
    assert cli.main([*rebuild[:-1], str(shuffled)]) == 1
    assert "their order or the tokenizer differ" in capsys.readouterr().err
    assert sidecar.read_bytes() == written
    assert cli.main([*rebuild[:-2], "--json-key", "body", "--input", str(shuffled)]) == 1
    assert "no column 'body'" in capsys.readouterr().err


def test_preprocess_names_a_missing_column(corpus: dict, capsys: pytest.CaptureFixture) -> None:
    command = ["preprocess", "--input", str(corpus["parquet"]), "--json-keys", "content"]
    command += ["--output-prefix", str(corpus["root"] / "x"), "--tokenizer-dir", str(corpus["tok"])]
    assert cli.main(command) == 1
    err = capsys.readouterr().err
    assert "no column 'content'" in err and "['id', 'text', 'score']" in err


def test_blocklist_apply_writes_parquet_without_the_rows_and_refuses_another_shard(
    corpus: dict, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    provenance = open_sidecar(corpus["p"], checked=True)
    blocked = [0, 9, 10, 22]  # rows 0, 9, 11, 23: three row groups
    blocklist = tmp_path / "bad.jsonl"
    blocklist.write_text(
        "".join(
            json.dumps({"dataset_path": corpus["p"], "document": d, "source": provenance.source(d)})
            + "\n"
            for d in blocked
        )
    )
    apply = ["blocklist", "apply", "--blocklist", str(blocklist), "--out-dir"]
    assert cli.main([*apply, str(tmp_path / "out")]) == 0
    assert "removed 4 of 24 records" in capsys.readouterr().out
    original = pq.read_table(corpus["parquet"])
    filtered = pq.ParquetFile(tmp_path / "out" / "shard.parquet")
    assert filtered.schema_arrow == original.schema
    kept = [r for r in range(24) if r not in {0, 9, 11, 23}]
    assert filtered.read().to_pylist() == original.take(kept).to_pylist()
    assert [filtered.metadata.row_group(g).num_rows for g in range(4)] == [6, 5, 7, 2]
    # The same size and sampled fingerprint but another row there: refused by its id.
    swapped = tmp_path / "swapped"
    swapped.mkdir()
    ids = original.column("id").to_pylist()
    ids[9], ids[8] = ids[8], ids[9]
    changed = original.set_column(0, "id", pa.array(ids))
    pq.write_table(changed, swapped / "shard.parquet", row_group_size=GROUP_ROWS)
    root = ["--data-root", f"{corpus['parquet'].parent}={swapped}"]
    assert cli.main([*apply, str(tmp_path / "out2"), *root]) == 1
    err = capsys.readouterr().err
    assert "is not the one that was preprocessed" in err or "not the blocked 'tiny-00009'" in err
    assert not (tmp_path / "out2").exists()


def test_the_lookup_names_the_parquet_row_of_each_document(
    corpus: dict, capsys: pytest.CaptureFixture
) -> None:
    flags = ["--data-path", corpus["p"], "--split", "100,0,0", "--seq-length", "16"]
    flags += ["--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3"]
    flags += ["--seed", "3", "--data-cache-path", str(corpus["root"] / "cache")]
    flags += ["--tokenizer-type", "NullTokenizer", "--vocab-size", "300", "--rebuild-caches"]
    flags += ["--data-parallel-size", "1"]
    assert lookup_cli.main([*flags, "--iteration", "2", "--json"]) == 0
    samples = json.loads(capsys.readouterr().out)["samples"]
    documents = [d for s in samples for d in s["documents"]]
    assert documents
    for document in documents:
        row = document["document"] + (document["document"] >= 10)
        source = document["source"]
        assert (source["row"], source["row_group"]) == (row, row // GROUP_ROWS)
        assert source["id"] == corpus["rows"][row]["id"]
    assert lookup_cli.main([*flags, "--iteration", "2"]) == 0
    assert f"from: {place(documents[0]['source'])} (id " in capsys.readouterr().out


def test_a_damaged_row_group_is_refused_naming_the_shard(
    corpus: dict, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    damaged = tmp_path / "damaged.parquet"
    pq.write_table(pq.read_table(corpus["parquet"]), damaged, row_group_size=GROUP_ROWS)
    chunk = pq.ParquetFile(damaged).metadata.row_group(2).column(1)  # row group 2's text
    data = bytearray(damaged.read_bytes())
    start = (chunk.dictionary_page_offset or chunk.data_page_offset) + 16
    data[start : start + 32] = bytes(b ^ 0xFF for b in data[start : start + 32])
    damaged.write_bytes(data)
    out = tmp_path / "out"
    command = ["preprocess", "--input", str(damaged), "--output-prefix", str(out / "d")]
    assert cli.main([*command, "--tokenizer-dir", str(corpus["tok"])]) == 1
    err = capsys.readouterr().err
    assert f"{damaged}: row group 2 cannot be read" in err and "Free space" not in err
    assert list(out.iterdir()) == []
    rebuild = ["provenance", "rebuild", "--dataset", corpus["p"], "--input", str(damaged)]
    assert cli.main([*rebuild, "--tokenizer-dir", str(corpus["tok"])]) == 1
    assert f"{damaged}: row group 2 cannot be read" in capsys.readouterr().err
