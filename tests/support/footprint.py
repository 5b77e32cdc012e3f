"""Count, in a real launch, the collectives and host reads the overlay's own code makes.

A ``sitecustomize`` on the workers' PYTHONPATH (``MEGATRON_EXT_COUNT_DIR`` set) wraps every
``torch.distributed`` collective and the tensor-to-host reads (``item``, ``tolist``,
``__float__``, ``__int__``, ``__bool__``, ``numpy``). A call is the overlay's when the
innermost ``megatron_ext/`` frame on its stack is in a feature folder (not the registry's
wrappers, the GPT step or the CPU harness, which stand where Megatron's own code would); a
call made inside a counted call (an object collective's own tensors) is not counted again.
Each rank writes ``rankN.json``: ``[iteration, kind, name, site, count]`` rows, the iteration
being the rerun state machine's (the logged one during a step).
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import megatron_ext

PACKAGE = Path(megatron_ext.__file__).resolve().parent

COUNTER = r"""
def _count_install():
    import atexit, collections, json, os, sys
    import torch
    import torch.distributed as dist

    out = os.environ["MEGATRON_EXT_COUNT_DIR"]
    root = os.environ["MEGATRON_EXT_COUNT_ROOT"] + os.sep
    harness = tuple(root + d + os.sep for d in ("registry", "loop", "cpu", "fork", "bridge"))
    counts = collections.Counter()
    state = {"inside": False, "registered": False}

    def iteration():
        module = sys.modules.get("megatron.core.rerun_state_machine")
        try:
            return module.get_rerun_state_machine().current_iteration
        except Exception:
            return -1

    def site():
        frame = sys._getframe(2)
        while frame is not None:
            name = frame.f_code.co_filename
            if name.startswith(root):
                if name.startswith(harness):
                    return None
                return f"{name[len(root):]}:{frame.f_code.co_name}"
            frame = frame.f_back
        return None

    def dump():
        rows = [[*key, n] for key, n in sorted(counts.items(), key=str)]
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
            json.dump(rows, f)

    def wrap(owner, name, kind):
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            if state["inside"]:
                return original(*args, **kwargs)
            where = site()
            if where is not None:
                counts[(iteration(), kind, name, where)] += 1
                if not state["registered"]:  # after the runner's exit handler: runs before it
                    state["registered"] = True
                    atexit.register(dump)
            state["inside"] = True
            try:
                return original(*args, **kwargs)
            finally:
                state["inside"] = False

        setattr(owner, name, counted)

    for name in (
        "all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce", "gather",
        "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
        "barrier", "all_gather_object", "gather_object", "broadcast_object_list", "send",
        "recv", "isend", "irecv", "batch_isend_irecv",
    ):
        if hasattr(dist, name):
            wrap(dist, name, "collective")
    for name in ("item", "tolist", "__float__", "__int__", "__bool__", "numpy"):
        wrap(torch.Tensor, name, "host read")


import os as _os

if _os.environ.get("MEGATRON_EXT_COUNT_DIR"):
    _count_install()
"""


def install(folder: Path, prefix: str = "") -> dict[str, str]:
    """Write the counting ``sitecustomize.py`` (after ``prefix``, another sitecustomize's
    text) into ``folder``; the environment a launch needs to load it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(prefix + "\n" + COUNTER)
    return {
        "PYTHONPATH": str(folder),
        "MEGATRON_EXT_COUNT_DIR": str(folder / "counts"),
        "MEGATRON_EXT_COUNT_ROOT": str(PACKAGE),
    }


def per_iteration(folder: Path) -> dict[int, dict[int, collections.Counter[tuple[str, str]]]]:
    """{rank: {iteration: Counter[(kind, "name site")]}} from the ranks' dumps."""
    out: dict[int, dict[int, collections.Counter[tuple[str, str]]]] = {}
    for path in sorted((folder / "counts").glob("rank*.json")):
        rank = int(path.stem.removeprefix("rank"))
        steps: dict[int, collections.Counter[tuple[str, str]]] = {}
        for iteration, kind, name, where, count in json.loads(path.read_text()):
            steps.setdefault(iteration, collections.Counter())[(kind, f"{name} {where}")] += count
        out[rank] = steps
    return out


def totals(counter: collections.Counter[tuple[str, str]]) -> dict[str, int]:
    """{kind: calls} of one rank's iteration."""
    out: dict[str, int] = collections.Counter()
    for (kind, _), count in counter.items():
        out[kind] += count
    return dict(out)
