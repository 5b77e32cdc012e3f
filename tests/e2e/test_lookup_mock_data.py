"""``--mock-data`` under Megatron's loop (CPU harness, DP=2): the sample log says the run's
data is mock, and ``megatron-ext lookup`` answers each iteration with mock samples (no
documents) equal to what the run recorded, ids and token digests."""

from __future__ import annotations

import json
from pathlib import Path

from megatron_ext.lookup import cli
from tests.support.harness import GLOBAL_BATCH, launch

MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024"]


def test_lookup_answers_mock_samples_as_trained(tmp_path: Path) -> None:
    ckpt = tmp_path / "run" / "ckpt"
    flags = [*MOCK, "--z-loss-coeff", "1e-5", "--save", str(ckpt), "--save-interval", "20"]
    run = launch(tmp_path / "run", flags, nproc=2)
    assert run.returncode == 0, run.log[-4000:]
    layout = json.loads((run.samples / "layout.jsonl").read_text().splitlines()[0])
    assert layout["mock_data"] is True, layout
    logged = {
        (r.iteration, r.dp_rank, r.microbatch): list(zip(r.sample_ids, r.token_sha1))
        for records in run.records().values()
        for r in records
    }
    for iteration in (1, 20):
        out = tmp_path / f"lookup-{iteration}.jsonl"
        argv = ["--from-checkpoint", str(ckpt), "--iteration", str(iteration)]
        assert cli.main([*argv, "--sample-log", str(run.samples), "--out", str(out)]) == 0
        answer: dict[tuple[int, int, int], list[tuple[int, str]]] = {}
        for line in out.read_text().splitlines():
            sample = json.loads(line)
            assert sample["documents"] == [] and sample["mock"].startswith("mock sample "), sample
            key = (iteration, sample["dp_rank"], sample["microbatch"])
            answer.setdefault(key, []).append((sample["sample_index"], sample["token_sha1"]))
        assert sum(map(len, answer.values())) == GLOBAL_BATCH
        assert answer == {k: v for k, v in logged.items() if k[0] == iteration}
