"""``megatron-ext patches`` lists Megatron-Bridge's table where Bridge is installed, every entry
verified against the installed Bridge, and says where it is not."""

from __future__ import annotations

import pytest

from megatron_ext import patches
from megatron_ext.bridge import table as bridge


def test_the_patches_command_lists_and_verifies_every_bridge_entry(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert patches.main([]) == 0
    out = capsys.readouterr().out
    assert f"== Megatron-Bridge {bridge.installed_bridge()} (megatron_ext.bridge.table)" in out
    bridge_part = out.split("== Megatron-Bridge", 1)[1]
    for entry in bridge.ENTRIES:
        lines = [line for line in bridge_part.splitlines() if line.startswith(f"  {entry.name}  ")]
        assert len(lines) == 1 and lines[0].endswith("  ok"), (entry.name, lines)


def test_a_bridge_it_was_not_verified_on_fails_the_command(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(bridge, "installed_bridge", lambda: "0.0.1")
    assert patches.main([]) == 1
    assert "megatron-bridge 0.0.1: megatron-ext's Bridge integration is verified on" in (
        capsys.readouterr().out
    )
