"""The CPU runner's shims (megatron_ext/cpu/): strict about CUDA, refusing versions outside
the supported range.

That only the CPU runner loads them (never a GPU run) is tests/unit/test_architecture.py's.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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
        "from megatron_ext.registry import table\n"
        "print(table.patch('cpu-initialize-without-cuda').is_applied())\n"
    )
    assert result.returncode == 0, result.stderr
    # Megatron's own function is patched through the registry, like every other touch.
    assert result.stdout.split() == ["1", "1", "True"]


def test_megatrons_rng_tracker_queues_nothing_without_cuda() -> None:
    """Without CUDA, torch.cuda._lazy_call queues every call with its stack until CUDA starts,
    i.e. forever here: Megatron's tracker forks per attention layer and micro-batch."""
    result = _run(
        "from megatron_ext.cpu import shims\nimport torch\nshims.install()\n"
        "from megatron.core.tensor_parallel import random\n"
        "random.get_cuda_rng_tracker().add('model-parallel-rng', 1234)\n"
        "before = len(torch.cuda._queued_calls)\n"
        "for _ in range(100):\n    with random.get_cuda_rng_tracker().fork():\n        pass\n"
        "print(len(torch.cuda._queued_calls) - before, shims.COUNTS['_lazy_call(dropped)'])\n"
    )
    assert result.returncode == 0, result.stderr
    queued, dropped = map(int, result.stdout.split())
    assert (queued, dropped >= 200) == (0, True), result.stdout


def test_harness_refuses_a_megatron_core_outside_the_range(tmp_path: Path) -> None:
    result = _run(
        "import importlib.metadata as m\nfrom megatron_ext.cpu import shims\n"
        "m.version = lambda name: '0.16.1'\nshims.install()\n"
    )
    assert result.returncode != 0
    assert "megatron-core 0.16.1 is not supported" in result.stderr
    assert "0.17.1 to 0.19.2" in result.stderr


def test_a_script_runs_with_its_folder_on_sys_path_as_python_script_py(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Megatron-LM's pretrain_gpt.py imports its siblings (gpt_builders, model_provider)."""
    from megatron_ext.cpu import run

    (tmp_path / "sibling_of_the_script.py").write_text("VALUE = 7\n")
    script = tmp_path / "pretrain_own.py"
    script.write_text(
        "import sys\nfrom sibling_of_the_script import VALUE\n"
        "open(sys.argv[1], 'w').write(str(VALUE))\n"
    )
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.delitem(sys.modules, "sibling_of_the_script", raising=False)
    run._training(["--script", str(script), str(tmp_path / "out")])()
    assert (tmp_path / "out").read_text() == "7"
