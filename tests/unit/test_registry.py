"""The registry of every touch of Megatron: verified targets and assumptions, loud failure
when one changes, idempotent patches, the version warning and ``megatron-ext patches``."""

from __future__ import annotations

import subprocess

import pytest

from megatron_ext.common.versions import VERIFIED
from megatron_ext.registry import patching
from megatron_ext.registry import table as registry
from megatron_ext.registry.patching import Assumption, Patch, PatchTargetError


def _passthrough(f):
    return lambda weights: f(weights)


def _patch(target: str, signature: str) -> Patch:
    return Patch(
        name="scratch",
        target=target,
        reason="test",
        signature=signature,
        wrap=_passthrough,
        verified_on=VERIFIED,
    )


def test_every_entry_matches_the_installed_megatron_core() -> None:
    registry.verify_all()
    names = [e.name for e in registry.ENTRIES]
    assert len(names) == len(set(names)), "entry names must be unique"
    for entry in registry.ENTRIES:
        assert entry.reason, entry.name
    for fix in registry.BUGFIXES:
        assert fix.kind == "bugfix"
    assert {h.hook.__name__ for h in registry.HOOKS} == {
        "on_setup",
        "before_grad_norm",
        "after_step",
        "on_checkpoint",
    }


def test_missing_target_fails_loudly() -> None:
    ghost = _patch("megatron.core.datasets.utils:no_such_function", "()")
    with pytest.raises(PatchTargetError, match=r"scratch.*no_such_function.*not found.*Re-verify"):
        ghost.verify()
    with pytest.raises(PatchTargetError, match="not found"):
        _patch("megatron.core.no_such_module:f", "()").apply()


def test_changed_signature_fails_loudly() -> None:
    drifted = _patch("megatron.core.datasets.utils:compile_helpers", "(verbose)")
    with pytest.raises(
        PatchTargetError, match=r"changed signature: expected \(verbose\), found \(\)"
    ):
        drifted.apply()


def test_apply_is_idempotent_keeps_the_original_and_can_be_removed() -> None:
    from megatron.core.datasets import utils

    before = utils.normalize
    double = _patch(
        "megatron.core.datasets.utils:normalize", "(weights: List[float]) -> List[float]"
    )
    try:
        double.apply()
        first = utils.normalize
        double.apply()
        assert utils.normalize is first is not before and double.is_applied()
        assert utils.normalize([1.0, 3.0]) == [0.25, 0.75]
        double.verify()  # verification looks through the installed wrapper
        double.remove()
        assert utils.normalize is before and not double.is_applied()
    finally:
        utils.normalize = before


def test_apply_binds_what_the_wrapper_reads_and_rebinds_for_a_new_run() -> None:
    """A feature patch's wrapper gets the installed feature; the same one again is a no-op,
    another one (a second run in one process) replaces the binding, never stacks wrappers."""
    from megatron.core.datasets import utils

    before = utils.normalize
    scaled = Patch(
        name="scratch-bound",
        target="megatron.core.datasets.utils:normalize",
        reason="test",
        signature="(weights: List[float]) -> List[float]",
        wrap=lambda f, factor: lambda weights: [factor * w for w in f(weights)],
        verified_on=VERIFIED,
    )
    try:
        scaled.apply(2.0)
        first = utils.normalize
        scaled.apply(2.0)
        assert utils.normalize is first and utils.normalize([1.0, 3.0]) == [0.5, 1.5]
        scaled.apply(4.0)
        assert utils.normalize is not first and utils.normalize([1.0, 3.0]) == [1.0, 3.0]
        scaled.remove()
        assert utils.normalize is before
    finally:
        utils.normalize = before


@pytest.mark.parametrize(
    "assumption, message",
    [
        (
            Assumption(
                "a",
                "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucket",
                "r",
                "u",
                VERIFIED,
                assigned=("grad_data", "renamed_upstream"),
            ),
            r"no longer assigns \['renamed_upstream'\]",
        ),
        (
            Assumption(
                "b",
                "megatron.core.dist_checkpointing.strategies.filesystem_async:_gone",
                "r",
                "u",
                VERIFIED,
            ),
            "not found",
        ),
        (
            Assumption(
                "c",
                "megatron.training.checkpointing:_load_base_checkpoint",
                "r",
                "u",
                VERIFIED,
                signature="(load_dir, args)",
            ),
            "changed signature",
        ),
    ],
)
def test_changed_assumptions_fail_loudly(assumption: Assumption, message: str) -> None:
    with pytest.raises(PatchTargetError, match=message):
        assumption.verify()


def test_a_version_in_the_range_but_unverified_warns() -> None:
    said: list[str] = []
    assert patching.check_version(said.append)
    assert said == []
    assert not patching.check_version(said.append, found="0.18.1")
    assert "megatron-core 0.18.1 is in the supported range" in said[0]
    assert "checks for 0.18.2 decide" in said[0]


def test_prebuilt_helpers_fix_skips_make(monkeypatch) -> None:
    """Without the fix, compile_helpers runs `make` in the wheel, which has no Makefile."""
    import megatron.core.datasets.utils as u

    calls: list[list[str]] = []
    fake = lambda cmd, **k: calls.append(cmd) or subprocess.CompletedProcess(cmd, 2)
    monkeypatch.setattr(subprocess, "run", fake)
    monkeypatch.setattr(u, "compile_helpers", u.compile_helpers)  # as it was, after the test
    fix = registry.patch("prebuilt-dataset-helpers")
    fix.remove()
    with pytest.raises(SystemExit):
        u.compile_helpers()
    assert calls, "unpatched, compile_helpers runs make"
    calls.clear()
    fix.apply()
    u.compile_helpers()
    assert calls == [], calls


def test_patches_command_lists_every_touch_and_the_hooks_users(capsys) -> None:
    from megatron_ext import patches  # in process: this module has megatron-core imported

    assert patches.main([]) == 0
    out = capsys.readouterr().out
    found = patching.installed_version()
    assert f"megatron-core installed: {found} (megatron-ext supports 0.17.1 to 0.19.2" in out
    for entry in registry.ENTRIES:
        assert f"  {entry.name}  [verified on {', '.join(entry.covers())}]  ok" in out, entry.name
        form = entry.variant_for()
        versions = (entry if form is None else form).verified_on
        assert f"variant: {'' if form else 'this entry' if entry.variants else 'one form'}" in out
        assert found in versions, (entry.name, versions)
    assert (
        "hook after_step, used by: hang, recovery, update_skip, attention_logit, telemetry, "
        "sample_log, spikes" in out
    )
    assert "on_batch: called from megatron_ext.registry.hooks.read_batch" in out
    assert (
        "relies on: megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucket "
        "assigns grad_data, params_list, param_to_index" in out
    )


def test_every_entry_has_a_form_verified_on_every_supported_version() -> None:
    """Dropping a variant leaves its versions uncovered: this fails on every version, and
    the tier of the version it covered fails verify_all (the form picked is the entry's own,
    whose target or signature differs there)."""
    for entry in registry.ENTRIES:
        assert set(entry.covers()) == set(VERIFIED), (entry.name, entry.covers())
        forms = [entry.verified_on, *(v.verified_on for v in entry.variants)]
        assert sum(len(f) for f in forms) == len(VERIFIED), f"{entry.name}: overlapping forms"
        selected = entry.selected()
        assert patching.installed_version() in selected.verified_on, entry.name


def test_the_entry_point_runs_the_variant_of_the_installed_version() -> None:
    """The runner and batch helper picked for this megatron-core; one for every form."""
    from megatron_ext.loop import entry, gpt_step

    by_line = {
        "0.19": (entry.run_with_config_container, gpt_step.broadcast_batch),
        "0.18": (entry.run_with_model_provider, gpt_step.broadcast_batch_is_sft),
        "0.17": (entry.run_classic, gpt_step.broadcast_batch_from_iterator),
    }
    line = ".".join(patching.installed_version().split(".")[:2])
    run = entry.for_installed(entry.RUNNERS, "entry-point")
    broadcast = entry.for_installed(entry.BROADCASTS, "batch-on-this-rank")
    assert (run, broadcast) == by_line[line]
    for forms, name in ((entry.RUNNERS, "entry-point"), (entry.BROADCASTS, "batch-on-this-rank")):
        found = registry.assumption(name)
        assert set(forms) == {found.verified_on, *(v.verified_on for v in found.variants)}
    classic = registry.CLASSIC_INIT.variant_for()
    assert (classic is None) == (line == "0.17"), "the classic-args patch is 0.17's only"


def _training_side_megatron_imports() -> set[tuple[str, str]]:
    import ast
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    paths = [
        p
        for p in (repo / "megatron_ext").rglob("*.py")
        if not {"lookup", "cpu"} & set(p.relative_to(repo).parts)
    ]
    found = set()
    for path in [*paths, repo / "pretrain_gpt_ext.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron."):
                found |= {(node.module, alias.name) for alias in node.names}
    return found


def test_every_megatron_name_the_training_side_imports_is_in_the_manifest() -> None:
    """megatron-core's in the registry's IMPORTS, Megatron-Bridge's (megatron_ext/bridge/, the
    CPU runner's Bridge additions aside) in the Bridge table's, verified on the Bridge
    version it declares."""
    from megatron_ext.bridge import table as bridge_table

    declared = set()
    for entry in (*registry.IMPORTS, *bridge_table.IMPORTS):
        for form in (entry, *entry.variants):
            declared |= {(entry.target, name) for name in form.names or ()}
    missing = _training_side_megatron_imports() - declared
    assert not missing, f"megatron imports not in registry/table.py IMPORTS: {sorted(missing)}"


def test_the_registry_imports_nothing_of_the_loop() -> None:
    """One direction within the layer: the loop applies the registry's patches, the registry
    (its wrappers included) never imports the loop."""
    import ast
    from pathlib import Path

    upward = []
    for path in Path(registry.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            upward += [f"{path.name}: {n}" for n in names if n.startswith("megatron_ext.loop")]
    assert not upward, upward
