"""The supported megatron-core range: declared once, refused outside it with a readable
message (the pure check, the entry point in a subprocess and ``megatron-ext patches`` in
process, each seeing megatron-core 0.16.1), the override warns loudly, and every registry
entry has a form verified on every supported version."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext.common import versions

REPO = Path(__file__).resolve().parents[2]

# A process whose metadata says megatron-core 0.16.1 (only the version string is faked; the
# check reads nothing else before refusing).
_AS_0_16_1 = (
    "import importlib.metadata as m\n"
    "real = m.version\n"
    "m.version = lambda name: '0.16.1' if name == 'megatron-core' else real(name)\n"
)


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _AS_0_16_1 + code],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, **env},
        timeout=300,
    )


def test_outside_the_range_is_refused_with_the_range_and_the_install_command() -> None:
    for found in ("0.16.1", "0.17.0", "0.20.0", "1.0.0"):
        with pytest.raises(versions.UnsupportedVersion) as refused:
            versions.check(found, environ={})
        message = str(refused.value)
        assert f"megatron-core {found} is not supported" in message
        assert "0.17.1 to 0.19.2" in message
        assert "pip install 'megatron-core==0.19.2'" in message
        assert versions.OVERRIDE_ENV in message


def test_verified_versions_pass_and_an_unverified_one_in_the_range_warns() -> None:
    for found in versions.VERIFIED:
        assert versions.check(found, environ={}) is None
    warning = versions.check("0.18.1", environ={})
    assert warning and "not one of the verified versions" in warning
    assert versions.nearest_verified("0.18.1") == "0.18.2"


def test_the_override_lets_an_unverified_version_run_and_warns_loudly() -> None:
    warning = versions.check("0.16.1", environ={versions.OVERRIDE_ENV: "1"})
    assert warning and "WARNING: UNVERIFIED megatron-core 0.16.1" in warning
    with pytest.raises(versions.UnsupportedVersion):
        versions.check("0.16.1", environ={versions.OVERRIDE_ENV: "0"})


def test_setup_py_requires_the_declared_range_without_importing_the_package() -> None:
    declared = runpy.run_path(str(REPO / "megatron_ext" / "common" / "versions.py"))
    assert declared["REQUIREMENT"] == "megatron-core>=0.17.1,<=0.19.2"
    setup_py = (REPO / "setup.py").read_text()
    assert 'VERSIONS["REQUIREMENT"]' in setup_py and "import megatron_ext" not in setup_py


def test_the_entry_point_refuses_0_16_1_before_importing_megatron() -> None:
    result = _run(
        "import sys\nimport pretrain_gpt_ext\n"
        "import torch\ntorch.cuda._megatron_ext_cpu_harness = True\n"
        "try:\n    pretrain_gpt_ext.main(['--num-layers', '1'])\n"
        "finally:\n    print('megatron imported:', 'megatron.training' in sys.modules)\n"
    )
    assert result.returncode == 1, result.stderr
    assert "megatron-core 0.16.1 is not supported" in result.stderr
    assert "pip install 'megatron-core==0.19.2'" in result.stderr
    assert "Traceback" not in result.stderr
    assert "megatron imported: False" in result.stdout


def test_patches_refuses_0_16_1_and_runs_with_the_override(monkeypatch, capsys) -> None:
    """In process (one megatron-core import for the module): the metadata says 0.16.1."""
    import importlib.metadata

    from megatron_ext import patches
    from megatron_ext.registry import patching

    real = importlib.metadata.version
    fake = lambda name: "0.16.1" if name == "megatron-core" else real(name)
    monkeypatch.setattr(importlib.metadata, "version", fake)
    monkeypatch.delenv(versions.OVERRIDE_ENV, raising=False)
    patching.installed_version.cache_clear()
    try:
        assert patches.main([]) == 1
        refused = capsys.readouterr().out
        assert "megatron-core 0.16.1 is not supported" in refused
        assert "== upstream bug fixes" not in refused
        monkeypatch.setenv(versions.OVERRIDE_ENV, "1")
        patches.main([])
        tried = capsys.readouterr().out
    finally:
        monkeypatch.undo()
        patching.installed_version.cache_clear()
    assert "WARNING: UNVERIFIED megatron-core 0.16.1" in tried
    assert "== upstream bug fixes" in tried  # every entry is still verified
