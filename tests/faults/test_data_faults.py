"""``megatron-ext preprocess`` and the datasets training reads: kills while publishing, a
dead worker, SIGTERM, a full disk, a read-only output, empty input, one huge document, and
a split too small to hold a sample. Every fault is real (signals to real processes, a
tmpfs that fills up, a read-only mount)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megatron_ext.common.io import KILL_AT_STEP_ENV
from megatron_ext.common.records.pair import PairError, check_pair
from megatron_ext.data.corpus import write_tiny_corpus
from megatron_ext.data.preprocess import main as preprocess_main
from tests.support.faults import fault
from tests.support.harness import REPO, launch
from tests.support.sandbox import run_with_mount

PREPROCESS = [sys.executable, "-m", "megatron_ext.cli", "preprocess"]


@pytest.fixture(scope="module")
def tokenizer(data_args) -> str:
    return data_args[data_args.index("--tokenizer-model") + 1]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("corpora")
    return {
        "small": write_tiny_corpus(root / "small.jsonl", num_docs=60, seed=1),
        "other": write_tiny_corpus(root / "other.jsonl", num_docs=80, seed=2),
        "large": write_tiny_corpus(root / "large.jsonl", num_docs=2500, seed=3),
    }


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), **extra}
    env.pop(KILL_AT_STEP_ENV, None)
    env.update(extra)
    return env


def _preprocess(corpus: Path, prefix: Path, tokenizer: str, *more: str, **env: str):
    return subprocess.run(
        [
            *PREPROCESS,
            "--input",
            str(corpus),
            "--output-prefix",
            str(prefix),
            "--tokenizer-dir",
            tokenizer,
            *more,
        ],
        capture_output=True,
        text=True,
        env=_env(**env),
        timeout=600,
    )


def _pair(prefix: Path) -> tuple[bytes | None, bytes | None]:
    document = f"{prefix}_text_document"
    return tuple(  # type: ignore[return-value]
        Path(document + ext).read_bytes() if Path(document + ext).exists() else None
        for ext in (".bin", ".idx")
    )


@pytest.fixture(scope="module")
def datasets(corpora, tokenizer, tmp_path_factory) -> dict[str, Path]:
    """Two preprocessings: "old" (60 documents) and "new" (80), each its own directory."""
    root = tmp_path_factory.mktemp("datasets")
    out = {}
    for name, corpus in (("old", corpora["small"]), ("new", corpora["other"])):
        out[name] = root / name / "d"
        assert _preprocess(corpus, out[name], tokenizer).returncode == 0
    return out


@fault(
    "`preprocess` rewriting an existing dataset killed (kill -9) between publishing its "
    ".bin and .idx",
    "never a new .bin beside an old .idx: the prefix has no .idx (Megatron cannot open it; "
    "the overlay says a preprocess was interrupted) until a rerun publishes the new pair",
    area="preprocess",
)
def test_publishing_never_shows_a_mixed_pair(datasets, corpora, tokenizer, tmp_path) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    old_pair, new_pair = _pair(datasets["old"]), _pair(datasets["new"])
    for step in (1, 2):
        prefix = shutil.copytree(datasets["old"].parent, tmp_path / f"step{step}") / "d"
        killed = _preprocess(corpora["other"], prefix, tokenizer, **{KILL_AT_STEP_ENV: str(step)})
        assert killed.returncode == -signal.SIGKILL, killed.stderr
        assert _pair(prefix) == ((old_pair if step == 1 else new_pair)[0], None)
        document = f"{prefix}_text_document"
        with pytest.raises(PairError, match="a `megatron-ext preprocess` was interrupted"):
            check_pair(document)
        with pytest.raises((AssertionError, FileNotFoundError), match="cannot be found"):
            IndexedDataset(document, multimodal=False, mmap=True)
    assert _preprocess(corpora["other"], prefix, tokenizer).returncode == 0
    assert _pair(prefix) == new_pair
    check_pair(document)


@fault(
    "a .bin from one preprocessing beside the .idx of another (what two renames left)",
    "refused by the overlay's readers (training start-up data check, lookup): the .idx's "
    "fingerprint of its .bin does not match; Megatron still reads the fingerprinted .idx",
    area="preprocess",
)
def test_a_mixed_pair_is_refused(datasets, tmp_path) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix = shutil.copytree(datasets["old"].parent, tmp_path / "mixed") / "d"
    document = f"{prefix}_text_document"
    check_pair(document)
    assert len(IndexedDataset(document, multimodal=False, mmap=True)) == 60  # trailer unread
    shutil.copy(f"{datasets['new']}_text_document.bin", f"{document}.bin")
    with pytest.raises(PairError, match=r"is not the \.bin its \.idx was written with"):
        check_pair(document)


def _children(process: subprocess.Popen) -> list[psutil.Process]:
    try:
        return [
            child
            for child in psutil.Process(process.pid).children(recursive=True)
            if "spawn_main" in " ".join(child.cmdline())
        ]
    except psutil.NoSuchProcess:
        return []


def _start_large(corpora, tokenizer, prefix: Path) -> subprocess.Popen:
    """A 2-worker preprocess of the large corpus, returned once it is writing the .bin."""
    process = subprocess.Popen(
        [
            *PREPROCESS,
            "--input",
            str(corpora["large"]),
            "--output-prefix",
            str(prefix),
            "--tokenizer-dir",
            tokenizer,
            "--workers",
            "2",
            "--chunksize",
            "4",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    deadline = time.monotonic() + 300
    while not (
        list(prefix.parent.glob("*.tmp*.bin"))
        and any(p.stat().st_size for p in prefix.parent.glob("*.tmp*.bin"))
        and len(_children(process)) == 2
    ):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "preprocess never started writing"
        time.sleep(0.05)
    return process


@fault(
    "a preprocess worker killed (kill -9, as the OOM killer does) mid-run",
    "the parent stops at once (exit 1) saying a worker died; no temporary files, nothing published",
    area="preprocess",
)
def test_a_dead_worker_fails_fast(corpora, tokenizer, tmp_path) -> None:
    prefix = tmp_path / "out" / "d"
    process = _start_large(corpora, tokenizer, prefix)
    _children(process)[0].kill()
    try:
        _, stderr = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail("preprocess hangs after its worker died")
    assert process.returncode == 1, stderr
    assert "a tokenizer worker process died" in stderr
    assert sorted(p.name for p in prefix.parent.iterdir()) == []


@fault(
    "SIGTERM to `preprocess` mid-run (e.g. Slurm's time limit)",
    "exit 143 with a message; no temporary files; the previous dataset untouched",
    area="preprocess",
)
def test_sigterm_leaves_no_temporary_files(datasets, corpora, tokenizer, tmp_path) -> None:
    prefix = shutil.copytree(datasets["old"].parent, tmp_path / "out") / "d"
    old_pair = _pair(prefix)
    process = _start_large(corpora, tokenizer, prefix)
    workers = _children(process)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, stderr
    assert "stopped by SIGTERM" in stderr
    assert not list(prefix.parent.glob("*.tmp*")) and _pair(prefix) == old_pair
    _, alive = psutil.wait_procs(workers, timeout=30)
    assert not alive, "workers outlived the SIGTERMed preprocess"


@fault(
    "a full disk (a 256 KiB tmpfs) under `preprocess`",
    "exit 1 naming 'No space left on device'; nothing left on the disk",
    area="preprocess",
)
def test_a_full_disk_leaves_nothing(corpora, tokenizer, tmp_path) -> None:
    disk = tmp_path / "disk"
    result, left = run_with_mount(
        [
            *PREPROCESS,
            "--input",
            str(corpora["large"]),
            "--output-prefix",
            str(disk / "d"),
            "--tokenizer-dir",
            tokenizer,
        ],
        disk,
        size_kib=256,
        env=_env(),
    )
    assert result.returncode == 1, result.stderr[-2000:]
    assert "No space left on device" in result.stderr and "Traceback" not in result.stderr
    assert left == []


@fault(
    "a read-only output directory for `preprocess --train-tokenizer`",
    "refused (exit 1) before the tokenizer is trained, naming the directory",
    area="preprocess",
)
def test_a_read_only_output_is_refused_before_any_work(corpora, tmp_path) -> None:
    readonly, tokenizer_out = tmp_path / "ro", tmp_path / "tok"
    result, _ = run_with_mount(
        [
            *PREPROCESS,
            "--input",
            str(corpora["small"]),
            "--output-prefix",
            str(readonly / "d"),
            "--train-tokenizer",
            "--tokenizer-out",
            str(tokenizer_out),
        ],
        readonly,
        read_only=True,
        env=_env(),
    )
    assert result.returncode == 1, result.stderr
    assert f"the output directory {readonly} is not writable" in result.stderr
    assert not tokenizer_out.exists()


@fault(
    "`preprocess` of an input with no document (empty file, only blank lines or blank texts)",
    "refused (exit 1), nothing written; --allow-empty writes the empty dataset on purpose",
    area="preprocess",
)
def test_empty_input_is_refused_unless_allowed(tokenizer, tmp_path, capsys) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text('\n{"text": ""}\n{"text": "   "}\n')
    argv = ["--input", str(empty), "--output-prefix", str(tmp_path / "d")]
    assert preprocess_main([*argv, "--tokenizer-dir", tokenizer]) == 1
    assert "holds no document with text" in capsys.readouterr().err
    assert not list(tmp_path.glob("d*"))
    assert preprocess_main([*argv, "--tokenizer-dir", tokenizer, "--allow-empty"]) == 0
    assert Path(f"{tmp_path / 'd'}_text_document.idx").is_file()


@fault(
    "one 4 MB document (the tokenizer's per-character cost made one 50 MB document peak at 7.8 GB)",
    "peak memory above start-up stays under 6x the document + 64 MiB (windowed tokenizing; "
    "bound stated in megatron_ext/data/encode.py); the ids equal one whole-document encode",
    area="preprocess",
)
def test_one_huge_document_has_bounded_memory(tokenizer, tmp_path) -> None:
    big = tmp_path / "big.jsonl"
    text = write_tiny_corpus(tmp_path / "parts.jsonl", num_docs=3000, seed=4).read_text()
    document = "\n\n".join(json.loads(line)["text"] for line in text.splitlines())
    big.write_text(json.dumps({"text": document}) + "\n")
    size = big.stat().st_size
    assert size > 4_000_000
    # Peak resident memory (VmHWM) is reset after the imports (Linux: clear_refs 5), so the
    # growth is what preprocessing this document costs, not what importing torch cost.
    code = (
        "import sys\n"
        "from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder\n"
        "from megatron_ext.data.preprocess import main\n"
        "def status(key):\n"
        "    line = [l for l in open('/proc/self/status') if l.startswith(key)][0]\n"
        "    return int(line.split()[1])\n"
        "open('/proc/self/clear_refs', 'w').write('5')\n"
        "before = status('VmRSS')\n"
        "assert main(sys.argv[1:]) == 0\n"
        "print('GROWTH_KIB', status('VmHWM') - before)\n"
    )
    prefix = tmp_path / "out" / "d"
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "--input",
            str(big),
            "--output-prefix",
            str(prefix),
            "--tokenizer-dir",
            tokenizer,
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    growth = int(result.stdout.split("GROWTH_KIB")[1].split()[0]) * 1024
    print(f"document {size / 2**20:.1f} MiB, peak growth {growth / 2**20:.1f} MiB")
    assert growth < 6 * size + 64 * 2**20, (growth, size)
    # The windows are cut where the pre-tokenizer cuts: the ids are exactly one call's.
    from megatron_ext.data.encode import Encoder
    from megatron_ext.data.tokenizer import load_tokenizer

    loaded = load_tokenizer(tokenizer)
    sample = document[:300_000] + "  \n\n\t  naïve café — 東京 🚀" * 50 + "x" * 5000 + " " * 3000
    windowed = Encoder(loaded, window=1024)
    assert windowed.windowed
    assert windowed.encode(sample).tolist() == loaded.encode(sample)


@pytest.mark.e2e
@fault(
    "`--split 949,50,1` (Megatron's 175B example) on a 400-document corpus: the test split "
    "gets 0 documents",
    "training refuses at start-up naming the split, its documents and tokens and the fix, "
    "instead of hanging forever in GPTDataset._get_num_epochs",
    area="training start-up",
)
def test_a_split_too_small_for_one_sample_is_refused(data_args, tmp_path) -> None:
    flags = list(data_args)
    flags[flags.index("--split") + 1] = "949,50,1"
    run = launch(tmp_path, flags, timeout=300, sample_log=False)
    assert run.returncode != 0
    assert "the test split of" in run.log and "gets 0 of its 400 documents (0 tokens)" in run.log
    assert "use a larger corpus" in run.log and "Build and save the GPTDataset" not in run.log
