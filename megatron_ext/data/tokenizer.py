"""A locally trained GPT-2-style byte-level BPE tokenizer, saved as a Hugging Face tokenizer
dir that ``--tokenizer-type HuggingFaceTokenizer`` loads offline (Megatron's
``GPT2BPETokenizer`` fetches ``gpt2`` from the Hub); its EOS token is Megatron's ``eod``.
"""

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

EOD_TOKEN = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
MIN_VOCAB_SIZE = 257  # the 256 byte tokens + EOD; BPE needs room for at least one merge


def train_bpe_tokenizer(
    texts: Iterable[str], out_dir: str | Path, vocab_size: int, show_progress: bool = False
) -> Path:
    """Train a byte-level BPE on ``texts``, save it as a Hugging Face tokenizer dir, return it.
    ``vocab_size`` is an upper bound (a small corpus runs out of merges); EOD gets id 0."""
    if vocab_size <= MIN_VOCAB_SIZE:
        raise ValueError(f"vocab size must exceed {MIN_VOCAB_SIZE} (256 bytes + EOD): {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    # trim_offsets=False: offsets only; the processor adds no BOS/EOS, so Megatron's
    # ``tokenize`` (which applies it) returns exactly our ``encode`` ids.
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tokenizer.train_from_iterator(texts, trainer)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / TOKENIZER_FILE))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOD_TOKEN,
        "eos_token": EOD_TOKEN,
        "unk_token": EOD_TOKEN,
        "add_prefix_space": False,
        # Keep decode() exact: the default clean-up would rewrite " ." to "." etc.
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
    }
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out_dir


@dataclass(frozen=True)
class LoadedTokenizer:
    """The subset of a tokenizer that preprocessing needs."""

    tokenizer: Tokenizer
    eod_id: int

    @property
    def vocab_size(self) -> int:
        """Vocabulary size including special tokens (what Megatron reports before padding)."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, identical to Megatron's ``tokenizer.tokenize(text)``."""
        return self.tokenizer.encode(text).ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` with special tokens (e.g. EOD) dropped."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def load_tokenizer(tokenizer_dir: str | Path) -> LoadedTokenizer:
    """Load a Hugging Face tokenizer dir; EOD is the config's ``eos_token``, as Megatron's
    ``HuggingFaceTokenizer.eod`` takes it (any fast HF tokenizer dir works)."""
    tokenizer_dir = Path(tokenizer_dir)
    missing = [n for n in (TOKENIZER_FILE, CONFIG_FILE) if not (tokenizer_dir / n).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{tokenizer_dir} is not a Hugging Face tokenizer dir (missing {', '.join(missing)}); "
            "train one with `megatron-ext preprocess --train-tokenizer`"
        )
    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_dir / TOKENIZER_FILE))
    except Exception as exc:  # the Rust library raises a bare Exception
        raise ValueError(
            f"{tokenizer_dir / TOKENIZER_FILE} is not a readable tokenizer ({exc}); restore it "
            "or train one with `megatron-ext preprocess --train-tokenizer`"
        ) from None
    try:
        config = json.loads((tokenizer_dir / CONFIG_FILE).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{tokenizer_dir / CONFIG_FILE} is not valid JSON ({exc})") from None
    eos = config.get("eos_token") if isinstance(config, dict) else None
    eos = eos.get("content") if isinstance(eos, dict) else eos  # older configs store an AddedToken
    eod_id = tokenizer.token_to_id(eos) if eos else None
    if eod_id is None:
        raise ValueError(f"{tokenizer_dir / CONFIG_FILE}: eos_token {eos!r} is not in the vocab")
    return LoadedTokenizer(tokenizer, eod_id)


def megatron_tokenizer_args(tokenizer_dir: str | Path) -> list[str]:
    """Megatron flags that load this tokenizer (an absolute path: a relative one missing from
    the training's working directory would be looked up on the Hub)."""
    model = os.path.abspath(tokenizer_dir)
    return ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", model]
