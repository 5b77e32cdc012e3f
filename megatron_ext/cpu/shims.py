"""Counted shims that let megatron-core's real ``pretrain`` loop run on CPU with gloo.

Why this exists: megatron-core 0.19.2 assumes CUDA in a handful of places (device queries,
streams, RNG state, ``device='cuda'`` allocations, ``Tensor.type()`` string asserts). These
shims redirect exactly those calls to the CPU so CI (no GPU) runs the genuine training loop.

Rules, enforced here:
- ranged: :func:`install` refuses any megatron-core outside the supported range
  (:mod:`megatron_ext.common.versions`, the same check as the entry point's); the shims needed on
  each verified version are counted by tests (tests/unit/cpu/);
- counted: every shim increments a counter, dumped per rank as JSON at exit, so tests can
  assert which CUDA touch points the loop hit;
- strict: every *other* public ``torch.cuda`` callable is replaced by a tripwire that records
  ``unexpected:<name>`` and raises, so a new CUDA dependency fails the suite loudly;
- one counted shim is not a CUDA touch point but a CPU cost: ``torch.compile`` runs eagerly
  (:func:`run_compiled_code_eagerly`);
- loaded only by the CPU runner (:mod:`megatron_ext.cpu.run`): nothing else in the package
  imports it, so a GPU run never does (tests/unit/test_architecture.py checks this).
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import functools
import json
import os
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from megatron_ext.common import cuda_connections
from megatron_ext.registry import patching

COUNTS: collections.Counter[str] = collections.Counter()

# torch.cuda attributes that are not device calls (types, submodules, constants) or that
# are safe on a CUDA-less host; everything else callable becomes a tripwire.
_LEAVE_ALONE = {
    "is_available",
    "is_initialized",
    "is_bf16_supported",
    "device",
    "_lazy_init",
    "_is_compiled",
    "_initialized",
    "nvtx",
    "amp",
    "graphs",
    "memory",
    "random",
    "streams",
    "comm",
    "sparse",
    "jiterator",
    "profiler",
    "nccl",
    "tunable",
    "gds",
    "_utils",
    "_sleep",
    "get_rng_state_all",
    "set_rng_state_all",
}


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
        import time

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
    """Maps ``device='cuda*'`` (or an int ordinal) to CPU and fakes ``Tensor.type()`` names.

    Megatron asserts ``param.type() == 'torch.cuda.FloatTensor'`` in the optimizer and grad
    clipping code, so ``Tensor.type()`` with no argument reports the CUDA name of a CPU tensor.
    """

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        # Every torch call of the run passes here: the common case (no device, no special
        # function) is one dict lookup and one set lookup, no copy (a third of the mode's cost
        # per call before; a tiny CPU run makes thousands of calls per iteration).
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


def _dump_counts() -> None:
    _dump("rank", dict(COUNTS))


# Micro-batches this rank read from the data iterator, per DP rank they were read for.
READS: collections.Counter[int] = collections.Counter()
# With MEGATRON_EXT_HARNESS_RSS set: [iteration, resident bytes] at every training micro-batch
# read, so a test sees memory that grows with the micro-batches of one iteration.
RSS: list[list[int]] = []
_PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes() -> int:
    """This process's resident set size now (one read of ``/proc/self/statm``)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * _PAGE


def record_batch_reads() -> None:
    """Count the micro-batches this rank reads from the data iterator (readers only), in
    ``hooks.read_batch``: the GPT step's and a script's own (``megatron_ext.fork``) alike."""
    from megatron_ext.loop import hooks

    original = hooks.read_batch
    sample_rss = bool(os.environ.get("MEGATRON_EXT_HARNESS_RSS"))

    def read_batch(features: Any, data_iterator: Any, micro_batch: Any) -> Any:
        batch = original(features, data_iterator, micro_batch)
        READS[micro_batch.dp_rank] += 1
        if sample_rss and micro_batch.training:
            RSS.append([micro_batch.iteration, resident_bytes()])
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
    """Give large host allocations back to the OS when freed, as the GPU path never has to.

    On GPUs a micro-batch's activations live in CUDA's caching allocator; on CPU they are
    glibc heap blocks. glibc starts by serving blocks of 128 KiB and more with mmap, but each
    time such a block is freed it raises its mmap threshold to that size (up to 32 MiB): from
    then on a micro-batch's attention scores and logits come from the heap, which then grows
    by about one micro-batch's activations per micro-batch without being trimmed (tiny model,
    seq 1024: +33 MiB per micro-batch, 9 GiB after 256; the "first iteration" growth of
    issue #25). Setting the threshold explicitly turns that adjustment off (mallopt(3)).
    Returns False where the C library has no ``mallopt`` (not glibc): nothing changed.
    """
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    return bool(mallopt and mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def run_compiled_code_eagerly() -> None:
    """Make ``torch.compile`` a no-op here: what it decorates runs eagerly (counted).

    Why: megatron-core decorates its fusion kernels with ``torch.compile`` (``jit_fuser``) at
    import, and ``initialize_megatron`` then warms them up (``set_jit_fusion_options``) on
    tensors of the run's shapes, fusion flags or not. On CPU that is an Inductor C++ build:
    8.2 s per rank and launch on these 2-core machines (Megatron's own
    ``startup-set-jit-fusion-options`` timer), the largest part of a tiny run's start-up, for
    kernels the CPU flags never call after the warm-up (``--no-bias-gelu-fusion``,
    ``--no-bias-dropout-fusion``...). The warm-up's outputs are discarded, but its dropout
    draws from the CPU generator (the harness's ``device="cuda"`` is the CPU), and eager
    dropout draws differently from Inductor's: a CPU run's later random numbers (the CPU
    initialisation of the model) differ from an Inductor-warmed one's. Neither is a GPU run's,
    whose warm-up draws from the CUDA generator. Must run before megatron-core is imported
    (the decorators run then); idempotent."""
    if getattr(torch.compile, "_megatron_ext_eager", False):
        return

    def eager(model: Any = None, **options: Any) -> Any:
        _count("torch.compile(eager)")
        return (lambda fn: fn) if model is None else model

    eager._megatron_ext_eager = True  # type: ignore[attr-defined]
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
        "set_device": lambda *a, **k: None,
        "get_device_properties": _props,
        "get_device_capability": lambda *a, **k: (9, 0),
        "get_device_name": lambda *a, **k: "cpu-harness",
        "synchronize": lambda *a, **k: None,
        "current_stream": lambda *a, **k: _FakeStream(),
        "default_stream": lambda *a, **k: _FakeStream(),
        "stream": lambda *a, **k: _FakeStream(),
        "get_rng_state": lambda *a, **k: torch.get_rng_state(),
        "set_rng_state": lambda *a, **k: None,
        "manual_seed": lambda *a, **k: None,
        "manual_seed_all": lambda *a, **k: None,
        "empty_cache": lambda *a, **k: None,
        "memory_allocated": lambda *a, **k: 0,
        "max_memory_allocated": lambda *a, **k: 0,
        "memory_reserved": lambda *a, **k: 0,
        "max_memory_reserved": lambda *a, **k: 0,
        "reset_peak_memory_stats": lambda *a, **k: None,
    }
    for name, fn in shims.items():
        setattr(cuda, name, _shim(name, fn))
    # Megatron's RNG tracker reads the CUDA generator state through torch.cuda.random.
    cuda.random.get_rng_state = _shim("random.get_rng_state", lambda *a, **k: torch.get_rng_state())
    cuda.Stream = _FakeStream  # type: ignore[misc,assignment]
    cuda.Event = _FakeEvent  # type: ignore[misc,assignment]
    torch.nn.Module.cuda = lambda self, *a, **k: (_count("Module.cuda"), self)[1]  # type: ignore[method-assign]

    _CudaToCpuMode().__enter__()
    _cpu_device_mesh()
    _patch_megatron()
    cuda._megatron_ext_cpu_harness = True  # type: ignore[attr-defined]
    atexit.register(_dump_counts)


def _cpu_device_mesh() -> None:
    """A device mesh asked for on ``"cuda"`` is built on the CPU (counted ``DeviceMesh(cuda)``).

    Megatron's torch FSDP2 wrapper (``--use-torch-fsdp2``) shards every module over
    ``DeviceMesh.from_group(dp_cp_group, "cuda")``; on a CPU mesh FSDP2 all-gathers and
    reduce-scatters with gloo, so the real FSDP2 path trains here.
    """
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.from_group

    @functools.wraps(original)
    def from_group(group: Any, device_type: str, *args: Any, **kwargs: Any) -> Any:
        if _is_cuda_device(device_type):
            _count("DeviceMesh(cuda)")
            device_type = "cpu"
        return original(group, device_type, *args, **kwargs)

    DeviceMesh.from_group = staticmethod(from_group)  # type: ignore[method-assign]


def _patch_megatron() -> None:
    """The Megatron-side shim: ``initialize_megatron`` must not require CUDA.

    (The ``compile_helpers`` failure is not CPU-specific; the package fixes it for everyone,
    see ``megatron_ext.registry.fixes``.)
    """
    from megatron.training import initialize

    original_init = initialize.initialize_megatron

    @functools.wraps(original_init)  # the registry verifies the signature underneath
    def initialize_megatron(*args: Any, **kwargs: Any) -> Any:
        _count("initialize_megatron(allow_no_cuda)")
        kwargs["allow_no_cuda"] = True
        return original_init(*args, **kwargs)

    initialize.initialize_megatron = initialize_megatron
    import megatron.training.training as training

    training.initialize_megatron = initialize_megatron
