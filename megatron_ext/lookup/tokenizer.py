"""The run's tokenizer (``--text``), across megatron-core versions.

The lookup builds the run's tokenizer with the installed megatron-core's ``build_tokenizer``
from the run's saved args, and picks the index cache whose description names the same
tokenizer (``unique_identifiers``). Both differ between versions for the same tokenizer:

- args: 0.18 renamed ``tokenizer_special_tokens`` to ``special_tokens`` and
  ``tokenizer_metadata`` to ``metadata_path`` (same flags, ``--tokenizer-special-tokens`` /
  ``--tokenizer-metadata``), so a 0.17 checkpoint read on 0.18+ (or the reverse) would build
  the tokenizer without its special tokens;
- identifiers: from 0.18 on ``build_tokenizer`` passes keyword arguments 0.17 did not, and each
  becomes an identifier of the tokenizer even when unset: ``chat_template`` (Hugging Face,
  SentencePiece, TikToken), ``ignore_extra_whitespaces`` (SentencePiece; 0.17's tokenizer has
  the same default) and ``pad_id`` (NullTokenizer; 0.17's has no pad, which GPTDataset treats
  as -1 as well). Their default value names the same tokenizer as their absence
  (:func:`comparable`); any other value still tells tokenizers apart.

tests/unit/lookup/test_lookup_tokenizer.py holds every verified version's identifiers as
recorded from it, and each CI tier checks its own row.

Building Megatron's tokenizer imports megatron.core, torch and transformers: 8 s of CPU for a
lookup that takes 0.5 s without ``--text``. The tokenizers ``megatron-ext preprocess`` trains
(a local directory holding a generic fast tokenizer, no pad token, no chat template, run with
no tokenizer flag beyond ``--tokenizer-model``) are read by the ``tokenizers`` library alone
(:class:`LocalTokenizer`): the same text, pad id and identifiers as Megatron's, which every
CI tier checks against the tokenizer its megatron-core builds.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
from collections.abc import Sequence
from typing import Any

from megatron_ext.lookup.errors import ConfigError
from megatron_ext.lookup.formats import remap

# (0.17 name, 0.18+ name) of the same tokenizer flag's dest.
RENAMED = (("tokenizer_special_tokens", "special_tokens"), ("tokenizer_metadata", "metadata_path"))
# Identifiers 0.18+ add, with the value that names the same tokenizer as their absence in 0.17.
ADDED_DEFAULTS = {"chat_template": "None", "ignore_extra_whitespaces": "True", "pad_id": "-1"}


def comparable(identifiers: dict[str, Any] | None) -> dict[str, Any] | None:
    """A tokenizer's ``unique_identifiers`` as every verified megatron-core would write them
    (version-added identifiers at their default dropped), for matching a run's caches."""
    if identifiers is None:
        return None
    return {k: v for k, v in identifiers.items() if ADDED_DEFAULTS.get(k, object()) != v}


TOKENIZER_PATH_ARGS = ("tokenizer_model", "vocab_file", "merge_file")
# Megatron's identifiers of such a tokenizer, as :func:`comparable` writes every version's.
LOCAL_IDENTIFIERS = {
    "class": "megatron.core.tokenizers.text.models.default_tokenizer.DefaultTokenizerText",
    "vocab_file": "None",
    "merges_file": "None",
    "additional_special_tokens": "[]",
    "use_fast": "True",
    "trust_remote_code": "False",
    "include_special_tokens": "True",
}
# Flags that would make Megatron build the tokenizer otherwise (unset: None or False).
OTHER_FLAGS = ("vocab_file", "merge_file", "chat_template", "tokenizer_metadata", "metadata_path")
OTHER_FLAGS += ("tokenizer_special_tokens", "special_tokens", "trust_remote_code")
OTHER_FLAGS += ("tokenizer_hf_no_use_fast", "tokenizer_hf_no_include_special_tokens")


class LocalTokenizer:
    """What the lookup reads of Megatron's ``HuggingFaceTokenizer`` (:func:`text_tokenizer`
    says when it is this): the text of ids (its ``convert_ids_to_tokens`` then the fast
    tokenizer's decoder, as transformers' ``convert_tokens_to_string``), no pad token, the
    identifiers. No torch, transformers or megatron.core import."""

    pad = None

    def __init__(self, directory: str) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))
        self.unique_identifiers = {**LOCAL_IDENTIFIERS, "tokenizer_path": directory}

    def detokenize(self, ids: list[int]) -> str:
        tokens = [t for t in map(self.tokenizer.id_to_token, ids) if t is not None]
        decoder = self.tokenizer.decoder
        return decoder.decode(tokens) if decoder is not None else " ".join(tokens)


def _local(directory: str) -> bool:
    """A directory holding a generic fast tokenizer with no pad token and no chat template."""
    try:
        with open(os.path.join(directory, "tokenizer_config.json")) as handle:
            config = json.load(handle)
    except (OSError, ValueError):
        return False
    mapped = os.path.join(directory, "special_tokens_map.json")
    return (
        os.path.isfile(os.path.join(directory, "tokenizer.json"))
        and config.get("tokenizer_class") == "PreTrainedTokenizerFast"
        and not {"pad_token", "chat_template", "added_tokens_decoder"} & set(config)
        and not os.path.exists(mapped)
    )


def text_tokenizer(args: argparse.Namespace, data_root: Sequence[tuple[str, str]] = ()) -> Any:
    """``--text``'s tokenizer: a :class:`LocalTokenizer` where it reads the run's tokenizer as
    Megatron would, else Megatron's (:func:`tokenizer_from_args`)."""
    path = getattr(args, "tokenizer_model", None)
    if (
        args.tokenizer_type == "HuggingFaceTokenizer"
        and isinstance(path, str)
        and os.path.isabs(path)
        and not any(getattr(args, name, None) for name in OTHER_FLAGS)
        and _local(remap(path, data_root))
    ):
        return LocalTokenizer(remap(path, data_root))
    return tokenizer_from_args(args, data_root)


def tokenizer_from_args(args: argparse.Namespace, data_root: Sequence[tuple[str, str]] = ()) -> Any:
    """The run's tokenizer, built by Megatron from the same flags training used; its files
    are read through the ``--data-root`` remapping, like the data (they usually move with it).
    The run's args may come from another megatron-core: renamed fields are carried over
    (:data:`RENAMED`).
    """
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    if args.tokenizer_type is None:
        raise ConfigError("no tokenizer in the run's args; pass --tokenizer-type/--tokenizer-model")
    args = copy.copy(args)
    args.rank = 0
    for old, new in RENAMED:
        value = getattr(args, old, None)
        value = value if value is not None else getattr(args, new, None)
        setattr(args, old, value)  # whichever name the installed build_tokenizer reads
        setattr(args, new, value)
    for name in TOKENIZER_PATH_ARGS:
        value = getattr(args, name, None)
        if not isinstance(value, str) or not os.path.isabs(value):
            continue  # unset, or a hub name such as "gpt2"
        moved = remap(value, data_root)
        if not os.path.exists(moved):
            hint = (
                f" (mapped from {value} by --data-root)"
                if moved != value
                else "; if it moved with the data, map the old location with --data-root OLD=NEW"
            )
            raise ConfigError(f"--text: the run's tokenizer file {moved} is not there{hint}")
        setattr(args, name, moved)
    try:
        return build_tokenizer(args)
    except Exception as exc:  # any failure of the tokenizer library: say which tokenizer
        raise ConfigError(
            f"--text: cannot build the run's tokenizer ({args.tokenizer_type} "
            f"{getattr(args, 'tokenizer_model', None)}): {type(exc).__name__}: {exc}"
        ) from None


def pad_token_id(tokenizer: Any, allow_ambiguous: bool) -> int:
    """The pad id GPTDataset uses (MegatronDataset.__init__): the tokenizer's, or -1 when it
    is missing or collides with another special token."""
    try:
        pad = tokenizer.pad
    except Exception:  # Megatron's own fallback is this broad: any failure means "no pad"
        return -1
    try:
        specials = [v for k, v in tokenizer.special_tokens_dict.items() if k != "pad_token"]
    except (AttributeError, IndexError, ValueError):
        specials = []
    if not specials:
        for name in ("eos", "eod"):
            with contextlib.suppress(AttributeError, NotImplementedError):
                specials.append(getattr(tokenizer, name))
    if pad in specials and not allow_ambiguous:
        return -1
    return pad
