"""The CPU harness itself: strict about CUDA, pinned, and absent from the package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HARNESS = Path(__file__).resolve().parents[1] / "cpu_harness"


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=HARNESS)


def test_unexpected_cuda_call_trips_and_is_counted() -> None:
    result = _run(
        "import shims, torch\nshims.install()\n"
        "try:\n    torch.cuda.mem_get_info()\nexcept RuntimeError as e:\n    print('raised', e)\n"
        "print(dict(shims.COUNTS))\n"
    )
    assert result.returncode == 0, result.stderr
    assert "raised CPU harness: unexpected CUDA call torch.cuda.mem_get_info" in result.stdout
    assert "'unexpected:mem_get_info': 1" in result.stdout


def test_shims_count_and_redirect_cuda_allocations() -> None:
    result = _run(
        "import shims, torch\nshims.install(); shims.install()\n"
        "t = torch.zeros(3, device='cuda')\nassert t.device.type == 'cpu'\n"
        "assert t.type() == 'torch.cuda.FloatTensor'\n"
        "print(shims.COUNTS['device=cuda'], shims.COUNTS['Tensor.type'])\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "1"]


def test_harness_refuses_another_megatron_core(tmp_path: Path) -> None:
    result = _run(
        "import importlib.metadata as m, shims\n"
        "m.version = lambda name: '0.20.0'\nshims.install()\n"
    )
    assert result.returncode != 0
    assert "pinned to megatron-core 0.19.2, found 0.20.0" in result.stderr


def test_package_never_imports_or_installs_the_harness() -> None:
    repo = HARNESS.parents[1]
    sources = [p for p in (repo / "megatron_ext").rglob("*.py")] + [repo / "pretrain_gpt_ext.py"]
    for source in sources:
        assert "import shims" not in source.read_text(), source
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, torch, pretrain_gpt_ext, megatron_ext.cli, megatron_ext.gpt_step, "
            "megatron_ext.demo, megatron_ext.fixes\n"
            "assert 'shims' not in sys.modules\n"
            "assert not getattr(torch.cuda, '_megatron_ext_cpu_harness', False)\n"
            "assert torch.cuda.current_device.__module__ == 'torch.cuda'\n",
        ],
        capture_output=True,
        text=True,
        cwd=repo,
    )
    assert result.returncode == 0, result.stderr
