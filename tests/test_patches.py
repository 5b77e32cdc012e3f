"""The patch registry: verified targets, loud failure when a target changes, idempotence."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_ext import patches
from megatron_ext.fixes import BUGFIXES
from megatron_ext.patches import Patch, PatchTargetError


def _scratch(name: str, target: str, signature: str, wrap=lambda f: (lambda *a: f(*a))) -> Patch:
    patch = Patch(name=name, target=target, reason="test", signature=signature, wrap=wrap)
    patches._REGISTRY[name] = patch
    return patch


@pytest.fixture(autouse=True)
def _restore_registry():
    saved = dict(patches._REGISTRY)
    yield
    patches._REGISTRY.clear()
    patches._REGISTRY.update(saved)


def test_every_registered_fix_matches_the_pinned_megatron_core() -> None:
    patches.verify_all()
    assert {p.name for p in BUGFIXES} <= {p.name for p in patches.registry()}
    for patch in BUGFIXES:
        assert patch.kind == "bugfix" and patch.reason and patch.verified_on == "0.19.2"


def test_missing_target_fails_loudly() -> None:
    _scratch("ghost", "megatron.core.datasets.utils:no_such_function", "()")
    with pytest.raises(PatchTargetError, match=r"ghost.*no_such_function.*not found.*re-verify"):
        patches.verify_all()


def test_missing_module_fails_loudly() -> None:
    patch = _scratch("ghost-module", "megatron.core.no_such_module:f", "()")
    with pytest.raises(PatchTargetError, match="not found"):
        patches.apply(patch.name)


def test_changed_signature_fails_loudly() -> None:
    _scratch("drifted", "megatron.core.datasets.utils:compile_helpers", "(verbose)")
    with pytest.raises(PatchTargetError, match=r"changed signature: expected \(verbose\), found \(\)"):
        patches.apply("drifted")


def test_apply_is_idempotent_and_keeps_the_original() -> None:
    from megatron.core.datasets import utils

    target = "megatron.core.datasets.utils:normalize"
    before = utils.normalize
    patch = _scratch("double", target, "(weights: List[float]) -> List[float]",
                     wrap=lambda f: (lambda weights: f(weights)))
    try:
        patches.apply(patch.name)
        first = utils.normalize
        patches.apply(patch.name)
        assert utils.normalize is first is not before
        assert patches.is_applied(patch) and patch in patches.applied()
        assert utils.normalize([1.0, 3.0]) == [0.25, 0.75]
        patches.verify(patch)  # verification looks through the installed wrapper
    finally:
        utils.normalize = before


def test_duplicate_registration_is_refused() -> None:
    _scratch("dup", "megatron.core.datasets.utils:normalize", "()")
    with pytest.raises(ValueError, match="registered twice"):
        patches.register(Patch(name="dup", target="x:y", reason="", signature="", wrap=id))


def test_prebuilt_helpers_fix_skips_make() -> None:
    """Without the fix, compile_helpers runs `make` in the wheel, which has no Makefile."""
    code = (
        "import megatron.core.datasets.utils as u, subprocess\n"
        "from megatron_ext import patches\n"
        "import megatron_ext.fixes\n"
        "calls = []\n"
        "subprocess.run = lambda cmd, **k: calls.append(cmd) or subprocess.CompletedProcess(cmd, 2)\n"
        "try:\n    u.compile_helpers()\nexcept SystemExit:\n    calls.append('exit')\n"
        "assert calls and calls[-1] == 'exit', calls\n"
        "calls.clear(); patches.apply('prebuilt-dataset-helpers'); u.compile_helpers()\n"
        "assert calls == [], calls\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_patches_command_lists_and_verifies() -> None:
    out = subprocess.run([sys.executable, "-m", "megatron_ext.cli", "patches"],
                         capture_output=True, text=True, check=True).stdout
    assert "megatron-core installed: 0.19.2" in out
    for patch in BUGFIXES:
        assert f"{patch.name}  [bugfix, verified on 0.19.2]  ok" in out
