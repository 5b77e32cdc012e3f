"""Megatron logic the overlay copies instead of calling, and the check that the copy is still right.

The lookup re-implements a few pieces where Megatron's own cannot serve (vectorised, inverted,
as the megatron-core that trained the run did, or without building datasets). Each :class:`Copy`
records, per megatron-core line, the digest of its targets' code as verified;
:meth:`Copy.verify` compares the installed source's (read with :mod:`ast`, no import).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from megatron_ext.common import versions
from megatron_ext.common.errors import Refusal
from megatron_ext.common.versions import ALL, V17, V18, V19
from megatron_ext.registry.patching import installed_version

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

    def source_for(self) -> Source:
        """The verified form for the installed version."""
        proxy = versions.nearest_verified(installed_version())
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


_TRAINING = "megatron.training.training"
_DATASETS = "megatron.core.datasets"
_CALCULATOR = "megatron.core.num_microbatches_calculator"
_LOOKUP = "megatron_ext.lookup"

# tests/unit/lookup/ prove each copy equals what it mirrors; `python -m
# megatron_ext.registry.copies` prints the installed version's digests.
COPIES: tuple[Copy, ...] = (
    Copy(
        name="lookup-sampler",
        targets=(
            "megatron.training.datasets.data_samplers:MegatronPretrainingSampler",
            "megatron.training.datasets.data_samplers:MegatronPretrainingRandomSampler",
        ),
        used_by=(f"{_LOOKUP}.schedule",),
        reason="Which DP rank and micro-batch read which sample: the single sampler's slices "
        "of the consumed-samples stream, the cyclic sampler's per-epoch permutation.",
        sources=(Source(ALL, "e3397d1e7ca1e1eb"),),
    ),
    Copy(
        name="lookup-microbatch-calculator",
        targets=(
            f"{_CALCULATOR}:_build_num_microbatches_calculator",
            f"{_CALCULATOR}:ConstantNumMicroBatchesCalculator",
            f"{_CALCULATOR}:StepBatchsizeNumMicroBatchesCalculator",
        ),
        used_by=(f"{_LOOKUP}.schedule", f"{_LOOKUP}.config"),
        reason="Each iteration's global batch: constant (rounded down with "
        "--decrease-batch-size-if-needed), or --step-batch-size-schedule's thresholds in "
        "tokens; --rampup-batch-size ignored from 0.18 on.",
        sources=(
            Source((*V18, *V19), "1135b26e454f3bda"),
            Source(
                V17,
                "5fbaa45214919cc4",
                targets=(
                    f"{_CALCULATOR}:_build_num_microbatches_calculator",
                    f"{_CALCULATOR}:ConstantNumMicroBatchesCalculator",
                    f"{_CALCULATOR}:_round",
                ),
                note="No step schedule; --rampup-batch-size builds the ramp-up calculator "
                "(lookup-rampup).",
            ),
        ),
    ),
    Copy(
        name="lookup-rampup",
        targets=(f"{_CALCULATOR}:RampupBatchsizeNumMicroBatchesCalculator",),
        used_by=(f"{_LOOKUP}.schedule",),
        reason="megatron-core 0.17 ramps the batch up by consumed samples (float steps); "
        "the lookup follows it for runs its checkpoint args show 0.17 trained.",
        sources=(
            Source(V17, "d709ef79a3640bc7"),
            Source(
                (*V18, *V19),
                "084f6871d65f0bf7",
                targets=(f"{_CALCULATOR}:init_num_microbatches_calculator",),
                note="No ramp-up calculator: init_num_microbatches_calculator warns that "
                "--rampup-batch-size is deprecated and ignores it.",
            ),
        ),
    ),
    Copy(
        name="lookup-train-iters",
        targets=(f"{_TRAINING}:update_train_iters",),
        used_by=(f"{_LOOKUP}.config",),
        reason="Sample-based runs: how many iterations --train-samples gives.",
        sources=(
            Source((*V18, *V19), "37a59f2118982794"),
            Source(V17, "b9821d7d38897e9c", note="Counts the ramp-up with unrounded sizes."),
        ),
    ),
    Copy(
        name="lookup-cache-descriptions",
        targets=(
            f"{_DATASETS}.megatron_dataset:MegatronDataset.__init__",
            f"{_DATASETS}.megatron_dataset:MegatronDataset._key_config_attributes",
            f"{_DATASETS}.gpt_dataset:GPTDataset._build_document_sample_shuffle_indices",
            f"{_DATASETS}.blended_dataset:BlendedDataset.__init__",
            f"{_DATASETS}.blended_megatron_dataset_builder:_get_size_per_split_per_dataset",
        ),
        used_by=(f"{_LOOKUP}.data",),
        reason="The caches are found by their description.txt (fields, md5 in the file "
        "names, blend member sizes with the surplus) and checked by their epochs and counts.",
        sources=(
            Source(V19, "d252f88be4ced304"),
            Source(
                V17 + V18,
                "e8cb363594b3e2d9",
                note="numpy.load where 0.19 has safe_numpy_load: the same files and names "
                "(cache files are byte-identical from 0.17.1 to 0.19.2).",
            ),
        ),
    ),
    Copy(
        name="lookup-gpt-sample",
        targets=(
            f"{_DATASETS}.gpt_dataset:GPTDataset.__getitem__",
            f"{_DATASETS}.gpt_dataset:GPTDataset._query_document_sample_shuffle_indices",
            f"{_DATASETS}.blended_dataset:BlendedDataset.__getitem__",
        ),
        used_by=(f"{_LOOKUP}.data",),
        reason="A global sample -> blend member -> shuffled sample -> documents and token "
        "spans (with the extra label token), pad tokens mapped to 0.",
        sources=(
            Source(V19, "d15939aaa5fd2756"),
            Source(V17 + V18, "56075f434c3664a3", note="The same samples (tests/unit/lookup)."),
        ),
    ),
    Copy(
        name="lookup-tokenizer-description",
        targets=(
            "megatron.core.tokenizers.utils.build_tokenizer:build_tokenizer",
            "megatron.core.tokenizers.text.text_tokenizer:MegatronTokenizerText.unique_identifiers",
        ),
        used_by=(f"{_LOOKUP}.config",),
        reason="--text rebuilds the run's tokenizer from its args and matches the caches by "
        "the tokenizer's identifiers: renamed args and added identifiers per version.",
        sources=(
            Source((*V18, *V19), "da65b16f64464dbd"),
            Source(
                V17,
                "bee89c1ff076e184",
                note="tokenizer_special_tokens / tokenizer_metadata (0.18: special_tokens / "
                "metadata_path); no chat_template, SentencePiece whitespace or Null pad "
                "identifiers.",
            ),
        ),
    ),
    Copy(
        name="lookup-indexed-dataset-format",
        targets=(
            f"{_DATASETS}.indexed_dataset:_INDEX_HEADER",
            f"{_DATASETS}.indexed_dataset:DType",
            f"{_DATASETS}.indexed_dataset:_IndexReader.__init__",
            f"{_DATASETS}.indexed_dataset:IndexedDataset.get",
        ),
        used_by=(
            f"{_LOOKUP}.data",
            "megatron_ext.common.records.pair",
            "megatron_ext.data.checks",
            "megatron_ext.data.provenance",
        ),
        reason="The lookup, the pair check, the split check and the provenance rebuild read "
        ".idx/.bin as this reader does (the layout is defined once, in records/pair.py): "
        "header, version 1, dtype code, counts, then the three arrays; tokens as "
        "IndexedDataset.get slices them.",
        sources=(Source(ALL, "63a03efdcae6fc7f"),),
    ),
)


if __name__ == "__main__":  # the digests to record after re-verifying a copy on a version
    print(f"megatron-core {installed_version()}:")
    for entry in COPIES:
        try:
            print(f"  {entry.name}: {digest(entry.source_for().targets or entry.targets)}")
        except LookupError as exc:
            print(f"  {entry.name}: missing ({exc})", file=sys.stderr)
