"""The registry's copies of Megatron logic (megatron_ext/registry/copies.py): each verifies
against the installed megatron-core (every CI tier runs this on its version), a changed copy
is refused naming it, and a tool's copy never blocks training start-up.
"""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext.common.versions import VERIFIED
from megatron_ext.lookup import cli
from megatron_ext.registry import copies
from megatron_ext.registry import table as registry
from megatron_ext.registry.copies import COPIES, Copy, CopyChanged, Source

# The compatibility tier runs this module on every supported megatron-core (tests/compat).
pytestmark = pytest.mark.compat


REPO = Path(__file__).resolve().parents[2]


def test_every_copy_verifies_on_the_installed_megatron_core() -> None:
    copies.verify(COPIES)
    for entry in COPIES:
        assert entry.scope == "tools" and entry.used_by, entry.name
        # the modules named as holding the copy exist (a module that moved is renamed here)
        for module in entry.used_by:
            path = REPO.joinpath(*module.split(".")).with_suffix(".py")
            assert path.is_file(), f"{entry.name}: used_by names {module}, which does not exist"
        assert entry.source_for().digest == copies.digest(
            entry.source_for().targets or entry.targets
        )


def test_every_copy_covers_each_verified_version_once() -> None:
    """A dropped or duplicated per-version source fails here on every version."""
    for entry in COPIES:
        assert sorted(entry.covers()) == sorted(VERIFIED), entry.name
    names = [entry.name for entry in COPIES]
    assert len(names) == len(set(names))
    assert not {entry.name for entry in registry.ENTRIES} & set(names)


def _changed(entry: Copy) -> Copy:
    """``entry`` as if the installed megatron-core's code differed from the verified code."""
    source = entry.source_for()
    wrong = dataclasses.replace(source, digest="0" * 16)
    return dataclasses.replace(
        entry, sources=tuple(wrong if s is source else s for s in entry.sources)
    )


def test_a_changed_copy_is_refused_by_the_lookup_naming_it(monkeypatch, capsys) -> None:
    changed = _changed(COPIES[1])
    with pytest.raises(CopyChanged, match=f"copy {changed.name!r}"):
        changed.verify()
    monkeypatch.setattr(cli, "COPIES", (COPIES[0], changed))
    assert cli.main(["--iteration", "1", "--seq-length", "8", "--data-path", "x"]) == 1
    err = capsys.readouterr().err
    assert "refused" in err and changed.name in err and "Traceback" not in err


def test_a_tools_copy_never_blocks_training_start_up(monkeypatch) -> None:
    broken = _changed(COPIES[0])
    monkeypatch.setattr(registry, "ENTRIES", ())  # the patches' checks are not the subject
    monkeypatch.setattr(registry, "COPIES", (broken,))
    registry.verify_all()  # the training start-up check: the tools' copy is theirs
    with pytest.raises(CopyChanged):
        copies.verify(registry.COPIES)  # the lookup's check (megatron_ext.lookup.cli)
    monkeypatch.setattr(registry, "COPIES", (dataclasses.replace(broken, scope="training"),))
    with pytest.raises(CopyChanged, match=broken.name):
        registry.verify_all()


def test_a_target_megatron_no_longer_has_is_refused() -> None:
    gone = Copy(
        name="gone",
        targets=("megatron.core.num_microbatches_calculator:no_such_function",),
        reason="test",
        used_by=("tests",),
        sources=(Source(VERIFIED, "0" * 16),),
    )
    with pytest.raises(CopyChanged, match="missing"):
        gone.verify()


def test_the_digest_is_the_code_not_its_comments_or_docstrings() -> None:
    plain = "def f(a):\n    return a + 1\n"
    noted = 'def f(a):\n    """Why."""\n    # a comment\n    return a + 1  # more\n'
    changed = "def f(a):\n    return a + 2\n"
    dump = [copies._code_only(ast.parse(text).body[0]) for text in (plain, noted, changed)]
    assert dump[0] == dump[1] != dump[2]


def test_the_check_imports_neither_megatron_nor_torch() -> None:
    """The lookup runs the check on every start: it reads source files, imports nothing."""
    code = (
        "import sys\n"
        "from megatron_ext.registry import copies\n"
        "from megatron_ext.registry.copies import COPIES\n"
        "copies.verify(COPIES)\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('megatron', 'torch'))\n"
        "assert not heavy, heavy[:10]\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
