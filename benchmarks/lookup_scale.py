"""``megatron-ext lookup`` at the size of a real run: old code path and new, side by side.

The setting (issue "At the size of a real run"), at ``--scales`` of it: a 3-dataset blend of
30 B tokens in 50 M documents (log-normal lengths), seq 4096, global batch 1024, DP=64 with
micro-batch 4, 100 k iterations, and a DP=64 sample log of those iterations. What is real:
the ``.idx`` files (megatron-core's ``IndexedDatasetBuilder`` writes them), the index caches
(megatron-core's ``BlendedMegatronDatasetBuilder`` builds them), the sample log (the real
``SampleLog`` writer opens every attempt and writes its first record; the rest are lines of
exactly the bytes it writes, checked against it, because 25 M ``json.dumps`` calls would take
the benchmark's whole budget). The log has a restart: attempt 1 trains 1..80 % and attempt 2
resumes from 70 % to the end, so the asked iteration (75 %) is in the file twice. The sample ids
are those Megatron's sampler hands out and the token SHA-1s those of the data (the ``.bin``
files are sparse, all tokens 0), so ``--sample-log`` answers "match" on both code paths.

Every operation is one ``megatron-ext lookup`` process (``megatron_ext.lookup.cli.main``),
run on this tree and, with ``--compare REV``, on git revision REV's ``megatron_ext`` (extracted
with ``git archive``), with the benchmark's files evicted from the page cache before each run
(``posix_fadvise(DONTNEED)`` on its own files only), as an on-call engineer's first query
finds them. Figures: wall time and the process's peak RSS.

    python benchmarks/lookup_scale.py --compare 24f31e7          # 1/100 and 1/10, BENCHMARKS.md
    python benchmarks/lookup_scale.py --scales 0.01 --workdir /tmp/lks   # keep the files
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
WEIGHTS = (0.5, 0.3, 0.2)
SEQ, GBS, DP, MBS = 4096, 1024, 64, 4
FULL = {"documents": 50_000_000, "tokens": 30_000_000_000, "iterations": 100_000}
SEED = 1234


def _count(name: str, scale: float) -> int:
    return max(1, round(FULL[name] * scale))


def _prefixes(root: Path) -> list[str]:
    return [str(root / "data" / f"part{k}_text_document") for k in range(len(WEIGHTS))]


def build_data(root: Path, scale: float) -> None:
    """Real .idx files (megatron-core's writer), sparse .bin files, Megatron's caches."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from megatron.core.tokenizers import MegatronTokenizer

    rng = np.random.default_rng(SEED)
    (root / "data").mkdir(parents=True, exist_ok=True)
    for weight, prefix in zip(WEIGHTS, _prefixes(root)):
        documents = round(_count("documents", scale) * weight)
        sigma = 1.5  # long tail: a few documents of 10^5 tokens among many short ones
        raw = rng.lognormal(
            math.log(_count("tokens", scale) / _count("documents", scale)), sigma, documents
        )
        lengths = np.maximum(1, np.rint(raw * (_count("tokens", scale) * weight / raw.sum())))
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
        builder.sequence_lengths = lengths.astype(np.int64).tolist()  # one sequence per document
        builder.document_indices = list(range(documents + 1))
        builder.finalize(prefix + ".idx")  # megatron-core's .idx writer; the .bin is empty...
        with open(prefix + ".bin", "r+b") as out:
            out.truncate(int(lengths.sum()) * 2)  # ...and now sparse, of the right size
    config = GPTDatasetConfig(
        random_seed=SEED,
        sequence_length=SEQ,
        blend=(_prefixes(root), list(WEIGHTS)),
        split="100,0,0",
        path_to_cache=str(root / "cache"),
        tokenizer=MegatronTokenizer.from_pretrained(
            metadata_path={"library": "null-text"}, vocab_size=50_304
        ),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )
    target = _count("iterations", scale) * GBS
    BlendedMegatronDatasetBuilder(GPTDataset, [target, 0, 0], lambda: True, config).build()


def _line(iteration: int, rank: int, microbatch: int, digest: str, losses: list[float]) -> str:
    """One record, byte for byte as ``SampleLog.write`` writes it (checked in build_log)."""
    first = (iteration - 1) * GBS + microbatch * MBS * DP + rank * MBS
    ids = ",".join(str(first + k) for k in range(MBS))
    loss = sum(losses) * SEQ
    return (
        f'{{"iteration":{iteration},"dp_rank":{rank},"microbatch":{microbatch},'
        f'"sample_ids":[{ids}],"token_sha1":[{",".join(digest for _ in range(MBS))}],'
        f'"loss_sum":{loss!r},"num_tokens":{MBS * SEQ},'
        f'"sample_losses":[{",".join(map(repr, losses))}],"lm_loss_sum":{loss!r}}}\n'
    )


def build_log(root: Path, scale: float) -> None:
    """DP=64 sample log: attempt 1 trains 1..80 %, attempt 2 resumes at 70 % to the end."""
    from megatron_ext.common.io import json_safe, token_sha1
    from megatron_ext.common.records.sample_log import SampleLog, SampleRecord

    iterations = _count("iterations", scale)
    digest = json.dumps(token_sha1(np.zeros(SEQ, dtype=np.int64)))  # sparse .bin: all 0
    rng = np.random.default_rng(7)
    losses = rng.uniform(1.5, 4.0, size=(4096, MBS)).tolist()
    attempts = [(1, int(iterations * 0.8)), (int(iterations * 0.7) + 1, iterations)]
    directory = root / "samples"
    for rank in range(DP):
        for job, (first, last) in enumerate(attempts, start=1):
            log = SampleLog(directory, rank, job_id=f"bench{job}")
            record = json.loads(_line(first, rank, 0, digest, losses[0]))
            log.write(SampleRecord(**record))  # the real writer: attempt index + first record
            written = log.path.read_bytes()[-4096:].decode().splitlines()[-1] + "\n"
            assert written == _line(first, rank, 0, digest, losses[0]), "format drifted"
            assert json.dumps(json_safe(record), separators=(",", ":")) + "\n" == written
            with open(log.path, "a", buffering=1 << 22) as out:
                k = 1
                for iteration in range(first, last + 1):
                    for microbatch in range(1 if iteration == first else 0, MBS):
                        out.write(_line(iteration, rank, microbatch, digest, losses[k % 4096]))
                        k += 1


def _evict(root: Path) -> None:
    """Drop this benchmark's own files from the page cache (nobody else's)."""
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# ``megatron-ext lookup`` of the tree on PYTHONPATH (the console script would run this tree's).
_MAIN = "import sys; from megatron_ext.lookup.cli import main; sys.exit(main(sys.argv[1:]))"


def _run(
    tree: Path, flags: list[str], root: Path, timeout: float, expect: str
) -> tuple[float, float, float, int, str]:
    """(wall s, CPU s, peak RSS GiB, exit code, stderr tail) of one lookup process on ``tree``;
    killed after ``timeout`` seconds (exit code -9); exit code 99 when its answer lacks
    ``expect`` (a timing of a wrong answer is no timing)."""
    _evict(root)
    env = dict(os.environ, PYTHONPATH=str(tree))
    with tempfile.TemporaryFile() as stderr, tempfile.TemporaryFile() as stdout:
        start = time.perf_counter()
        child = subprocess.Popen(
            [sys.executable, "-c", _MAIN, *flags],
            cwd=tree,
            env=env,
            stdout=stdout,
            stderr=stderr,
        )
        while True:
            pid, status, usage = os.wait4(child.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() - start > timeout:
                child.kill()
            time.sleep(0.02)
        seconds = time.perf_counter() - start
        stderr.seek(0)
        error = stderr.read().decode(errors="replace")
        stdout.seek(0)
        answered = expect in stdout.read().decode(errors="replace")
    code = os.waitstatus_to_exitcode(status)
    if code == 0 and not answered:
        code, error = 99, f"the answer does not say {expect!r}"
    cpu = usage.ru_utime + usage.ru_stime
    return seconds, cpu, usage.ru_maxrss / 2**20, code, error[-300:]


def operations(root: Path, scale: float) -> list[tuple[str, list[str], str]]:
    """(name, lookup flags, what its answer must say)."""
    iterations = _count("iterations", scale)
    asked = int(iterations * 0.75)
    log = str(root / "samples")
    run = [
        "--data-path",
        *[str(x) for w, p in zip(WEIGHTS, _prefixes(root)) for x in (w, p)],
        "--split", "100,0,0",
        "--seq-length", str(SEQ),
        "--micro-batch-size", str(MBS),
        "--global-batch-size", str(GBS),
        "--train-iters", str(iterations),
        "--data-cache-path", str(root / "cache"),
        "--data-parallel-size", str(DP),
        "--iteration", str(asked),
    ]  # fmt: skip
    match = f"sample log: {MBS} micro-batches match"
    return [
        ("whole-batch lookup (1024 samples)", run, f"iteration {asked}: consumed"),
        ("--sample-log, one rank", [*run, "--dp-rank", "17", "--sample-log", log], match),
        ("--sample-log, whole batch", [*run, "--sample-log", log], f"{MBS * DP}" + match[13:]),
        ("--worst 8 --dp-rank 17",
         [*run, "--worst", "8", "--dp-rank", "17", "--sample-log", log], "worst 8 of 16 "),
        ("--worst 8 (all ranks)", [*run, "--worst", "8", "--sample-log", log], "worst 8 of 1024 "),
        ("inverse (document -> iterations)", [*run[: run.index("--iteration")], "--document",
                                              "12345", "--dataset", "0"], "read by"),
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scales", default="0.01,0.1", help="fractions of the real run")
    parser.add_argument("--workdir", help="keep the built files here (default: a temp dir)")
    parser.add_argument("--compare", metavar="REV", help="also run REV's megatron_ext (git)")
    parser.add_argument("--old-timeout", type=float, default=600, help="seconds per old run")
    parser.add_argument("--build", nargs=2, metavar=("ROOT", "SCALE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.build:  # in a child, so the parent's RSS stays small
        build_data(Path(args.build[0]), float(args.build[1]))
        build_log(Path(args.build[0]), float(args.build[1]))
        return
    base = Path(args.workdir or tempfile.mkdtemp(prefix="lookup-scale-"))
    trees = [("new", REPO)]
    if args.compare:
        old = base / f"tree-{args.compare}"
        if not old.is_dir():
            old.mkdir(parents=True)
            archive = subprocess.run(
                ["git", "-C", str(REPO), "archive", args.compare, "megatron_ext"],
                check=True,
                capture_output=True,
            ).stdout
            subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
        trees.insert(0, (args.compare, old))
    results: dict[tuple[str, str, float], tuple[float, float, float, int, str]] = {}
    scales = [float(s) for s in args.scales.split(",")]
    for scale in scales:
        root = base / f"scale-{scale:g}"
        if not (root / "samples" / "samples-dp63.jsonl").is_file():
            started = time.perf_counter()
            subprocess.run([sys.executable, __file__, "--build", str(root), str(scale)], check=True)
            print(f"built scale {scale:g} in {time.perf_counter() - started:.0f} s", flush=True)
        log_bytes = sum(p.stat().st_size for p in (root / "samples").glob("samples-dp*.jsonl"))
        print(f"scale {scale:g}: sample log {log_bytes / 2**30:.2f} GiB", flush=True)
        for name, flags, expect in operations(root, scale):
            for label, tree in trees:
                limit = args.old_timeout if label != "new" else 3600
                seconds, cpu, rss, code, error = _run(tree, flags, root, limit, expect)
                results[(name, label, scale)] = (seconds, cpu, rss, code, error)
                print(
                    f"  {label:>8} {name:<36} {seconds:8.2f} s wall {cpu:8.2f} s CPU "
                    f"{rss:6.2f} GiB rc {code}"
                    + (f"  {(error.strip().splitlines() or ['killed'])[-1]}" if code else ""),
                    flush=True,
                )
    print("\n| operation | " + " | ".join(
        f"{label} 1/{round(1 / s)}" for s in scales for label, _ in trees
    ) + " | growth (new, last/first scale) |")  # fmt: skip
    print("|---" * (2 + len(scales) * len(trees)) + "|")
    for name, _, _ in operations(base, scales[0]):
        cells = []
        for scale in scales:
            for label, _ in trees:
                seconds, cpu, rss, code, _ = results[(name, label, scale)]
                cells.append(
                    f"killed after {seconds:.0f} s"
                    if code == -9
                    else f"{seconds:.1f} s ({cpu:.2f} s CPU), {rss:.2f} GiB"
                    + ("" if code == 0 else f" rc {code}")
                )
        first, last = results[(name, "new", scales[0])], results[(name, "new", scales[-1])]
        growth = f"x{last[0] / first[0]:.2f} wall, x{last[1] / first[1]:.2f} CPU"
        print(f"| {name} | " + " | ".join(cells) + f" | {growth} |")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"\n(peak RSS of this benchmark process itself: {peak:.2f} GiB)")


if __name__ == "__main__":
    main()
