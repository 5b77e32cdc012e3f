"""Peak memory and time of tokenizing one long document: one ``encode`` call (how
``megatron-ext preprocess`` worked before) vs. the windowed :class:`Encoder` it uses now.

Each measurement runs in a fresh process (peak resident memory is per process) on a
synthetic English-like document of the given size, with a byte-level BPE trained on the tiny
corpus; the growth is the peak resident memory (VmHWM, reset after start-up) minus the
resident memory before tokenizing, so imports and the document's own text are not counted.

    .venv/bin/python benchmarks/preprocess_memory.py --sizes 1 4 16
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = """
import json, sys, time
from megatron_ext.data.encode import Encoder
from megatron_ext.data.tokenizer import load_tokenizer

def status(key):
    return int(next(l for l in open('/proc/self/status') if l.startswith(key)).split()[1])

tokenizer = load_tokenizer(sys.argv[1])
text = json.loads(open(sys.argv[2], encoding='utf-8').readline())['text']
encoder = Encoder(tokenizer)
open('/proc/self/clear_refs', 'w').write('5')
before, start = status('VmRSS'), time.perf_counter()
ids = tokenizer.encode(text) if sys.argv[3] == 'one call' else encoder.encode(text)
seconds = time.perf_counter() - start
print(json.dumps({'growth_kib': status('VmHWM') - before, 'seconds': seconds, 'ids': len(ids)}))
"""


def _document(path: Path, megabytes: float) -> int:
    from megatron_ext.data.corpus import write_tiny_corpus

    parts = write_tiny_corpus(path.with_suffix(".parts"), num_docs=int(720 * megabytes), seed=11)
    text = "\n\n".join(json.loads(line)["text"] for line in parts.read_text().splitlines())
    path.write_text(json.dumps({"text": text}) + "\n")
    return len(text.encode("utf-8"))


def _measure(tokenizer: Path, document: Path, method: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(tokenizer), str(document), method],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[1, 4, 16], metavar="MB")
    args = parser.parse_args()
    from megatron_ext.data.corpus import write_tiny_corpus
    from megatron_ext.data.tokenizer import train_bpe_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        corpus = write_tiny_corpus(root / "corpus.jsonl", num_docs=400)
        texts = (json.loads(line)["text"] for line in corpus.read_text().splitlines())
        tokenizer = train_bpe_tokenizer(texts, root / "tokenizer", vocab_size=1024)
        print("| document | method | peak growth MiB | × document | seconds | × one call |")
        print("|---:|---|---:|---:|---:|---:|")
        for megabytes in args.sizes:
            document = root / f"doc{megabytes}.jsonl"
            size = _document(document, megabytes)
            results = {m: _measure(tokenizer, document, m) for m in ("one call", "windowed")}
            assert results["one call"]["ids"] == results["windowed"]["ids"]
            base = results["one call"]["seconds"]
            for method, r in results.items():
                growth = r["growth_kib"] * 1024
                print(
                    f"| {size / 2**20:.1f} MiB | {method} | {growth / 2**20:.0f} | "
                    f"{growth / size:.1f} | {r['seconds']:.1f} | {r['seconds'] / base:.2f} |"
                )


if __name__ == "__main__":
    main()
