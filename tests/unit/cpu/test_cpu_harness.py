"""The CPU runner's shims (megatron_ext/cpu/): strict about CUDA, refusing versions outside
the supported range.

That only the CPU runner loads them (never a GPU run) is tests/unit/test_architecture.py's.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)


def test_unexpected_cuda_call_trips_and_is_counted() -> None:
    result = _run(
        "from megatron_ext.cpu import shims\nimport torch\nshims.install()\n"
        "try:\n    torch.cuda.mem_get_info()\nexcept RuntimeError as e:\n    print('raised', e)\n"
        "print(dict(shims.COUNTS))\n"
    )
    assert result.returncode == 0, result.stderr
    assert "raised CPU harness: unexpected CUDA call torch.cuda.mem_get_info" in result.stdout
    assert "'unexpected:mem_get_info': 1" in result.stdout


def test_shims_count_and_redirect_cuda_allocations() -> None:
    result = _run(
        "from megatron_ext.cpu import shims\nimport torch\nshims.install(); shims.install()\n"
        "t = torch.zeros(3, device='cuda')\nassert t.device.type == 'cpu'\n"
        "assert t.type() == 'torch.cuda.FloatTensor'\n"
        "print(shims.COUNTS['device=cuda'], shims.COUNTS['Tensor.type'])\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "1"]


def test_harness_refuses_a_megatron_core_outside_the_range(tmp_path: Path) -> None:
    result = _run(
        "import importlib.metadata as m\nfrom megatron_ext.cpu import shims\n"
        "m.version = lambda name: '0.16.1'\nshims.install()\n"
    )
    assert result.returncode != 0
    assert "megatron-core 0.16.1 is not supported" in result.stderr
    assert "0.17.1 to 0.19.2" in result.stderr
