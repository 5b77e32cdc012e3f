"""Registry entries for Megatron logic the overlay *copies* instead of calling.

The lookup answers in milliseconds because it imports no Megatron: it re-implements a few
pieces (the sampler's order, the micro-batch calculator and ramp-up, the dataset caches'
names and descriptions, the tokenizer's description, the data-flag rules). A copy is right
only while the Megatron code it mirrors is the code it was verified against, so each
:class:`Copy` names its targets and, per megatron-core line, the digest of their source as
verified (:class:`Source`, with the exact versions). :meth:`Copy.verify` reads the installed
megatron-core's source files with :mod:`ast` (no import: milliseconds, no torch) and refuses,
naming the entry, when a target's code differs. Comments, docstrings and formatting do not
count; any change to the code does.

``scope`` says who relies on a copy: ``"tools"`` (the lookup and other offline tools: their
own check runs when they run, and training start-up skips the entry, so a tool's copy can never
block a training job) or ``"training"`` (checked at training start-up too). Regenerate a digest
after re-verifying a copy with ``python -m megatron_ext.registry.copies`` under that megatron-core.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from megatron_ext.common import versions
from megatron_ext.common.errors import Refusal

Scope = Literal["tools", "training"]


class CopyChanged(Refusal, RuntimeError):
    """The installed megatron-core's code differs from what a copy was verified against."""


@dataclass(frozen=True)
class Source:
    """A copy's targets as verified on ``verified_on``: their code's digest there."""

    verified_on: tuple[str, ...]
    digest: str
    targets: tuple[str, ...] | None = None  # None: the entry's own
    note: str = ""  # what differs on these versions, and how the copy follows it


@dataclass(frozen=True)
class Copy:
    """Megatron code (``module:qualname`` targets) that megatron-ext re-implements."""

    name: str
    targets: tuple[str, ...]
    reason: str
    used_by: tuple[str, ...]  # the megatron-ext modules holding the copy
    sources: tuple[Source, ...]
    scope: Scope = "tools"

    def covers(self) -> tuple[str, ...]:
        return tuple(v for source in self.sources for v in source.verified_on)

    def source_for(self, version: str | None = None) -> Source:
        """The verified form for ``version`` (installed when None)."""
        found = installed_version() if version is None else version
        proxy = versions.nearest_verified(found)
        for source in self.sources:
            if proxy in source.verified_on:
                return source
        raise CopyChanged(
            f"megatron-ext copy {self.name!r}: never verified on megatron-core {proxy} "
            f"(verified on {', '.join(self.covers())})"
        )

    def verify(self) -> None:
        """Refuse unless the installed megatron-core's targets have the verified code."""
        source = self.source_for()
        targets = source.targets or self.targets
        try:
            found = digest(targets)
        except LookupError as exc:
            found = f"missing ({exc})"
        if found != source.digest:
            raise CopyChanged(
                f"megatron-ext copy {self.name!r} (in {', '.join(self.used_by)}): the code of "
                f"{', '.join(targets)} in the installed megatron-core {installed_version()} is "
                f"not the code the copy was verified against on {', '.join(source.verified_on)} "
                f"(digest {found}, verified {source.digest}). The copy may now give wrong "
                "answers: re-verify it against this megatron-core (`megatron-ext patches` lists "
                "every entry), or install a verified version."
            )


@functools.cache
def installed_version() -> str:
    """The installed megatron-core's version, as the copies' messages name it (no import)."""
    return versions.installed() or "not installed"


@functools.cache
def _module_source(module: str) -> tuple[str, str]:
    """(path, text) of a megatron module's source, found on disk without importing megatron."""
    top, _, rest = module.partition(".")
    spec = importlib.util.find_spec(top)  # a top-level lookup imports nothing
    if spec is None or not spec.submodule_search_locations:
        raise LookupError(f"{top} is not installed")
    for root in spec.submodule_search_locations:
        base = Path(root, *rest.split(".")) if rest else Path(root)
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                return str(path), path.read_text(encoding="utf-8")
    raise LookupError(f"no source for {module}")


_TOP_LEVEL = re.compile(r"^[A-Za-z_@]", re.MULTILINE)


def _top_level(module: str, name: str) -> list[ast.stmt]:
    """The module's statements that may define ``name``: only its top-level block is parsed
    (arguments.py and training.py are thousands of lines; parsing them whole costs seconds),
    the whole module when the block does not parse on its own."""
    path, text = _module_source(module)
    header = re.compile(
        rf"^(?:@.*\n)*(?:(?:async\s+)?def|class)\s+{re.escape(name)}\b|^{re.escape(name)}\s*[:=]",
        re.MULTILINE,
    )
    found = header.search(text)
    if found is not None:
        line_end = text.find("\n", found.end())
        following = _TOP_LEVEL.search(text, line_end + 1) if line_end >= 0 else None
        block = text[found.start() : following.start() if following else len(text)]
        with contextlib.suppress(SyntaxError):
            return ast.parse(block, path).body
    return ast.parse(text, path).body


def _node(target: str) -> ast.AST:
    module, _, qualname = target.partition(":")
    first, *rest = qualname.split(".")
    scope: list[ast.stmt] = _top_level(module, first)
    node: ast.AST | None = None
    for part in (first, *rest):
        node = next((n for n in scope if _defines(n, part)), None)
        if node is None:
            raise LookupError(f"{target}: no {part!r}")
        scope = getattr(node, "body", [])
    assert node is not None
    return node


def _defines(node: ast.stmt, name: str) -> bool:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return node.name == name
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
    if isinstance(node, ast.AnnAssign):
        return isinstance(node.target, ast.Name) and node.target.id == name
    return False


def _code_only(node: ast.AST) -> str:
    """The node's AST without docstrings (positions and comments are never in a dump)."""
    # Edits the tree in place: each call parses its own (_top_level caches no tree).
    for child in ast.walk(node):
        body = getattr(child, "body", None)
        if (
            isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Module)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            child.body = body[1:] or [ast.Pass()]
    return ast.dump(node, annotate_fields=False)


def digest(targets: tuple[str, ...]) -> str:
    """The digest of the installed code of ``targets`` (what :class:`Source` records)."""
    text = "\n".join(_code_only(_node(target)) for target in targets)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def verify(copies: tuple[Copy, ...], scope: Scope | None = None) -> None:
    """Verify ``copies`` (only those of ``scope`` when given)."""
    for entry in copies:
        if scope is None or entry.scope == scope:
            entry.verify()
