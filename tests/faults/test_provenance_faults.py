"""The provenance sidecar (``PREFIX.prov``) under faults: ``preprocess`` killed while it
republishes a dataset, a sidecar left beside data it does not describe, and a blocklist
applied to a shard edited since it was preprocessed. Each ends in no sidecar or a refusal,
never in records named wrong (which would delete the wrong data)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext import cli
from megatron_ext.common.io import KILL_AT_STEP_ENV
from megatron_ext.common.records.provenance import SUFFIX, open_sidecar
from megatron_ext.data.corpus import write_tiny_corpus
from megatron_ext.data.tokenizer import train_bpe_tokenizer
from tests.support.faults import fault
from tests.support.harness import REPO


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Two corpora with ids, a tokenizer, and the "old" one preprocessed with its sidecar."""
    root = tmp_path_factory.mktemp("provenance-faults")
    old = write_tiny_corpus(root / "old.jsonl", num_docs=40, seed=1, ids=True)
    new = write_tiny_corpus(root / "new.jsonl", num_docs=50, seed=2, ids=True)
    texts = (json.loads(line)["text"] for line in old.read_text().splitlines())
    tokenizer = train_bpe_tokenizer(texts, root / "tok", vocab_size=400)
    prefix = root / "ds" / "d"
    assert cli.main(_preprocess(old, prefix, tokenizer)) == 0
    return {"root": root, "old": old, "new": new, "tokenizer": tokenizer, "prefix": prefix}


def _preprocess(corpus: Path, prefix: Path, tokenizer: Path) -> list[str]:
    return [
        "preprocess",
        "--input",
        str(corpus),
        "--output-prefix",
        str(prefix),
        "--tokenizer-dir",
        str(tokenizer),
        "--provenance-key",
        "id",
    ]


@fault(
    "`preprocess` republishing a dataset killed (kill -9) while it publishes the new pair",
    "the old sidecar is removed first: the prefix is never left with a sidecar of another "
    ".idx; a rerun publishes the new pair and its sidecar",
    area="provenance",
)
def test_a_kill_while_publishing_leaves_no_sidecar_of_the_other_pair(data, tmp_path) -> None:
    prefix = shutil.copytree(data["prefix"].parent, tmp_path / "killed") / "d"
    document = f"{prefix}_text_document"
    assert Path(document + SUFFIX).is_file()
    # Killed at the publish's second step: the new .bin in place, no .idx yet (the first
    # step's state differs only in the .bin: test_data_faults.py covers the pair).
    env = {**os.environ, "PYTHONPATH": str(REPO), KILL_AT_STEP_ENV: "2"}
    command = [sys.executable, "-m", "megatron_ext.cli"]
    command += _preprocess(data["new"], prefix, data["tokenizer"])
    killed = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not Path(document + SUFFIX).exists()
    assert cli.main(_preprocess(data["new"], prefix, data["tokenizer"])) == 0
    provenance = open_sidecar(document, checked=False)
    assert provenance is not None and provenance.sequences == 50
    assert provenance.source(49)["id"] == "tiny-00049"
    assert provenance.files[0]["path"] == str(data["new"])


@fault(
    "a provenance sidecar beside a dataset it does not describe (restored from a backup, "
    "copied along, left by a tool that rewrote the .idx)",
    "refused by every reader (lookup, provenance show): its .idx identity (sequences, size, "
    "SHA-256) differs; the message says to rebuild it",
    area="provenance",
)
def test_a_sidecar_of_another_idx_is_refused(data, tmp_path, capsys) -> None:
    prefix = tmp_path / "d"
    assert cli.main(_preprocess(data["new"], prefix, data["tokenizer"])) == 0
    document = f"{prefix}_text_document"
    shutil.copy(f"{data['prefix']}_text_document{SUFFIX}", document + SUFFIX)
    capsys.readouterr()
    assert cli.main(["provenance", "show", "--dataset", document, "--document", "3"]) == 1
    err = capsys.readouterr().err
    assert "describes another .idx (40 sequences" in err and "(50 sequences" in err
    assert "megatron-ext provenance rebuild" in err


@fault(
    "`blocklist apply` on a shard edited after it was preprocessed (a record added, removed "
    "or changed)",
    "refused before anything is written: the shard's size or sampled fingerprint differs from "
    "the sidecar's, or a named line no longer starts at its byte or holds its id",
    area="provenance",
)
def test_a_blocklist_is_not_applied_to_a_changed_shard(data, tmp_path, capsys) -> None:
    provenance = open_sidecar(f"{data['prefix']}_text_document", checked=False)
    shard = tmp_path / "old.jsonl"
    shutil.copy(data["old"], shard)
    blocklist = tmp_path / "bad.jsonl"
    entry = {"document": 5, "source": provenance.source(5) | {"file": str(shard)}}
    blocklist.write_text(json.dumps(entry) + "\n")
    apply = ["blocklist", "apply", "--blocklist", str(blocklist), "--out-dir"]
    lines = shard.read_text().splitlines(keepends=True)
    for edited in (lines[1:], [lines[1], lines[0], *lines[2:]]):  # one removed; two swapped
        shard.write_text("".join(edited))
        assert cli.main([*apply, str(tmp_path / "out")]) == 1
        err = capsys.readouterr().err
        assert "is not the one that was preprocessed" in err, err
        assert not (tmp_path / "out").exists()
    shard.write_text("".join(lines))
    assert cli.main([*apply, str(tmp_path / "out")]) == 0
    assert "removed 1 of 40 records (lines 6)" in capsys.readouterr().out
