"""Counted shims that let megatron-core's real ``pretrain`` loop run on CPU with gloo.

megatron-core assumes CUDA in a handful of places (device queries, streams, RNG state,
``device='cuda'`` allocations, ``Tensor.type()`` asserts); these shims redirect exactly those
to the CPU. Every shim is counted (dumped per rank as JSON at exit, for the tests); every other
public ``torch.cuda`` callable becomes a tripwire that raises, so a new CUDA dependency fails
loudly. Megatron's own function is patched through the registry (``cpu-initialize-without-cuda``).
Loaded only by the CPU runner (tests/unit/test_architecture.py checks a GPU run never does).
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import functools
import json
import os
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from megatron_ext.common import cuda_connections
from megatron_ext.registry import patching

COUNTS: collections.Counter[str] = collections.Counter()

# Public torch.cuda functions that are safe on a CUDA-less host; every other public function
# becomes a tripwire (private names, types, submodules and constants are left as they are).
_LEAVE_ALONE = {
    "is_available",
    "is_initialized",
    "is_bf16_supported",
    "get_rng_state_all",
    "set_rng_state_all",
}
_STREAMS = ("current_stream", "default_stream", "stream")
_NO_OPS = ("set_device", "synchronize", "set_rng_state", "manual_seed", "manual_seed_all")
_NO_OPS += ("empty_cache", "reset_peak_memory_stats")
_ZERO_BYTES = ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved")


def _count(name: str) -> None:
    COUNTS[name] += 1


def _shim(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _count(name)
        return fn(*args, **kwargs)

    wrapper.__name__ = f"cpu_shim_{name}"
    return wrapper


def _tripwire(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)  # keeps attributes such as __wrapped__ that torch reads
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _count(f"unexpected:{name}")
        raise RuntimeError(
            f"CPU harness: unexpected CUDA call torch.cuda.{name}; add a counted shim in "
            "megatron_ext/cpu/shims.py only if megatron-core really needs it on this path"
        )

    return wrapper


class _FakeStream:
    """Stands in for ``torch.cuda.Stream``: CPU work is synchronous, so streams are no-ops."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _count("Stream")

    def wait_stream(self, *args: Any) -> None:
        _count("Stream.wait_stream")

    def synchronize(self) -> None:
        _count("Stream.synchronize")

    def wait_event(self, *args: Any) -> None:
        _count("Stream.wait_event")

    def record_event(self, *args: Any) -> _FakeEvent:
        _count("Stream.record_event")
        return _FakeEvent()

    def __enter__(self) -> _FakeStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class _FakeEvent:
    """Stands in for ``torch.cuda.Event`` (timers); records wall time for elapsed_time."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _count("Event")
        self._t = 0.0

    def record(self, *args: Any) -> None:
        self._t = time.perf_counter()

    def synchronize(self) -> None:
        return None

    def wait(self, *args: Any) -> None:
        return None

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: _FakeEvent) -> float:
        return (other._t - self._t) * 1000.0


def _props(*args: Any, **kwargs: Any) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        name="cpu-harness", major=9, minor=0, total_memory=24 << 30, multi_processor_count=2
    )


def _is_cuda_device(dev: Any) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return isinstance(dev, int) and not isinstance(dev, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Maps ``device='cuda*'`` (or an int ordinal) to CPU, and reports a CPU tensor's CUDA name
    from ``Tensor.type()`` (Megatron asserts ``torch.cuda.FloatTensor`` in its optimizers)."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        # Every torch call of the run passes here: the common case costs two lookups, no copy.
        if kwargs:
            device = kwargs.get("device")
            if device is not None and _is_cuda_device(device):
                _count("device=cuda")
                kwargs = {**kwargs, "device": "cpu"}
        else:
            kwargs = {}
        if func in _SPECIAL:
            return _special(func, args, kwargs)
        return func(*args, **kwargs)


_SPECIAL = frozenset((torch.Tensor.type, torch.Tensor.cuda, torch.Tensor.to))


def _special(func: Any, args: tuple, kwargs: dict) -> Any:
    """``Tensor.type()`` reports the CUDA name, ``Tensor.cuda()`` stays, ``.to(cuda)`` is CPU."""
    if func is torch.Tensor.type and len(args) == 1 and not kwargs:
        _count("Tensor.type")
        name = func(*args)
        return name.replace("torch.", "torch.cuda.", 1) if "cuda" not in name else name
    if func is torch.Tensor.cuda:
        _count("Tensor.cuda")
        return args[0]
    if func is torch.Tensor.to and len(args) >= 2 and _is_cuda_device(args[1]):
        _count("Tensor.to(cuda)")
        args = (args[0], "cpu", *args[2:])
    return func(*args, **kwargs)


def _dump(name: str, content: dict[str, Any]) -> None:
    out_dir = os.environ.get("MEGATRON_EXT_HARNESS_COUNTS")
    if not out_dir:
        return
    path = Path(out_dir) / f"{name}{os.environ.get('RANK', '0')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(content, sort_keys=True))


# Micro-batches this rank read from the data iterator, per DP rank they were read for.
READS: collections.Counter[int] = collections.Counter()
# With MEGATRON_EXT_HARNESS_RSS set: [iteration, resident bytes] at every training micro-batch
# read, so a test sees memory that grows with the micro-batches of one iteration.
RSS: list[list[int]] = []
_PAGE = os.sysconf("SC_PAGE_SIZE")


def record_batch_reads() -> None:
    """Count the micro-batches this rank reads from the data iterator (readers only), in
    ``hooks.read_batch``: the GPT step's and a script's own (``megatron_ext.fork``) alike."""
    from megatron_ext.registry import hooks

    original = hooks.read_batch
    sample_rss = bool(os.environ.get("MEGATRON_EXT_HARNESS_RSS"))

    def read_batch(features: Any, data_iterator: Any, micro_batch: Any) -> Any:
        batch = original(features, data_iterator, micro_batch)
        READS[micro_batch.dp_rank] += 1
        if sample_rss and micro_batch.training:
            with open("/proc/self/statm") as statm:  # resident pages, second field
                RSS.append([micro_batch.iteration, int(statm.read().split()[1]) * _PAGE])
        return batch

    hooks.read_batch = read_batch


def record_exit(code: Any) -> None:
    """What this rank did: its batch reads and the exit code it chose (``exit-rankN.json``)."""
    reads = {str(k): v for k, v in READS.items()}
    _dump("exit-rank", {"exit_code": code, "reads": reads, "rss": RSS})


# glibc's mallopt(M_MMAP_THRESHOLD, ...) parameter number (malloc.h).
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 128 << 10  # glibc's initial value


def fix_mmap_threshold() -> bool:
    """Give large freed host allocations back to the OS: glibc otherwise raises its mmap
    threshold on each free and the heap grows by a micro-batch's activations per micro-batch
    (BENCHMARKS.md, "first-iteration memory"). False where there is no ``mallopt`` (not glibc)."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    return bool(mallopt and mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def run_compiled_code_eagerly() -> None:
    """Make ``torch.compile`` a no-op (counted): Megatron's fusion warm-up would otherwise build
    Inductor C++ kernels that the CPU flags never call (docs/megatron-facts.md). Must run before
    megatron-core is imported; idempotent."""

    def eager(model: Any = None, **options: Any) -> Any:
        _count("torch.compile(eager)")
        return (lambda fn: fn) if model is None else model

    torch.compile = eager  # type: ignore[assignment]


def install() -> None:
    """Install every shim (idempotent per process) and the exit-time counter dump."""
    if getattr(torch.cuda, "_megatron_ext_cpu_harness", False):
        return
    patching.check_version()  # refuses a megatron-core outside the supported range
    run_compiled_code_eagerly()
    os.environ.setdefault(cuda_connections.ENV, cuda_connections.default_for(sys.argv[1:]))
    fix_mmap_threshold()
    cuda = torch.cuda
    for name in dir(cuda):
        if name.startswith("_") or name in _LEAVE_ALONE:
            continue
        obj = getattr(cuda, name)
        if isinstance(obj, (types.FunctionType, types.BuiltinFunctionType)):
            setattr(cuda, name, _tripwire(name, obj))

    shims: dict[str, Callable[..., Any]] = {
        "current_device": lambda: "cpu",
        "device_count": lambda: 1,
        "get_device_properties": _props,
        "get_device_capability": lambda *a, **k: (9, 0),
        "get_device_name": lambda *a, **k: "cpu-harness",
        "get_rng_state": lambda *a, **k: torch.get_rng_state(),
        **dict.fromkeys(_STREAMS, lambda *a, **k: _FakeStream()),
        **dict.fromkeys(_NO_OPS, lambda *a, **k: None),
        **dict.fromkeys(_ZERO_BYTES, lambda *a, **k: 0),
    }
    for name, fn in shims.items():
        setattr(cuda, name, _shim(name, fn))
    # Megatron's RNG tracker reads the CUDA generator state through torch.cuda.random.
    cuda.random.get_rng_state = _shim("random.get_rng_state", lambda *a, **k: torch.get_rng_state())
    # Megatron's RNG tracker sets the CUDA generator state through torch.cuda._lazy_call, which
    # queues the call and its formatted stack until CUDA initialises, here never: memory grew
    # every attention layer and micro-batch (docs/megatron-facts.md). Drop the call. Megatron
    # binds the name when imported, after this (the WS1_SHIMS check of tests/e2e/test_pretrain.py).
    cuda._lazy_call = _shim("_lazy_call(dropped)", lambda *a, **k: None)
    cuda.Stream = _FakeStream  # type: ignore[misc,assignment]
    cuda.Event = _FakeEvent  # type: ignore[misc,assignment]
    torch.nn.Module.cuda = lambda self, *a, **k: (_count("Module.cuda"), self)[1]  # type: ignore[method-assign]

    _CudaToCpuMode().__enter__()
    _cpu_device_mesh()
    from megatron_ext.registry import table as registry

    registry.patch("cpu-initialize-without-cuda").apply(_count)  # megatron-core's side
    cuda._megatron_ext_cpu_harness = True  # type: ignore[attr-defined]
    atexit.register(_dump, "rank", COUNTS)


def _cpu_device_mesh() -> None:
    """A device mesh asked for on ``"cuda"`` is built on the CPU (counted): FSDP2 then
    all-gathers and reduce-scatters with gloo, so the real FSDP2 path trains here."""
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.from_group

    @functools.wraps(original)
    def from_group(group: Any, device_type: str, *args: Any, **kwargs: Any) -> Any:
        if _is_cuda_device(device_type):
            _count("DeviceMesh(cuda)")
            device_type = "cpu"
        return original(group, device_type, *args, **kwargs)

    DeviceMesh.from_group = staticmethod(from_group)  # type: ignore[method-assign]
