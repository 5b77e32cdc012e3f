"""From a bad batch to the raw record: the real-shaped drill (tests/support/drill.py) trains on
the tiny corpus preprocessed with ids (``preprocess --provenance-key id``, as
``prepare_tiny_dataset`` does), the incident report names the raw lines of the culprit
documents, and the blocklist it suggests, applied to the raw shard, writes a copy that lacks
exactly those lines.

No training of its own: it reads the session's real-shaped drill (shared with
test_spike_drill.py, tests/conftest.py) and adds one lookup and one filter.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

EOD = "<|endoftext|>"


def _run(command: str, **replace: str) -> subprocess.CompletedProcess[str]:
    """A ``megatron-ext ...`` command the report suggests, with some flags' values replaced
    (outputs go to the test's directory, not into the shared drill's)."""
    args = command.split()
    for flag, value in replace.items():
        args[args.index(flag) + 1] = value
    assert args[0] == "megatron-ext"
    return subprocess.run(
        [sys.executable, "-m", "megatron_ext.cli", *args[1:]], capture_output=True, text=True
    )


def test_the_report_names_raw_lines_and_the_filtered_shard_lacks_exactly_them(
    real_shaped: dict, data_args: list[str], tmp_path: Path
) -> None:
    incidents = real_shaped["work"] / "ckpt" / "megatron_ext_incidents"
    report = json.loads((incidents / "incident-001.json").read_text())
    markdown = (incidents / "incident-001.md").read_text()
    corpus = Path(data_args[data_args.index("--data-path") + 1]).parent / "corpus.jsonl"
    raw = corpus.read_bytes().splitlines(keepends=True)
    culprits: dict[int, dict] = {}
    for sample in report["top_documents"]:
        assert sample["dp_rank"] == 1 and sample["trained_tokens_differ"]
        for document in sample["documents"]:
            source = document["source"]
            record = json.loads(raw[source["line"] - 1])
            assert source["file"] == str(corpus.resolve()) and record["id"] == source["id"]
            assert f"from {source['file']}:{source['line']} (id {source['id']})" in markdown
            culprits[source["line"]] = record
    assert len(culprits) >= 4, "the top 4 samples read at least 4 documents"

    # The blocklist the report suggests: each entry's decoded document is its raw record.
    blocklist = tmp_path / "blocklist.jsonl"
    emitted = _run(report["blocklist_command"], **{"--emit-blocklist": str(blocklist)})
    assert emitted.returncode == 0, emitted.stderr[-3000:]
    assert "each names its raw record" in emitted.stderr
    entries = [json.loads(line) for line in blocklist.read_text().splitlines()]
    assert {e["source"]["line"] for e in entries} == set(culprits)
    for entry in entries:
        assert entry["text"].removesuffix(EOD) == culprits[entry["source"]["line"]]["text"]

    # Applied to the raw shard, as the report says: a filtered copy without exactly them.
    assert "Then write the raw shards without their records" in markdown
    out = tmp_path / "filtered"
    applied = _run(
        report["apply_command"], **{"--blocklist": str(blocklist), "--out-dir": str(out)}
    )
    assert applied.returncode == 0, applied.stderr
    assert f"removed {len(culprits)} record(s) from 1 shard(s)" in applied.stdout
    kept = [line for number, line in enumerate(raw, 1) if number not in culprits]
    assert (out / "corpus.jsonl").read_bytes().splitlines(keepends=True) == kept
    assert corpus.read_bytes().splitlines(keepends=True) == raw  # never in place
