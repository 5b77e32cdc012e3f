"""The GPU check's CPU rehearsal: the same ladder script, rungs 2 (every feature), 4 (overhead
arms), 5 (drill -> plan -> apply -> restart -> lookup), 7 (fused output loss, tiny size), 8
(async save: refused by the CPU runner), 9 and 10 (CP=2, TP=2 + SP: their comparison with the
one-rank run made on TP=2; the CPU runner's refusal of CP and SP is test_layouts.py's) through
the CPU harness, so the orchestration cannot rot between GPU loans."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import toolchain

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(1200)
def test_cpu_rehearsal_of_the_gpu_ladder(tmp_path: Path) -> None:
    result = subprocess.run(
        ["bash", str(REPO / "tools" / "gpu_smoke.sh"), "--cpu-rehearsal", "--work", str(tmp_path)],
        capture_output=True,
        text=True,
        env={"PYTHON": sys.executable, "PATH": f"{toolchain.session_folder()}:/usr/bin:/bin"},
        timeout=1100,
    )
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    rungs = {line["rung"]: line for line in lines if "rung" in line}
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert sorted(rungs) == list(range(1, 12)), "every rung prints one JSON line"
    for number, rung in rungs.items():
        assert rung["estimate_gpu_s"] > 0 and rung["estimate_basis"], number
        assert rung["status"] == ("pass" if number in (2, 4, 5, 7, 8, 9, 10) else "skip"), rung
    assert rungs[2]["figures"]["iterations"] == 40 and rungs[2]["figures"]["buckets"] > 1
    assert rungs[4]["figures"]["ratio"] > 0 and rungs[4]["figures"]["steps"] == 10
    assert rungs[7]["figures"]["time_vs_megatron_ce"] > 0  # the fused head ran against both CEs
    assert rungs[7]["figures"]["ddp_time_vs_megatron_ce"] > 0  # and under DDP (main_grad)
    drill = rungs[5]["figures"]
    assert drill["incidents"] == 1 and drill["lookup_exit"] == 0
    assert drill["skip_window"][0] <= drill["onset"] <= drill["skip_window"][1]
    assert rungs[8]["figures"]["exit"] not in (0, None)  # refused, at once, on CPU
    for number in (9, 10):  # the comparison ran on every iteration and batch
        figures = rungs[number]["figures"]
        assert figures["compared"] == "--tensor-model-parallel-size 2", figures
        assert figures["iterations"] == 5, figures
        assert figures["micro_batches"] == 10 and figures["max_rel_diff_lm_loss"] < 1e-4
    assert lines[-1]["summary"] and lines[-1]["failed"] == []
