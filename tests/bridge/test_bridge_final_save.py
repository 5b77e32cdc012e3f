"""A skip list covering Bridge's last iteration still leaves the final checkpoint: Bridge's
train() `continue`s past its interval save on a skipped iteration and saves at the end only
off an interval multiple (the bug Megatron has too, registry skip-list-final-checkpoint);
megatron_ext.bridge saves it at on_train_end. One launch: 6 iterations, interval 3, skip 6,
with a forward step of the user's own (Bridge's three-argument form, given the state by
Bridge's rule): it runs for every micro-batch and its loss is observed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext.common.files import checkpoint_dir
from megatron_ext.common.records.signals import read_signals
from tests.support.harness import REPO, RUNNER

EXAMPLE = REPO / "docs" / "examples" / "pretrain_bridge.py"


@pytest.mark.timeout(600)
def test_a_skipped_last_iteration_still_saves_the_final_checkpoint(
    tmp_path: Path, data_args: list[str]
) -> None:
    import torch

    document = data_args[data_args.index("--data-path") + 1]
    tokenizer = data_args[data_args.index("--tokenizer-model") + 1]
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"),
        *(str(RUNNER), "--bridge-script", str(EXAMPLE), "--data-path", document),
        *("--tokenizer", tokenizer, "--work", str(tmp_path), "--train-iters", "6"),
        *("--save-interval", "3", "--own-forward-step", "--", "--iterations-to-skip", "6"),
        *("--signals-dir", str(tmp_path / "signals")),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=500)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "saving the final checkpoint 6 (its iteration was skipped)" in result.stdout
    # 5 trained iterations x 2 micro-batches (global batch 8, micro 2, DP 2), on each rank.
    assert result.stdout.count("own forward step: 10 micro-batches") == 2, result.stdout[-3000:]
    records = read_signals(tmp_path / "signals" / "signals.jsonl")
    assert [r.iteration for r in records] == [1, 2, 3, 4, 5]
    assert all(r.max_local_loss is not None and r.max_local_loss >= r.lm_loss for r in records)
    final = checkpoint_dir(tmp_path / "ckpt", 6) / "train_state.pt"
    state = torch.load(final, weights_only=True)
    assert (int(state["step"]), int(state["skipped_train_samples"])) == (6, 8)
    tracker = torch.load(tmp_path / "ckpt" / "latest_train_state.pt", weights_only=True)
    assert int(tracker["step"]) == 6
