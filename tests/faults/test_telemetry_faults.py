"""Telemetry never kills training: a real full disk (a tmpfs filled up) under --signals-dir
and --sample-log-dir (and so the spike ledger) while a real training runs."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from megatron_ext.common.gap_log import GapLog, gap_record, read_gaps
from megatron_ext.common.records.sample_log import read_records
from megatron_ext.common.records.signals import read_signals
from megatron_ext.demo import CPU_FLAGS, TINY_MODEL
from megatron_ext.lookup import cli as lookup_cli
from megatron_ext.plot import draw as plot
from tests.support.faults import fault
from tests.support.harness import RUNNER, TINY_TRAINING
from tests.support.sandbox import run_with_mount

# In the private mount namespace: fill the tmpfs, train, free the disk once iteration 4 is
# logged, copy the logs out (the tmpfs disappears with the namespace).
FILL_TRAIN_FREE = r"""
set -u
disk=$1; out=$2; shift 2
mkdir -p "$disk/signals" "$disk/samples"
dd if=/dev/zero of="$disk/filler" bs=4k 2>/dev/null
"$@" >"$out/log.txt" 2>&1 &
pid=$!
while kill -0 "$pid" 2>/dev/null; do
    if [ -e "$disk/filler" ] && grep -qE 'iteration +4/' "$out/log.txt"; then
        rm -f "$disk/filler"
    fi
    sleep 0.1
done
wait "$pid"; rc=$?
cp -r "$disk/signals" "$disk/samples" "$out/"
exit "$rc"
"""


@pytest.mark.e2e
@fault(
    "a full disk (a filled 256 KiB tmpfs) under --signals-dir and --sample-log-dir (the spike "
    "ledger and layout log with them) from iteration 1, freed after iteration 4",
    "training reaches its last iteration and final checkpoint (rc 0, the detector ran on in "
    "memory); one warning per log, not one per step; once writable, each log gets one gap "
    "record naming the iterations missing, which with the records covers every iteration "
    "once; `plot` lists and hatches the gap and `lookup --sample-log` refuses naming it",
    area="telemetry",
)
def test_a_full_telemetry_disk_never_stops_training(data_args, tmp_path) -> None:
    disk, out, ckpt = tmp_path / "disk", tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    telemetry = ["--signals-dir", str(disk / "signals"), "--sample-log-dir", str(disk / "samples")]
    training = [
        *["--save", str(ckpt), "--load", str(ckpt), "--save-interval", "10"],
        *telemetry,
        *["--spike-detect", "--log-bucket-grad-norms"],
    ]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node=1", str(RUNNER), *TINY_MODEL, *TINY_TRAINING, *CPU_FLAGS]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env["MEGATRON_EXT_HARNESS_COUNTS"] = str(tmp_path / "counts")
    script = ["bash", "-c", FILL_TRAIN_FREE, "fill", str(disk), str(out)]
    result, _ = run_with_mount(
        [*script, *command, *data_args, *training], disk, size_kib=256, env=env, timeout=600
    )
    log = (out / "log.txt").read_text()
    assert result.returncode == 0, log[-4000:]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "20"
    assert "Traceback" not in log
    for what in ("signals log", "sample log", "spike ledger"):
        assert log.count(f"WARNING: cannot write the {what}") == 1, log[-4000:]
        assert f"the {what} {disk}" in log and "is writable again" in log

    signals = out / "signals" / "signals.jsonl"
    (gap,) = read_gaps(signals)
    assert gap.first_iteration == 1 and gap.last_iteration >= 3
    assert "No space left on device" in gap.reason
    logged = [r.iteration for r in read_signals(signals)]
    missing = list(range(gap.first_iteration, gap.last_iteration + 1))
    assert sorted(logged + missing) == list(range(1, 21))  # every iteration once

    samples = out / "samples" / "samples-dp0.jsonl"
    (sample_gap,) = read_gaps(samples)
    trained = {r.iteration for r in read_records(samples)}
    lost = set(range(sample_gap.first_iteration, sample_gap.last_iteration + 1))
    assert trained.isdisjoint(lost) and trained | lost == set(range(1, 21))
    assert sample_gap.records_lost == 4 * len(lost)  # 4 micro-batches per iteration

    assert plot.main(["--signals-dir", str(out / "signals"), "--out", str(tmp_path / "p.png")]) == 0
    lookup = [
        *["--from-checkpoint", str(ckpt), "--iteration", "1", "--dp-rank", "0"],
        *["--sample-log", str(out / "samples")],
    ]
    assert lookup_cli.main(lookup) == 1


def test_plot_lists_a_gap(tmp_path, capsys) -> None:
    """The plot's own output names every gap (read from the signals log)."""
    log = GapLog(tmp_path / "signals.jsonl", "signals log")
    for i in (1, 2, 6):
        record = {"iteration": i, "attempt": 1, "job_id": "", "wall_time": float(i)}
        record |= {"consumed_samples": 8 * i, "skipped_samples": 0, "lm_loss": 3.0}
        log.append(record, i)
    text = (tmp_path / "signals.jsonl").read_text().splitlines()
    gap = gap_record(3, 5, 3, "OSError: [Errno 28] No space left on device", 0.0)
    text.insert(2, json.dumps(gap))
    Path(tmp_path / "signals.jsonl").write_text("\n".join(text) + "\n")
    assert plot.main(["--signals-dir", str(tmp_path), "--out", str(tmp_path / "p.png")]) == 0
    assert "logging gap: iterations 3-5 trained but not logged" in capsys.readouterr().out
