"""What each rung of the GPU check (tools/gpu_smoke.py) is given and fills: the
:class:`Context` (where to work, which interpreter, how to run a demo) and its :class:`Rung`
(status, figures, the JSON line). Its own module so that the ladder (gpu_smoke) and the rungs
(gpu_rungs) both import it and neither imports the other. Standard library only."""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Estimated GPU seconds per rung and why (H200: 16 cores, ~790 bf16 TFLOP/s measured here).
ESTIMATES: dict[int, tuple[int, str]] = {
    1: (
        60,
        "venv + pip of megatron-core (3 MB wheel) and an editable install, ~1 min on 16 "
        "cores; torch comes from the image",
    ),
    2: (45, "one launch: ~15 s imports and init (as on the CPU harness), ~30 ms/step x 40"),
    3: (
        30,
        "4096x2x16k bf16 logits: ~0.5 GB per copy, 5 methods x 12 reps of fwd+bwd at "
        "~4 TB/s, plus torch.compile of the fused CE (~15 s)",
    ),
    4: (
        200,
        "4 arms (off/on x 2) of 40 steps at ~0.15 s on a 24-layer 2048-hidden model, plus "
        "~30 s start-up each",
    ),
    5: (120, "two launches of 60 steps (spike exit, restart), the planner and a lookup"),
    6: (45, "rung 2's run with --transformer-impl transformer_engine"),
    7: (
        30,
        "8192 tokens x 4096 hidden x 32k V/TP bf16 head: 3 methods x 9 fwd+bwd of ~3 x 2.2 "
        "TFLOP (~10 ms each), plus torch.compile of the fused CE and ~15 s of imports",
    ),
    8: (
        60,
        "two launches of the tiny model (20 and 10 steps, ~15 s start-up each) with 6 async "
        "saves, and a check of every checkpoint's files",
    ),
    9: (
        50,
        "on 2 GPUs with TE: two launches of the tiny model (10 steps on one rank, 5 at CP=2 "
        "from its checkpoint), ~20 s start-up each; one GPU: a probe (it needs 2 GPUs and TE)",
    ),
    10: (
        30,
        "on 2 GPUs with TE: one launch of 5 steps at TP=2 + SP (rung 9's one-rank run is "
        "reused); one GPU: a probe (skipped in seconds)",
    ),
    11: (
        60,
        "on 2 GPUs with TE and Bridge: two launches of 3 steps (Bridge alone, the overlay) at "
        "~25 s start-up each, and a lookup; elsewhere the row skips in seconds, saying why",
    ),
}


@dataclass
class Rung:
    number: int
    name: str
    status: str = "pass"
    figures: dict[str, object] = field(default_factory=dict)
    detail: str = ""
    started: float = field(default_factory=time.monotonic)

    def fail(self, why: str) -> None:
        self.status, self.detail = "fail", why

    def line(self) -> str:
        estimate, basis = ESTIMATES[self.number]
        return json.dumps(
            {
                "rung": self.number,
                "name": self.name,
                "status": self.status,
                "seconds": round(time.monotonic() - self.started, 1),
                "estimate_gpu_s": estimate,
                "estimate_basis": basis,
                "figures": self.figures,
                "detail": self.detail,
            }
        )


@dataclass
class Context:
    cpu: bool
    work: Path
    python: str  # the interpreter that has megatron-core and this package
    wheels: Path | None
    env: dict[str, str] = field(default_factory=dict)
    cache: dict[str, object] = field(default_factory=dict)  # what rungs share (one ladder run)

    def run(self, command: list[str], timeout: float, **kw: object) -> subprocess.CompletedProcess:
        return subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **self.env},
            cwd=REPO,
            **kw,
        )

    def demo(
        self, workdir: Path, options: list[str], flags: list[str], timeout: float = 900
    ) -> subprocess.CompletedProcess:
        """``megatron-ext demo OPTIONS -- FLAGS``: the tiny corpus and model (CPU: through the
        harness); every workdir shares one prepared corpus and tokenizer."""
        shared = self.work / "shared"
        if not (shared / "data").is_dir():  # the first demo prepares it; the others link it
            prepare = (
                "from megatron_ext.demo import prepare_tiny_dataset as p; import sys; "
                "p(__import__('pathlib').Path(sys.argv[1]))"
            )
            result = self.run([self.python, "-c", prepare, str(shared)], timeout=300)
            if result.returncode:
                return result
        workdir.mkdir(parents=True, exist_ok=True)
        if not (workdir / "data").exists():
            (workdir / "data").symlink_to(shared / "data", target_is_directory=True)
        precision = [] if self.cpu else ["--bf16"]
        return self.run(
            [
                self.python,
                "-m",
                "megatron_ext.cli",
                "demo",
                "--workdir",
                str(workdir),
                *options,
                "--",
                *precision,
                *flags,
            ],
            timeout,
        )
