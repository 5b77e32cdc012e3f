"""A deterministic JSONL corpus for offline smoke tests and the demo: synthetic English-like
prose with learnable structure (output depends only on ``num_docs`` and ``seed``)."""

import json
import random
from collections.abc import Iterable
from pathlib import Path

# Words by kind; "|" separates entries of several words.
_WORDS: dict[str, list[str]] = {
    kind: words.split("|" if "|" in words else None)
    for kind, words in {
        "name": "Ada Bruno Chloé Dmitri Elena Farid Grace Hiro Ines Jonas Kemal Lena Mateo Nora "
        "Omar Priya",
        "noun": "river engine garden letter market window bridge lantern forest teacher village "
        "machine harbor kitchen library mountain captain student painter signal storm ladder "
        "café orchard compass violin station meadow castle notebook",
        "adj": "quiet bright ancient small heavy curious golden narrow gentle broken distant "
        "careful silver hungry patient naïve crowded honest frozen tired",
        "verb": "found carried watched opened repaired followed painted visited crossed built "
        "remembered described measured sold borrowed cleaned discovered answered",
        "adv": "slowly quickly carefully suddenly quietly happily rarely often finally almost",
        "place": "the old town|the north shore|Zürich|the valley|the harbor road|the eastern "
        "hills|the station square|São Paulo|the island",
        "time": "at dawn|in the evening|after the rain|before winter|on Monday|every morning|"
        "last year|at midnight",
    }.items()
}

_TEMPLATES: tuple[str, ...] = (
    "The {adj} {noun} {verb} the {noun2} {time}.",
    "{name} {adv} {verb} a {adj} {noun} near {place}.",
    "In {place}, {name} {verb} the {noun} and the {noun2}.",
    "{time_cap}, the {noun} was {adj} and {adj2}.",
    '"Have you seen the {noun}?" asked {name}. "It was {adj} {time}."',
    "Nobody {verb} the {adj} {noun} — not even {name}.",
    "There were {num} {noun}s in {place}, and {num2} of them were {adj}.",
    "{name} wrote {num} pages about the {noun} {time}.",
)


def _sentence(rng: random.Random) -> str:
    pick = {key: rng.choice(words) for key, words in _WORDS.items()}
    pick |= {
        "noun2": rng.choice(_WORDS["noun"]),
        "adj2": rng.choice(_WORDS["adj"]),
        "time_cap": pick["time"][0].upper() + pick["time"][1:],
        "num": rng.randint(2, 99),
        "num2": rng.randint(1, 9),
    }
    return rng.choice(_TEMPLATES).format(**pick)


def _document(rng: random.Random) -> str:
    """20-400 words in paragraphs: documents both shorter and longer than a sequence."""
    target_words = rng.randint(20, 400)
    paragraphs, words = [], 0
    while words < target_words:
        sentences = [_sentence(rng) for _ in range(rng.randint(2, 6))]
        paragraphs.append(" ".join(sentences))
        words += sum(len(s.split()) for s in sentences)
    return "\n\n".join(paragraphs)


def write_jsonl(path: str | Path, records: Iterable[dict[str, str]]) -> Path:
    """Write ``records`` as JSON Lines (UTF-8 kept as is) at ``path``, its folder made."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        f.writelines(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
    return path


def write_tiny_corpus(
    path: str | Path, num_docs: int = 400, seed: int = 1234, ids: bool = False
) -> Path:
    """Write ``num_docs`` documents as JSONL ``{"text": ...}`` lines; ``ids`` adds an ``"id"``
    (``tiny-00000``, ...) to each for ``preprocess --provenance-key id``, same texts."""
    rng = random.Random(seed)
    records = (
        {"text": _document(rng)} | ({"id": f"tiny-{n:05d}"} if ids else {}) for n in range(num_docs)
    )
    return write_jsonl(path, records)
