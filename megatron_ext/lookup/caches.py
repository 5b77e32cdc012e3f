"""Finding a run's index caches: which files on disk are the caches training used.

Megatron builds, per train split, ``GPTDataset`` caches (``document_index``, ``sample_index``,
``shuffle_index``) and for blends ``BlendedDataset`` caches (``dataset_index``,
``dataset_sample_index``), each named ``{md5}-{class}-train-*`` after the md5 of the
``description.txt`` next to them (docs/megatron-facts.md, "Data"). :func:`find_train_caches`
looks for the descriptions that match the run's dataset configuration (:class:`DataSpec`),
never rebuilding anything, and refuses what is missing or does not belong together:

- each description's md5 must equal the hash in its file names (else it was edited);
- a blend's member descriptions must be on disk, exactly the ones embedded in the blend's own;
- every ``.npy`` file a description names must be there.

Nothing is opened here: :mod:`megatron_ext.lookup.indices` maps what this module found.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_ext.lookup.errors import CacheMissing, ConfigError, DataChanged
from megatron_ext.lookup.formats import (
    Description,
    normalize,
    read_description,
    remap,
    split_matrix,
)
from megatron_ext.lookup.tokenizer import comparable

GPT, BLENDED = "GPTDataset", "BlendedDataset"
GPT_FILES = ("document_index", "sample_index", "shuffle_index")
BLENDED_FILES = ("dataset_index", "dataset_sample_index")


@dataclass(frozen=True)
class DataSpec:
    """What identifies a run's train dataset: the inputs of Megatron's dataset builder."""

    prefixes: tuple[str, ...]  # as passed to training (--data-path / --train-data-path)
    weights: tuple[float, ...] | None  # None: blend by dataset size (or a single prefix)
    per_split: bool  # --train-data-path / --per-split-data-args-path: no --split
    split: str | None
    seed: int
    sequence_length: int
    target_samples: int  # the train split size Megatron requested (for the phase)
    surplus: float  # --mid-level-dataset-surplus
    cache_dir: str | None  # --data-cache-path
    add_extra_token: bool = True


@dataclass(frozen=True)
class FoundDataset:
    """One GPTDataset's caches: its description (md5 checked) and the files named after it."""

    description: Description
    files: dict[str, str]  # each of GPT_FILES -> its .npy path


@dataclass(frozen=True)
class FoundCaches:
    """The run's train caches, all on disk and belonging together, not yet opened."""

    kind: str  # GPT or BLENDED
    description: Description  # the train dataset's own: its GPTDataset's, or the blend's
    datasets: tuple[FoundDataset, ...]  # in blend order
    blend_files: dict[str, str] | None = None  # a blend's BLENDED_FILES -> .npy path


def _canonical(value: Any) -> Any:
    """Tuples to lists etc., as a JSON round trip leaves a description."""
    return json.loads(json.dumps(value))


def _split_matrix(spec: DataSpec) -> Any:
    if spec.per_split:
        return None
    return _canonical(split_matrix(spec.split))


def _differences(found: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    return [
        f"{k}={found.get(k)!r} (expected {v!r})"
        for k, v in expected.items()
        if k != "datasets" and found.get(k) != v
    ]


def _expected_gpt(
    spec: DataSpec, prefix: str, num_samples: int | None, matrix: Any
) -> dict[str, Any]:
    return {
        "class": GPT,
        "dataset_path": prefix,
        "num_samples": num_samples,
        "index_split": "train",
        "random_seed": spec.seed,
        "sequence_length": spec.sequence_length,
        "split": None if spec.per_split else spec.split,
        "split_matrix": matrix,
    }


def _recorded_cache_dir(spec: DataSpec, data_root: Sequence[tuple[str, str]]) -> str | None:
    """The run's --data-cache-path through the ``--data-root OLD=NEW`` remapping: caches
    usually move with the data (an explicit --cache-dir is taken as given)."""
    return remap(spec.cache_dir, data_root) if spec.cache_dir else None


def _gpt_cache_dir(
    spec: DataSpec, prefix: str, cache_dir: str | None, data_root: Sequence[tuple[str, str]]
) -> Path:
    """Where Megatron put a GPTDataset's caches: --data-cache-path, else next to the data."""
    chosen = cache_dir or _recorded_cache_dir(spec, data_root)
    if chosen:
        return Path(chosen)
    return Path(remap(prefix, data_root)) / "cache" / f"{GPT}_indices"


def _member_sizes(spec: DataSpec) -> tuple[list[int | None], list[float] | None, int | None]:
    """Per-member num_samples, blend weights and blend size, as BlendedMegatronDatasetBuilder.

    The builder normalises the weights to size the members, and BlendedDataset normalises them
    once more before writing its description; the second pass can move the last bit.
    """
    if spec.weights is None:
        return [None] * len(spec.prefixes), None, None
    weights = normalize(spec.weights)
    target = [math.ceil(spec.target_samples * w) for w in weights]
    buffered = [math.ceil(t * (1 + spec.surplus)) for t in target]
    return list(buffered), normalize(weights), sum(target)


def _choose(found: list[Description], tokenizer: dict[str, Any] | None, what: str) -> Description:
    """One cache among those matching on every field; the tokenizer decides between them."""

    def tok(description: Description) -> Any:
        # As every verified megatron-core names it (0.18 added identifiers: .tokenizer).
        return comparable(
            description.content.get("datasets", [description.content])[0].get("tokenizer")
        )

    if tokenizer is not None:
        same = [f for f in found if tok(f) == comparable(tokenizer)]
        if not same:
            raise ConfigError(
                f"the {what} caches that match this run ({', '.join(f.path.name for f in found)})"
                f" were built with another tokenizer ({tok(found[0])}) than the one given"
            )
        found = same
    if len({json.dumps(tok(f), sort_keys=True) for f in found}) > 1:
        raise ConfigError(
            f"several {what} caches match this run and differ only in the tokenizer "
            f"({', '.join(f.path.name for f in found)}); pass the run's tokenizer flags (or "
            "--from-checkpoint) so the right one is chosen"
        )
    return found[0].trusted()


def _scan(directory: Path, kind: str) -> list[Description]:
    if not directory.is_dir():
        return []
    return [
        read_description(path) for path in sorted(directory.glob(f"*-{kind}-train-description.txt"))
    ]


def _not_found(
    kind: str, directory: Path, candidates: list[Description], expected: dict[str, Any]
) -> CacheMissing:
    near = [
        f"  {d.path.name}: "
        + (", ".join(_differences(d.content, expected)) or "differs in a member dataset")
        for d in candidates[:5]
    ]
    broken = [d.path.name for d in candidates if not d.intact]
    return CacheMissing(
        f"no {kind} train cache in {directory} matches this run "
        f"({len(candidates)} other {kind} train caches there)"
        + ("; nearest:\n" + "\n".join(near) if near else "")
        + (
            f"\n{len(broken)} description(s) there do not hash to their names (edited?): "
            f"{', '.join(broken[:5])}"
            if broken
            else ""
        )
        + "\nIf the caches were deleted, rebuild them with --rebuild-caches (megatron-core's "
        "BlendedMegatronDatasetBuilder, same config); if they live elsewhere, pass --cache-dir."
    )


def _files(base: str, kind: str, names: tuple[str, ...]) -> dict[str, str]:
    """The ``.npy`` files of one cache (``base`` is their common name); refuses missing ones."""
    files = {name: f"{base}{name}.npy" for name in names}
    missing = [path for path in files.values() if not os.path.isfile(path)]
    if missing:
        raise CacheMissing(f"{kind} cache files missing: {', '.join(missing)}")
    return files


def _dataset(directory: Path, trusted: Description) -> FoundDataset:
    """A GPTDataset's caches in ``directory``, named after its trusted description's md5."""
    base = str(directory / f"{trusted.digest}-{GPT}-train-")
    return FoundDataset(trusted, _files(base, GPT, GPT_FILES))


def _member(
    spec: DataSpec,
    blend: Description,
    member: dict[str, Any],
    cache_dir: str | None,
    data_root: Sequence[tuple[str, str]],
) -> FoundDataset:
    """A blend member's caches: the description embedded in the blend's must be on disk, under
    its md5, word for word (else the member caches are not the ones the blend was built on)."""
    member_text = json.dumps(member, indent=4)
    member_dir = _gpt_cache_dir(spec, member["dataset_path"], cache_dir, data_root)
    digest = hashlib.md5(member_text.encode("utf-8"), usedforsecurity=False).hexdigest()
    member_path = member_dir / f"{digest}-{GPT}-train-description.txt"
    if not member_path.is_file():
        raise CacheMissing(
            f"the blend cache {blend.path.name} names the GPTDataset cache {member_path}, which "
            "is missing; rebuild with --rebuild-caches"
        )
    member_description = read_description(member_path).trusted()
    if member_description.text != member_text:
        raise DataChanged(f"{member_path} differs from the blend description {blend.path.name}")
    return _dataset(member_dir, member_description)


def find_train_caches(
    spec: DataSpec,
    *,
    cache_dir: str | None = None,
    data_root: Sequence[tuple[str, str]] = (),
    tokenizer: dict[str, Any] | None = None,
) -> FoundCaches:
    """Find and verify the caches of the run's train dataset (never building any).

    ``tokenizer`` (the tokenizer's ``unique_identifiers``) only disambiguates caches that differ
    in nothing else; descriptions are matched on every other field.
    """
    matrix = _split_matrix(spec)
    if len(spec.prefixes) == 1 and (spec.weights is None or spec.per_split):
        directory = _gpt_cache_dir(spec, spec.prefixes[0], cache_dir, data_root)
        expected = _expected_gpt(spec, spec.prefixes[0], spec.target_samples, matrix)
        candidates = _scan(directory, GPT)
        found = [
            c
            for c in candidates
            if {k: v for k, v in c.content.items() if k != "tokenizer"} == expected
        ]
        if not found:
            raise _not_found(GPT, directory, candidates, expected)
        trusted = _choose(found, tokenizer, GPT)
        return FoundCaches(GPT, trusted, (_dataset(directory, trusted),))

    chosen = cache_dir or _recorded_cache_dir(spec, data_root)
    if not chosen:
        raise CacheMissing(
            "this run blends several datasets without --data-cache-path, so Megatron computed "
            "the blend indices in memory and never stored them; pass --rebuild-caches "
            "--cache-dir DIR to build them with megatron-core's builder (they are deterministic)"
        )
    directory = Path(chosen)
    sizes, weights, size = _member_sizes(spec)
    members = [_expected_gpt(spec, p, n, matrix) for p, n in zip(spec.prefixes, sizes)]
    expected_top = {"class": BLENDED, "split": "train"}
    if weights is not None:
        expected_top |= {"weights": weights, "size": size}
    candidates = _scan(directory, BLENDED)

    def matches(description: dict[str, Any]) -> bool:
        inner = description.get("datasets", [])
        return (
            all(description.get(k) == v for k, v in expected_top.items())
            and len(inner) == len(members)
            and all(
                {k: v for k, v in d.items() if k != "tokenizer"} == m
                for d, m in zip(inner, members)
            )
        )

    found = [c for c in candidates if matches(c.content)]
    if not found:
        raise _not_found(BLENDED, directory, candidates, expected_top)
    blend = _choose(found, tokenizer, BLENDED)
    datasets = tuple(
        _member(spec, blend, member, cache_dir, data_root) for member in blend.content["datasets"]
    )
    base = str(blend.path)[: -len("description.txt")]
    return FoundCaches(BLENDED, blend, datasets, _files(base, BLENDED, BLENDED_FILES))
