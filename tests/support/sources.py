"""Two real, different text sources for blend runs: the demo's prose and Python's standard
library source code, tokenized with the same BPE (the prose's), as real ``.bin``/``.idx``."""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from itertools import batched, islice
from pathlib import Path

from megatron_ext.data import preprocess
from megatron_ext.data.corpus import write_jsonl, write_tiny_corpus
from megatron_ext.demo import prepare_tiny_dataset

PROSE, CODE = "prose_text_document", "code_text_document"  # the members' names


def write_code_corpus(path: Path, num_docs: int = 400) -> Path:
    """Write the standard library's top-level modules, in name order, as JSONL documents of 30
    lines (depends only on ``num_docs`` and the Python version)."""

    def documents() -> Iterator[dict[str, str]]:
        for module in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
            lines = module.read_text(encoding="utf-8", errors="replace").splitlines()
            for chunk in batched(lines, 30):
                if text := "\n".join(chunk).strip():
                    yield {"text": text}

    return write_jsonl(path, islice(documents(), num_docs))


def prepare_sources(root: Path) -> tuple[dict[str, str], list[str]]:
    """({member name: data prefix}, tokenizer flags); reused when present."""
    _, tokenizer_args = prepare_tiny_dataset(root)
    tokenizer_dir = root / "data" / "tiny_tokenizer"
    prefixes = {name: prepare_source(root, name, tokenizer_dir) for name in (PROSE, CODE)}
    return prefixes, tokenizer_args


def prepare_source(root: Path, name: str, tokenizer_dir: Path) -> str:
    """The data prefix of source ``name`` (PROSE or CODE) under ``root/sources``, tokenized
    with the tokenizer in ``tokenizer_dir``; reused when present."""
    write = {PROSE: write_tiny_corpus, CODE: write_code_corpus}[name]
    stem = name.removesuffix("_text_document")
    prefix = root / "sources" / stem
    if not Path(f"{prefix}_text_document.idx").exists():
        corpus = write(root / "sources" / f"{stem}.jsonl")
        status = preprocess.main(
            [
                *("--input", str(corpus), "--output-prefix", str(prefix)),
                *("--tokenizer-dir", str(tokenizer_dir)),
            ]
        )
        if status != 0:
            raise RuntimeError(f"preprocessing the {stem} source failed")
    return f"{prefix}_text_document"


def blend_args(prefixes: dict[str, str], weights: dict[str, float], cache: Path) -> list[str]:
    """``--data-path W1 P1 W2 P2`` with a shared index cache (all in the train split)."""
    data = [x for name, w in weights.items() for x in (str(w), prefixes[name])]
    return ["--data-path", *data, "--split", "100,0,0", "--data-cache-path", str(cache)]
