"""End-to-end checks of ``megatron-ext preprocess`` against megatron-core's own readers.

The dataset is read back with Megatron's ``IndexedDataset`` and the tokenizer is loaded through
Megatron's ``build_tokenizer`` from parsed training arguments, so a format or id mismatch with
what pretraining will see fails here rather than in a training run.
"""

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"  # read by huggingface_hub at import: set before Megatron
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from megatron_ext.data.corpus import write_tiny_corpus
from megatron_ext.data.preprocess import main
from megatron_ext.data.tokenizer import load_tokenizer, megatron_tokenizer_args

# Two empty documents (skipped) and two that stress byte-level round trips.
EXTRA_DOCS = [
    "",
    "Unicode survives: naïve café — 東京 🚀.",
    "   ",
    "Tabs\tand\nnewlines  kept .",
]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Corpus with empty documents mixed in, a trained tokenizer, and a 2-worker dataset."""
    root = tmp_path_factory.mktemp("prep")
    corpus = write_tiny_corpus(root / "corpus.jsonl", num_docs=150, seed=7)
    texts = [json.loads(line)["text"] for line in corpus.read_text(encoding="utf-8").splitlines()]
    texts[10:10] = EXTRA_DOCS
    with corpus.open("w", encoding="utf-8") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"text": text, "id": i}, ensure_ascii=False) + "\n")
            if i == 3:
                f.write("\n")  # blank lines are not documents
    prefix = root / "out" / "tiny"
    rc = main(
        [
            "--input",
            str(corpus),
            "--output-prefix",
            str(prefix),
            "--train-tokenizer",
            "--vocab-size",
            "1024",
            "--workers",
            "2",
            "--chunksize",
            "8",
        ]
    )
    assert rc == 0
    return {
        "corpus": corpus,
        "texts": texts,
        "prefix": prefix,
        "tokenizer_dir": root / "out" / "tiny_tokenizer",
    }


def test_dataset_matches_input(prepared: dict) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    tokenizer = load_tokenizer(prepared["tokenizer_dir"])
    kept = [t for t in prepared["texts"] if t.strip()]
    dataset = IndexedDataset(str(prepared["prefix"]) + "_text_document")
    assert len(dataset) == len(kept) == len(prepared["texts"]) - 2
    assert dataset.index.dtype == np.uint16  # DType.optimal_dtype for a < 65500 vocab
    np.testing.assert_array_equal(dataset.document_indices, np.arange(len(kept) + 1))
    for i, text in enumerate(kept):
        ids = dataset[i].tolist()
        assert ids[-1] == tokenizer.eod_id
        assert tokenizer.eod_id not in ids[:-1]
        assert ids[:-1] == tokenizer.encode(text)
        assert tokenizer.decode(ids) == text


def test_megatron_loads_the_same_tokenizer(prepared: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training.arguments import parse_args

    ours = load_tokenizer(prepared["tokenizer_dir"])
    argv = ["pretrain_gpt.py", *megatron_tokenizer_args(prepared["tokenizer_dir"])]
    monkeypatch.setattr(sys, "argv", argv)
    args = parse_args()  # exactly how training parses --tokenizer-type/--tokenizer-model
    theirs = build_tokenizer(args)

    assert theirs.eod == ours.eod_id
    assert theirs.vocab_size == ours.vocab_size
    assert args.padded_vocab_size % args.make_vocab_size_divisible_by == 0
    assert args.padded_vocab_size >= ours.vocab_size
    for text in prepared["texts"][:20] + EXTRA_DOCS[1:]:
        ids = theirs.tokenize(text)
        assert ids == ours.encode(text)
        assert theirs.detokenize(ids) == text


def test_one_and_two_workers_write_identical_files(prepared: dict, tmp_path: Path) -> None:
    prefix = tmp_path / "new_dir" / "single"  # output dirs are created on demand
    rc = main(
        [
            "--input",
            str(prepared["corpus"]),
            "--output-prefix",
            str(prefix),
            "--tokenizer-dir",
            str(prepared["tokenizer_dir"]),
            "--workers",
            "1",
        ]
    )
    assert rc == 0
    for ext in (".bin", ".idx"):
        single = Path(f"{prefix}_text_document{ext}").read_bytes()
        assert single == Path(f"{prepared['prefix']}_text_document{ext}").read_bytes()


def _run_expecting_error(tmp_path: Path, lines: list[str], *extra: str) -> str:
    """Run on ``lines``; assert failure and that nothing but the input is left behind."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n", encoding="utf-8")
    prefix = tmp_path / "bad"
    rc = main(["--input", str(bad), "--output-prefix", str(prefix), *extra])
    assert rc == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"], "partial output left"
    return str(bad)


def test_malformed_json_names_the_line(
    prepared: dict, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    lines = [json.dumps({"text": f"document {i}"}) for i in range(40)]
    lines[30] = '{"text": "unterminated'
    bad = _run_expecting_error(
        tmp_path,
        lines,
        "--workers",
        "2",
        "--chunksize",
        "4",
        "--tokenizer-dir",
        str(prepared["tokenizer_dir"]),
    )
    assert f"{bad}:31: malformed JSON" in capsys.readouterr().err


def test_malformed_json_before_training_leaves_no_tokenizer(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    bad = _run_expecting_error(tmp_path, ['{"text": "ok"}', "not json"], "--train-tokenizer")
    assert f"{bad}:2: malformed JSON" in capsys.readouterr().err


def test_missing_key(prepared: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bad = _run_expecting_error(
        tmp_path,
        ['{"text": "ok"}', '{"body": "no text"}'],
        "--tokenizer-dir",
        str(prepared["tokenizer_dir"]),
    )
    err = capsys.readouterr().err
    assert f"{bad}:2: missing key 'text'" in err and "--json-keys" in err


def test_missing_input_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rc = main(
        [
            "--input",
            str(tmp_path / "nope.jsonl"),
            "--output-prefix",
            str(tmp_path / "x"),
            "--train-tokenizer",
        ]
    )
    assert rc == 1
    assert "nope.jsonl" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_lone_surrogate_names_the_line(
    prepared: dict, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # Valid JSON that no UTF-8 tokenizer (nor the sidecar's id column) can take.
    tokenizer = ["--tokenizer-dir", str(prepared["tokenizer_dir"])]
    bad = _run_expecting_error(tmp_path, ['{"text": "ok"}', '{"text": "cut \\ud83d"}'], *tokenizer)
    err = capsys.readouterr().err
    assert f"{bad}:2: 'text' is not valid Unicode" in err and "Traceback" not in err
    lines = ['{"text": "ok", "id": "a\\udc80"}']
    bad = _run_expecting_error(tmp_path, lines, *tokenizer, "--provenance-key", "id")
    assert f"{bad}:1: 'id' is not valid Unicode" in capsys.readouterr().err
    _run_expecting_error(tmp_path, ['{"text": "cut \\ud83d"}'], "--train-tokenizer")
    assert f"{bad}:1: 'text' is not valid Unicode" in capsys.readouterr().err


def test_a_damaged_tokenizer_dir_is_refused(
    prepared: dict, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    damaged = tmp_path / "tok"
    damaged.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (damaged / name).write_bytes((prepared["tokenizer_dir"] / name).read_bytes())
    (damaged / "tokenizer.json").write_text('{"truncated": ')
    argv = ["--input", str(prepared["corpus"]), "--output-prefix", str(tmp_path / "d")]
    assert main([*argv, "--tokenizer-dir", str(damaged)]) == 1
    err = capsys.readouterr().err
    assert f"{damaged / 'tokenizer.json'} is not a readable tokenizer" in err
    (damaged / "tokenizer.json").write_bytes(
        (prepared["tokenizer_dir"] / "tokenizer.json").read_bytes()
    )
    (damaged / "tokenizer_config.json").write_text("not json")
    assert main([*argv, "--tokenizer-dir", str(damaged)]) == 1
    assert f"{damaged / 'tokenizer_config.json'} is not valid JSON" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tok"]


def test_a_repeated_json_key_or_a_file_as_tokenizer_out_is_refused(
    prepared: dict, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    argv = ["--input", str(prepared["corpus"]), "--output-prefix", str(tmp_path / "d")]
    tokenizer = ["--tokenizer-dir", str(prepared["tokenizer_dir"])]
    # Each document would be written twice into the one dataset of the key.
    assert main([*argv, *tokenizer, "--json-keys", "text", "text"]) == 1
    assert "--json-keys names 'text' twice" in capsys.readouterr().err
    taken = tmp_path / "taken"
    taken.write_text("a file, not a directory")
    assert main([*argv, "--train-tokenizer", "--tokenizer-out", str(taken)]) == 1
    assert f"{taken}, where --train-tokenizer saves the tokenizer" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]
