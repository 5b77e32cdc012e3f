"""Per-layer norms from the bucket pass, no Megatron imports: each gradient segment names its
layer entry, so its norm also index-adds into per-layer slots that ride the bucket slots'
all-reduce.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

# Slot names and TensorBoard keys.
GRAD, PARAM, UPDATE = "layer-grad-norm/", "layer-param-norm/", "layer-update-norm/"
_LAYER = re.compile(r"^(.*?layers\.\d+)\.")
_NUMBER = re.compile(r"layers\.(\d+)")


def layer_of(name: str) -> str:
    """The entry of a global parameter name: its transformer layer (``decoder.layers.3``),
    else its module (``embedding.word_embeddings``, ``decoder.final_layernorm``,
    ``output_layer``)."""
    name = name.removeprefix("module.").removeprefix("module.")
    if match := _LAYER.match(name):
        return match.group(1)
    return name.rpartition(".")[0] or name


def layer_order(name: str) -> tuple[int, int, str]:
    """Model order: embeddings, the layers by number, then the rest (final norm, output)."""
    match = _NUMBER.search(name)
    if match:
        return (1 + name.startswith("mtp"), int(match.group(1)), name)
    return (0 if name.startswith("embedding") else 3, 0, name)


def local_layers(names_by_kind: dict[bool, Iterable[str]]) -> dict[bool, list[str]]:
    """Each kind's (dense False, expert True) distinct layer entries, in model order."""
    return {kind: sorted(set(names), key=layer_order) for kind, names in names_by_kind.items()}


def slot_names(layers: list[str]) -> list[str]:
    """One kind's layer slots: the gradient norms², then the weights' norms²."""
    return [GRAD + n for n in layers] + [PARAM + n for n in layers]


def segment_owners(
    kinds: list[tuple[bool, str]], layers: dict[bool, list[str]]
) -> tuple[list[int], list[int], int]:
    """For each segment's (kind, layer entry): its gradient slot and its weight slot in the
    local layer vector (per kind, dense first: grads then weights), and the vector's size."""
    start, offsets = 0, {}
    for kind in sorted(layers):
        offsets[kind] = start
        start += 2 * len(layers[kind])
    index = {(k, n): offsets[k] + i for k, names in layers.items() for i, n in enumerate(names)}
    grads = [index[key] for key in kinds]
    weights = [index[key] + len(layers[key[0]]) for key in kinds]
    return grads, weights, start


def split_slots(
    names: list[str], values: list[float]
) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """Reduced slots as (bucket norms², layer grad norms², layer weight norms²); a layer's
    squares from several owners (its dense and expert parts, each EP rank's experts) add up."""
    buckets: dict[str, float] = {}
    layers: dict[str, dict[str, float]] = {GRAD: {}, PARAM: {}}
    for name, value in zip(names, values):
        prefix = next((p for p in layers if name.startswith(p)), None)
        if prefix is None:
            buckets[name] = value
        else:
            sums, key = layers[prefix], name.removeprefix(prefix)
            sums[key] = sums.get(key, 0.0) + value
    grads, params = layers[GRAD], layers[PARAM]
    order = sorted(grads, key=layer_order)
    return buckets, {n: grads[n] for n in order}, {n: params[n] for n in order if n in params}


def first_rising_layer(
    history: list[tuple[int, dict[str, float]]], onset: int, recent: int, factor: float
) -> tuple[str, int, float] | None:
    """The layer whose grad norm rose first: per layer, the first iteration in the ``recent``
    iterations up to ``onset`` where its norm exceeds ``factor`` × its median before them;
    the earliest (ties: the larger rise). ``history``: (iteration, layer norms), in order.
    None when no layer was recorded before that stretch or none rose."""
    baseline = [norms for it, norms in history if it < onset - recent]
    stretch = [(it, norms) for it, norms in history if onset - recent <= it <= onset]
    medians = {}
    for name in {n for norms in baseline for n in norms}:
        values = sorted(v for norms in baseline if (v := norms.get(name)) is not None)
        if values and values[len(values) // 2] > 0:
            medians[name] = values[len(values) // 2]
    best: tuple[int, float, str] | None = None
    for name, median in medians.items():
        for iteration, norms in stretch:
            value = norms.get(name)
            if value is not None and value > factor * median:
                candidate = (iteration, -value / median, name)
                best = candidate if best is None or candidate < best else best
                break
    return None if best is None else (best[2], best[0], -best[1])


def roots(squares: dict[str, float]) -> dict[str, float]:
    """Norms from reduced squares (a negative rounding residue is 0)."""
    return {n: math.sqrt(max(v, 0.0)) for n, v in squares.items()}
