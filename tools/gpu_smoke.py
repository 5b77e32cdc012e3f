"""GPU smoke test (one H100/H200, < 8 min): the tiny drill with the TE layer spec in bf16.

    bash tools/gpu_smoke.sh            # after: pip install -e '.[gpu,test]'

1. overhead arms on the same tiny model, interleaved: plain pretrain_gpt_ext.py vs every
   per-step instrument on (z-loss, bucket norms, signals + update ratio, spike detector,
   sample log); prints the step-time ratio;
2. the incident drill (``megatron-ext demo --drill``) in bf16 with Transformer Engine:
   bad batch → spike exit → plan + apply → restart past the spike;
3. the lookup of the culprit batch (``megatron-ext lookup``) from the drill's checkpoint.
"""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from megatron_ext.demo import main as demo_main
from megatron_ext.demo import training_command

GPU_FLAGS = ["--bf16", "--transformer-impl", "transformer_engine"]
INSTRUMENTS = [
    "--z-loss-coeff",
    "1e-4",
    "--log-bucket-grad-norms",
    "--spike-detect",
    "--signals-update-ratio",
]
STEP = re.compile(r"iteration\s+(\d+)/.*elapsed time per iteration \(ms\): ([0-9.]+)")


def _arm(root: Path, name: str, round_: int, extra: list[str]) -> list[float]:
    work = root / f"{name}-{round_}"
    command = training_command(
        work, 1, 120, [*GPU_FLAGS, "--log-interval", "1", "--save-interval", "1000", *extra]
    )
    load = command.index("--load")
    del command[load : load + 2]  # every arm starts fresh
    out = subprocess.run(command, capture_output=True, text=True, cwd=root)
    if out.returncode != 0:
        print(out.stdout[-3000:], out.stderr[-3000:])
        raise SystemExit(f"gpu smoke: {name} arm failed")
    return [float(ms) for it, ms in STEP.findall(out.stdout) if int(it) > 10]


def main() -> int:
    if not torch.cuda.is_available():
        raise SystemExit("gpu smoke: no CUDA device")
    root = Path("runs/gpu-smoke").resolve()
    root.mkdir(parents=True, exist_ok=True)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    start = time.time()
    times: dict[str, list[float]] = {"off": [], "on": []}
    for round_ in range(2):
        times["off"] += _arm(root, "off", round_, [])
        times["on"] += _arm(
            root,
            "on",
            round_,
            [*INSTRUMENTS, "--signals-dir", str(root / f"on-{round_}" / "signals")],
        )
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    print(
        f"step time: off {off:.2f} ms, on {on:.2f} ms, ratio on/off {on / off:.3f} "
        f"({len(times['off'])}+{len(times['on'])} iterations)"
    )
    status = demo_main(["--drill", "--workdir", str(root / "drill"), "--", *GPU_FLAGS])
    print(f"drill exit status {status}")
    ckpt = root / "drill" / "checkpoints"
    lookup = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_ext.cli",
            "lookup",
            "--from-checkpoint",
            str(ckpt),
            "--iteration",
            "40",
            "--dp-rank",
            "1",
        ],
        capture_output=True,
        text=True,
    )
    print(lookup.stdout[-4000:] or lookup.stderr[-2000:])
    print(f"gpu smoke done in {time.time() - start:.0f} s")
    return 0 if status == 0 and lookup.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
