"""The incident report names each top document's raw record (shard, line, id) when the lookup
found a provenance sidecar, and the command that writes the shards without them; without a
sidecar it says how to get one. (The e2e drill: tests/e2e/test_provenance_drill.py.)"""

from __future__ import annotations

from pathlib import Path

from megatron_ext.incidents.planner import PlanConfig, make_plan
from megatron_ext.incidents.report import build_report
from tests.unit.incidents.test_causes import ONSET, _incident, _run


def _sample(rank: int, source: dict | None) -> dict:
    return {
        "rank_by_loss": rank,
        "loss": 9.0 - rank,
        "dp_rank": 1,
        "microbatch": 0,
        "sample_index": 40 + rank,
        "dataset_path": "/data/web_text_document",
        "documents": [{"document": 80 + rank, "offset": 0, "count": 65, "source": source}],
        "text": "garbage",
    }


def test_the_report_names_raw_records_and_the_apply_command(tmp_path: Path) -> None:
    records = _run()
    ledger = [_incident("spike"), _incident()]
    plan = make_plan(ledger, records, [ONSET - 200], [], PlanConfig(), None, str(tmp_path))
    report = build_report(plan, ledger, records, tmp_path, 1, worst=None)
    report.lookup_error = None
    source = {"file": "/corpus/web/shard-07.jsonl", "line": 1234, "id": "web-991"}
    report.documents = [_sample(1, source), _sample(2, source | {"line": 9, "id": None})]
    text = report.markdown()
    assert (
        "web_text_document doc 81 (tokens 0+65) from /corpus/web/shard-07.jsonl:1234 (id web-991)"
        in text
    )
    assert "doc 82 (tokens 0+65) from /corpus/web/shard-07.jsonl:9 |" in text
    blocklist = tmp_path / "megatron_ext_incidents" / "incident-001-blocklist.jsonl"
    command = (
        f"megatron-ext blocklist apply --blocklist {blocklist} "
        "--out-dir /corpus/web/filtered-incident-001"
    )
    assert f"Then write the raw shards without their records (filtered copies): `{command}`" in text
    assert report.as_json()["apply_command"] == command
    report.documents = [_sample(1, None)]
    assert report.apply_command() is None
    assert "`megatron-ext provenance rebuild` writes one" in report.markdown()
