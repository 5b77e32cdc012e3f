"""``--text`` across megatron-core versions: the run's tokenizer is rebuilt from args another
version saved, and the caches another version described are found by their tokenizer.

RECORDED holds each verified version's ``unique_identifiers`` for the same tokenizers, as
recorded from that version (``HuggingFaceTokenizer`` over a local BPE directory, and
``NullTokenizer``); every CI tier checks its own version's row against the installed
megatron-core, so the table cannot drift from what the versions write.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from megatron_ext.common import versions
from megatron_ext.common.versions import VERIFIED, nearest_verified
from megatron_ext.data.tokenizer import train_bpe_tokenizer
from megatron_ext.lookup import cli
from megatron_ext.lookup.config import (
    megatron_namespace,
    process_group,
    tokenizer_from_args,
)
from megatron_ext.lookup.data import DataSpec, comparable, open_train_index
from megatron_ext.lookup.errors import ConfigError

# The compatibility tier runs this module on every supported megatron-core (tests/compat).
pytestmark = pytest.mark.compat

_TEXT = "megatron.core.tokenizers.text.models.default_tokenizer.DefaultTokenizerText"
_HF_017 = {
    "class": _TEXT,
    "tokenizer_path": "{path}",
    "vocab_file": "None",
    "merges_file": "None",
    "additional_special_tokens": "[]",
    "use_fast": "True",
    "trust_remote_code": "False",
    "include_special_tokens": "True",
}
_HF_018 = {"class": _TEXT, "tokenizer_path": "{path}", "chat_template": "None"} | _HF_017
_NULL_017 = {"class": _TEXT, "tokenizer_path": None, "vocab_size": "512"}
RECORDED = {
    "0.17.1": {"hf": _HF_017, "null": _NULL_017},
    **{v: {"hf": _HF_018, "null": _NULL_017 | {"pad_id": "-1"}} for v in ("0.18.2", "0.19.0")},
    "0.19.2": {"hf": _HF_018, "null": _NULL_017 | {"pad_id": "-1"}},
}
FLAGS = {
    "hf": ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "{path}"],
    "null": ["--tokenizer-type", "NullTokenizer", "--vocab-size", "512"],
}


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("bpe")
    texts = ["the quick brown fox jumps over the lazy dog", "hello world"] * 20
    return str(train_bpe_tokenizer(texts, directory, vocab_size=300))


def _args(kind: str, path: str, *more: str) -> argparse.Namespace:
    flags = [f.replace("{path}", path) for f in FLAGS[kind]]
    return megatron_namespace([*flags, "--seq-length", "8", "--micro-batch-size", "1", *more], None)


def _filled(identifiers: dict, path: str) -> dict:
    return {k: path if v == "{path}" else v for k, v in identifiers.items()}


def test_the_recorded_identifiers_are_the_installed_versions(bpe: str) -> None:
    assert sorted(RECORDED) == sorted(VERIFIED)
    row = RECORDED[nearest_verified(versions.installed())]
    for kind in FLAGS:
        built = dict(tokenizer_from_args(_args(kind, bpe)).unique_identifiers)
        assert built == _filled(row[kind], bpe), kind


@pytest.mark.parametrize("trained_on", sorted(RECORDED))
def test_caches_any_version_described_match_the_installed_tokenizer(
    tmp_path: Path, bpe: str, trained_on: str
) -> None:
    """The installed megatron-core builds the caches; their description is then rewritten as
    ``trained_on`` writes it (its tokenizer identifiers, files renamed by the new md5), and
    the lookup must pick it by the tokenizer the installed megatron-core builds."""
    tokenizer = tokenizer_from_args(_args("hf", bpe))
    prefix = str(tmp_path / "d")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    rng = np.random.default_rng(5)
    for _ in range(20):
        document = rng.integers(1, 250, int(rng.integers(2, 30)))
        builder.add_document(document, [len(document)])
    builder.finalize(prefix + ".idx")
    cache = tmp_path / "cache"
    config = GPTDatasetConfig(
        random_seed=1,
        sequence_length=8,
        blend=([prefix], None),
        split="100,0,0",
        path_to_cache=str(cache),
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        mid_level_dataset_surplus=0.005,
    )
    with process_group():
        BlendedMegatronDatasetBuilder(GPTDataset, [40, 0, 0], lambda: True, config).build()
    (described,) = cache.glob("*-GPTDataset-train-description.txt")
    content = json.loads(described.read_text())
    content["tokenizer"] = _filled(RECORDED[trained_on]["hf"], bpe)
    text = json.dumps(content, indent=4)
    digest = hashlib.md5(text.encode("utf-8"), usedforsecurity=False).hexdigest()
    old = described.name.split("-")[0]
    for path in cache.glob(f"{old}-*"):
        path.rename(path.with_name(path.name.replace(old, digest)))
    (cache / described.name.replace(old, digest)).write_text(text)
    spec = DataSpec((prefix,), None, False, "100,0,0", 1, 8, 40, 0.005, str(cache))
    identifiers = json.loads(json.dumps(tokenizer.unique_identifiers))
    assert open_train_index(spec, tokenizer=identifiers).hash == digest
    other = {**identifiers, "chat_template": "{{ messages }}"}  # a real difference still counts
    with pytest.raises(ConfigError, match="another tokenizer"):
        open_train_index(spec, tokenizer=other)
    assert (
        cli.main(
            [
                "--iteration",
                "2",
                "--text",
                *(f.replace("{path}", bpe) for f in FLAGS["hf"]),
                "--data-path",
                prefix,
                "--split",
                "100,0,0",
                "--seq-length",
                "8",
                "--micro-batch-size",
                "2",
                "--global-batch-size",
                "4",
                "--train-iters",
                "10",
                "--seed",
                "1",
                "--data-cache-path",
                str(cache),
                "--data-parallel-size",
                "2",
            ]
        )
        == 0
    )


def test_version_added_identifiers_at_their_default_name_the_same_tokenizer() -> None:
    for version in VERIFIED:
        for kind in FLAGS:
            assert comparable(RECORDED[version][kind]) == comparable(RECORDED["0.17.1"][kind])
    assert comparable({"chat_template": "x"}) == {"chat_template": "x"}


@pytest.mark.parametrize("saved_as", ["tokenizer_special_tokens", "special_tokens"])
def test_special_tokens_saved_under_either_versions_name_are_used(bpe: str, saved_as) -> None:
    """0.17 saves --tokenizer-special-tokens as tokenizer_special_tokens, 0.18 on as
    special_tokens: the tokenizer built on the installed version has them either way."""
    args = _args("hf", bpe)
    for name in ("tokenizer_special_tokens", "special_tokens"):
        if hasattr(args, name):
            delattr(args, name)
    setattr(args, saved_as, ["<sep>"])
    tokenizer = tokenizer_from_args(args)
    assert tokenizer.unique_identifiers["additional_special_tokens"] == "['<sep>']"
