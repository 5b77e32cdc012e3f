"""The encoding workers of ``megatron-ext preprocess``: an order-preserving map over chunks
of input lines that fails fast when a worker dies.

A module of its own because workers are spawned and import it: it must stay free of Megatron
and torch imports (seconds of start-up per worker).
"""

import multiprocessing
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from megatron_ext.data.encode import Encoder
from megatron_ext.data.tokenizer import load_tokenizer

_worker_encoder: Encoder | None = None


def _init_worker(tokenizer_dir: Path) -> None:
    global _worker_encoder
    _worker_encoder = Encoder(load_tokenizer(tokenizer_dir))


def encode_chunk(
    chunk: list[tuple[int, bytes]], path: Path, keys: list[str], id_key: str | None
) -> list[tuple[int, list[np.ndarray], str | None]]:
    """(byte size, ids per key, record id) for each line of a chunk (raises
    :class:`EncodeError`)."""
    assert _worker_encoder is not None
    return [
        (len(line), *_worker_encoder.encode_line(line, path, lineno, keys, id_key))
        for lineno, line in chunk
    ]


def _chunks(items: Iterator[tuple[int, bytes]], size: int) -> Iterator[list[tuple[int, bytes]]]:
    chunk: list[tuple[int, bytes]] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def stop_workers(executor: ProcessPoolExecutor) -> None:
    """Cancel queued chunks and end the workers now (an error or SIGTERM is stopping us)."""
    executor.shutdown(wait=False, cancel_futures=True)
    for child in multiprocessing.active_children():
        child.terminate()


@contextmanager
def worker_pool(workers: int, chunksize: int, tokenizer_dir: Path) -> Iterator[Callable]:
    """An order-preserving map over chunks: in-process for one worker, else a process pool
    with at most ``2 x workers`` chunks in flight (bounded memory).

    A ``ProcessPoolExecutor``, not ``multiprocessing.Pool``: when a worker dies (an OOM kill)
    the executor fails every pending result with ``BrokenProcessPool``, where ``Pool`` would
    replace the worker and wait forever for the lost chunk. Workers are spawned, not forked:
    the parent may already run Rust (tokenizers) and torch thread pools.
    """
    if workers == 1:
        _init_worker(tokenizer_dir)
        yield lambda fn, items: (r for chunk in _chunks(items, chunksize) for r in fn(chunk))
        return
    executor = ProcessPoolExecutor(
        workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_init_worker,
        initargs=(tokenizer_dir,),
    )

    def ordered(fn: Callable, items: Iterator[tuple[int, bytes]]) -> Iterator:
        pending: deque[Future] = deque()
        for chunk in _chunks(items, chunksize):
            pending.append(executor.submit(fn, chunk))
            if len(pending) >= 2 * workers:
                yield from pending.popleft().result()
        while pending:
            yield from pending.popleft().result()

    try:
        yield ordered
    except BaseException:
        stop_workers(executor)
        raise
    executor.shutdown(wait=True)
