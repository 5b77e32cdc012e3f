"""Context parallelism, checked against megatron-core's own sequence split on CPU: the sample
log and telemetry must record each micro-batch's whole sequences, not one CP rank's part.

Under CP every CP rank reads the whole micro-batch and megatron-core's
``get_batch_on_this_cp_rank`` gives it two of ``2 * CP`` sequence chunks (zig-zag); the loss,
its token count and each sample's loss on a rank cover only those chunks. Two real ranks
(tests/support/context_parallel.py) run the real features on their shards of a micro-batch
whose masked tokens fall unevenly on the ranks, so that a per-rank mean, or a record written
by each rank, differs from the whole sequence's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_ext.common.io import token_sha1
from megatron_ext.common.records.sample_log import read_records
from tests.support import context_parallel as cp

WORKER = Path(cp.__file__)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("cp2")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(WORKER), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _whole() -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    batch = cp.whole_batch()
    return batch, cp.per_token_loss(batch), batch["loss_mask"]


def test_megatron_core_gives_the_cp_ranks_unequal_token_counts(ranks) -> None:
    _, results = ranks
    _, _, mask = _whole()
    tokens = [r["shard_tokens"] for r in results]
    assert sum(tokens) == int(mask.sum()) and tokens[0] != tokens[1], tokens


def test_the_sample_log_records_whole_sequences_once(ranks) -> None:
    out, _ = ranks
    batch, losses, mask = _whole()
    (record,) = read_records(out / "samples" / "samples-dp0.jsonl")  # CP rank 1 wrote none
    assert record.sample_ids == batch["sample_id"].tolist()
    assert record.token_sha1 == [token_sha1(row) for row in batch["tokens"]]
    assert record.num_tokens == int(mask.sum())
    assert record.loss_sum == pytest.approx(float((losses * mask).sum()), rel=1e-6)
    expected = ((losses * mask).sum(dim=1) / mask.sum(dim=1)).tolist()
    assert record.sample_losses == pytest.approx(expected, rel=1e-6)


def test_telemetry_worst_rank_and_sources_cover_whole_sequences(ranks) -> None:
    _, results = ranks
    _, losses, mask = _whole()
    mean = float((losses * mask).sum() / mask.sum())
    rows = {"even": [0, 2], "odd": [1]}
    for result in results:  # every CP rank reports the DP rank's whole-sequence loss
        assert result["worst_rank"] == 0
        assert result["worst_loss"] == pytest.approx(mean, rel=1e-6)
        for source, picked in rows.items():
            tokens = mask[picked].sum()
            assert result["tokens_by_source"][source] == int(tokens)
            loss = float((losses[picked] * mask[picked]).sum() / tokens)
            assert result["loss_by_source"][source] == pytest.approx(loss, rel=1e-6)
