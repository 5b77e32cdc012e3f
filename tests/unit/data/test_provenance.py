"""Provenance through preprocessing: ``megatron-ext preprocess`` writes each document's raw
record (file, line, byte, id) beside the pair; ``provenance rebuild`` writes the same for data
built by megatron-core's ``IndexedDatasetBuilder`` as Megatron's ``preprocess_data.py`` uses it,
verified by re-tokenising against the ``.bin`` (a shuffled input is refused); ``blocklist
apply`` writes the shards without the named records, never in place.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder

from megatron_ext import cli
from megatron_ext.common.records.provenance import SUFFIX, ProvenanceError, open_sidecar
from megatron_ext.data.corpus import write_tiny_corpus
from megatron_ext.data.tokenizer import load_tokenizer, train_bpe_tokenizer


def _records(path: Path) -> list[tuple[int, int, dict]]:
    """(line, byte offset, record) of every non-blank line."""
    out, offset = [], 0
    for number, line in enumerate(path.read_bytes().splitlines(keepends=True), 1):
        if line.strip():
            out.append((number, offset, json.loads(line)))
        offset += len(line)
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Two shards with ids, blank lines and empty texts, a tokenizer, a preprocessed dataset."""
    root = tmp_path_factory.mktemp("provenance")
    shards = [
        write_tiny_corpus(root / "a.jsonl", num_docs=30, seed=1, ids=True),
        write_tiny_corpus(root / "b.jsonl", num_docs=20, seed=2, ids=True),
    ]
    lines = shards[0].read_text().splitlines(keepends=True)
    lines[4:4] = ["\n", json.dumps({"text": "", "id": 7001}) + "\n"]  # a blank line, no text
    shards[0].write_text("".join(lines))
    tokenizer = train_bpe_tokenizer(
        (r["text"] for s in shards for _, _, r in _records(s)), root / "tok", vocab_size=400
    )
    prefix = root / "out" / "c"
    command = ["preprocess", "--input", *map(str, shards), "--output-prefix", str(prefix)]
    command += ["--tokenizer-dir", str(tokenizer), "--provenance-key", "id"]
    assert cli.main(command) == 0
    return {
        "root": root,
        "shards": shards,
        "tokenizer": tokenizer,
        "prefix": f"{prefix}_text_document",
    }


def test_preprocess_names_every_documents_raw_record(corpus: dict) -> None:
    provenance = open_sidecar(corpus["prefix"], checked=False)
    assert provenance is not None and provenance.id_key == "id"
    dataset = IndexedDataset(corpus["prefix"])
    tokenizer = load_tokenizer(corpus["tokenizer"])
    kept = [(s, *r) for s in corpus["shards"] for r in _records(s) if r[2]["text"].strip()]
    assert provenance.sequences == len(dataset) == len(kept) == 50
    for document, (shard, line, byte, record) in enumerate(kept):
        source = provenance.source(document)
        assert (source["file"], source["line"], source["byte"]) == (str(shard), line, byte)
        assert source["id"] == str(record["id"])
        assert dataset[document].tolist() == [*tokenizer.encode(record["text"]), tokenizer.eod_id]
    assert provenance.source(4)["line"] == 7  # after the blank line and the empty text


def test_a_rerun_without_provenance_leaves_no_stale_sidecar(corpus: dict, tmp_path: Path) -> None:
    prefix = tmp_path / "c"
    base = ["preprocess", "--input", str(corpus["shards"][1]), "--output-prefix", str(prefix)]
    base += ["--tokenizer-dir", str(corpus["tokenizer"])]
    assert cli.main(base) == 0
    sidecar = Path(f"{prefix}_text_document{SUFFIX}")
    assert open_sidecar(f"{prefix}_text_document", checked=False).id_key is None  # no ids
    kept = sidecar.read_bytes()
    assert cli.main([*base, "--no-provenance"]) == 0
    assert not sidecar.exists()
    sidecar.write_bytes(kept)  # the rerun wrote the same .idx: the sidecar still describes it
    assert open_sidecar(f"{prefix}_text_document", checked=False) is not None
    shutil.copy(corpus["prefix"] + SUFFIX, sidecar)  # another dataset's sidecar
    with pytest.raises(ProvenanceError, match=r"describes another \.idx"):
        open_sidecar(f"{prefix}_text_document", checked=True)


def _megatron_build(prefix: Path, shards: list[Path], tokenizer_dir: Path) -> None:
    """What Megatron's tools/preprocess_data.py does (--append-eod): one document per line,
    a line that tokenizes to nothing a document without sequences."""
    tokenizer = load_tokenizer(tokenizer_dir)
    builder = IndexedDatasetBuilder(
        f"{prefix}.bin", dtype=DType.optimal_dtype(tokenizer.vocab_size)
    )
    for shard in shards:
        for _, _, record in _records(shard):
            ids = tokenizer.encode(record["text"])
            lengths = [len(ids) + 1] if ids else []
            builder.add_document([*ids, tokenizer.eod_id] if ids else [], lengths)
    builder.finalize(f"{prefix}.idx")


def test_rebuild_for_megatrons_builder_verifies_and_refuses_a_shuffle(
    corpus: dict, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    shards = [tmp_path / s.name for s in corpus["shards"]]
    for source, copy in zip(corpus["shards"], shards):
        shutil.copy(source, copy)
    # Megatron reads every line; a blank one would crash it: drop it.
    shards[0].write_text("".join(x for x in shards[0].read_text().splitlines(True) if x.strip()))
    prefix = tmp_path / "mega_text_document"
    _megatron_build(prefix, shards, corpus["tokenizer"])
    rebuild = ["provenance", "rebuild", "--dataset", str(prefix), "--provenance-key", "id"]
    rebuild += ["--tokenizer-dir", str(corpus["tokenizer"]), "--verify", "1000"]
    assert cli.main([*rebuild, "--input", *map(str, shards)]) == 0
    assert "50 of its 50 documents with tokens re-tokenised" in capsys.readouterr().out
    provenance = open_sidecar(str(prefix), checked=True)
    records = [(s, *r) for s in shards for r in _records(s)]
    dataset = IndexedDataset(str(prefix))
    sequence = 0
    for document, (shard, line, byte, record) in enumerate(records):
        first, last = dataset.document_indices[document : document + 2]
        assert last - first == (1 if record["text"].strip() else 0)
        if last > first:
            source = provenance.source(sequence)
            assert (source["file"], source["line"], source["byte"]) == (str(shard), line, byte)
            assert source["id"] == str(record["id"])
            sequence += 1
    # The same files shuffled, or in another order: refused at the first mismatch.
    original = shards[1].read_text().splitlines(True)
    shuffled = [original[i] for i in np.random.default_rng(3).permutation(len(original))]
    shards[1].write_text("".join(shuffled))
    sidecar = Path(f"{prefix}{SUFFIX}")
    before = sidecar.read_bytes()
    assert cli.main([*rebuild, "--input", *map(str, shards)]) == 1
    err = capsys.readouterr().err
    assert f"of {prefix} (sequence " in err and f"is not {shards[1]}:" in err
    assert "their order or the tokenizer differ" in err and "nothing was written" in err
    assert sidecar.read_bytes() == before
    shards[1].write_text("".join(original))
    assert cli.main([*rebuild, "--input", *map(str, reversed(shards))]) == 1
    assert f"document 0 of {prefix} (sequence 0) is not {shards[1]}:1" in capsys.readouterr().err
    assert cli.main([*rebuild, "--input", str(shards[0])]) == 1
    assert "holds 51 documents, but" in capsys.readouterr().err


def test_blocklist_apply_writes_filtered_copies_and_refuses_a_changed_shard(
    corpus: dict, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    provenance = open_sidecar(corpus["prefix"], checked=False)
    blocked = [0, 4, 33, 49]  # two in each shard
    blocklist = tmp_path / "bad.jsonl"
    entries = [{"dataset_path": corpus["prefix"], "document": d} for d in blocked]
    blocklist.write_text(
        "".join(
            json.dumps(e | {"source": provenance.source(e["document"])}) + "\n" for e in entries
        )
    )
    out = tmp_path / "filtered"
    apply = ["blocklist", "apply", "--blocklist", str(blocklist), "--out-dir"]
    assert cli.main([*apply, str(out), "--dry-run"]) == 0
    assert "removed 4 record(s) from 2 shard(s) (dry run" in capsys.readouterr().out
    assert not out.exists()
    assert cli.main([*apply, str(out)]) == 0
    assert "removed 2 of 31 records" in capsys.readouterr().out  # a.jsonl: 30 + the empty one
    for shard in corpus["shards"]:
        gone = {
            provenance.source(d)["line"]
            for d in blocked
            if provenance.source(d)["file"] == str(shard)
        }
        original = shard.read_bytes().splitlines(keepends=True)
        expected = [line for n, line in enumerate(original, 1) if n not in gone]
        assert (out / shard.name).read_bytes().splitlines(keepends=True) == expected
        assert len(gone) == 2
    # Never in place; a shard changed since it was preprocessed, or moved, is refused.
    assert cli.main([*apply, str(corpus["root"])]) == 2
    assert "never written in place" in capsys.readouterr().err
    moved = tmp_path / "moved"
    shutil.copytree(corpus["root"], moved, ignore=shutil.ignore_patterns("out", "tok"))
    root = ["--data-root", f"{corpus['root']}={moved}"]
    assert cli.main([*apply, str(tmp_path / "f2"), *root]) == 0
    with (moved / "b.jsonl").open("a") as f:
        f.write(json.dumps({"text": "appended", "id": "x"}) + "\n")
    assert cli.main([*apply, str(tmp_path / "f3"), *root]) == 1
    assert "is not the one that was preprocessed" in capsys.readouterr().err
    assert not (tmp_path / "f3").exists()
    entries[0]["source"] = None
    blocklist.write_text("".join(json.dumps(e) + "\n" for e in entries))
    assert cli.main([*apply, str(tmp_path / "f4")]) == 1
    assert "names no raw record" in capsys.readouterr().err
    # A line that is JSON but no entry, or an entry whose source lost a field: refused, named.
    entry = entries[1] | {"source": provenance.source(entries[1]["document"])}
    blocklist.write_text(json.dumps([entry]) + "\n")
    assert cli.main([*apply, str(tmp_path / "f5")]) == 1
    assert f"{blocklist}:1: not a JSON object" in capsys.readouterr().err
    del entry["source"]["file_size"]
    blocklist.write_text(json.dumps(entry) + "\n")
    assert cli.main([*apply, str(tmp_path / "f6")]) == 1
    assert f"{blocklist}:1: its source lacks file_size" in capsys.readouterr().err
    assert not (tmp_path / "f5").exists() and not (tmp_path / "f6").exists()


def test_blocklist_apply_refuses_a_binary_blocklist_and_an_out_dir_that_is_a_file(
    corpus: dict, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    apply = ["blocklist", "apply", "--blocklist"]
    # The sidecar itself passed by mistake: not text.
    assert cli.main([*apply, corpus["prefix"] + SUFFIX, "--out-dir", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert f"{corpus['prefix']}{SUFFIX}: not UTF-8 text" in err and "Traceback" not in err
    provenance = open_sidecar(corpus["prefix"], checked=False)
    blocklist = tmp_path / "bad.jsonl"
    entry = {"dataset_path": corpus["prefix"], "document": 3, "source": provenance.source(3)}
    blocklist.write_text(json.dumps(entry) + "\n")
    taken = tmp_path / "taken"
    taken.write_text("a file")
    assert cli.main([*apply, str(blocklist), "--out-dir", str(taken)]) == 1
    assert f"--out-dir {taken}: cannot write there" in capsys.readouterr().err
    assert taken.read_text() == "a file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "taken"]


def test_a_sidecar_naming_a_shard_it_does_not_list_is_refused(corpus: dict, tmp_path: Path) -> None:
    copy = tmp_path / "c_text_document"
    for ext in (".bin", ".idx", SUFFIX):
        shutil.copy(corpus["prefix"] + ext, f"{copy}{ext}")
    provenance = open_sidecar(str(copy), checked=False)
    column = provenance.shard.offset
    damaged = bytearray(Path(f"{copy}{SUFFIX}").read_bytes())
    damaged[column + 2 * 3] = 7  # one flipped byte: sequence 3 names shard 7 of 2
    Path(f"{copy}{SUFFIX}").write_bytes(damaged)
    provenance = open_sidecar(str(copy), checked=False)
    with pytest.raises(
        ProvenanceError, match=r"is damaged: sequence 3 names file 7, but it lists 2"
    ):
        provenance.source(3)
    assert provenance.source(2)["line"] == 3
