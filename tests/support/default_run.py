"""What a default run writes to its signals log, for the scale benchmarks and tests.

Why: the cost of reading a log at scale depends on what its lines hold. A default run
(``megatron-ext demo``: one dataset, no ``--spike-detect``, no optional signal) writes the
per-source fields and leaves the optional signals null; a benchmark on lines without them
measured 4 s where a real 1 M-iteration log took 38 s. :data:`RECORD` is one line of
``runs/demo/signals/signals.jsonl`` verbatim (iteration 20, written 2026-12-03 by this tree);
the benchmarks change only the values that move from line to line.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from megatron_ext.common.io import json_safe
from megatron_ext.common.records.signals import APPENDED, SignalRecord

RECORD = (
    '{"iteration":20,"attempt":1,"job_id":"local","wall_time":1796312583.9025152,'
    '"consumed_samples":160,"skipped_samples":0,"lm_loss":4.426114082336426,"z_loss":null,'
    '"max_local_loss":4.426114082336426,"max_loss_dp_rank":0,"grad_norm":1.4179868698120117,'
    '"bucket_grad_norms":{},"lm_loss_by_dataset":{"tiny_text_document":4.426114101428539},'
    '"tokens_by_dataset":{"tiny_text_document":512},"params_norm":22.174850597544904,'
    '"update_ratio":null,"lr":0.0019504032608410244,"loss_scale":1.0,"num_zeros":null,'
    '"max_attention_logit":null,"skipped_iter":false,"nan_iter":false,"log_z":null,'
    '"update_skipped":false}'
)
SOURCE = "tiny_text_document"
# Filled per line; every other field keeps RECORD's value.
MOVING = ("iteration", "attempt", "wall_time", "consumed_samples", "lm_loss", "max_local_loss")
MOVING += ("grad_norm", "params_norm", "lr")


def record(source_loss: float, **values: float | int) -> SignalRecord:
    """RECORD with the :data:`MOVING` values given and its one source's loss."""
    fields = {**json.loads(RECORD), **values}
    fields["lm_loss_by_dataset"] = {SOURCE: source_loss}
    return SignalRecord(**fields)


def template(appended: bool = True) -> str:
    """A ``str.format`` template of RECORD's line (``appended=False``: as a writer before the
    appended fields wrote it), the moving values and ``{source_loss}`` left to fill (with
    ``repr`` of floats, as ``json.dumps`` writes them)."""
    parts = []
    for name, value in json.loads(RECORD).items():
        if name in APPENDED and not appended:
            continue
        if name in MOVING:
            text = "{" + name + "}"
        elif name == "lm_loss_by_dataset":
            text = '{{"' + SOURCE + '":{source_loss}}}'
        else:
            text = json.dumps(value, separators=(",", ":")).replace("{", "{{").replace("}", "}}")
        parts.append(f'"{name}":{text}')
    return "{{" + ",".join(parts) + "}}\n"


def lines(values: Iterator[dict], appended: bool = True) -> Iterator[str]:
    """The writer's lines for each dict of moving values (with ``source_loss``); the first
    three are checked byte for byte against what ``JsonlAppender`` writes."""
    form = template(appended)
    for count, moving in enumerate(values):
        text = form.format(**{k: repr(v) for k, v in moving.items()})
        if count < 3:
            fields = json_safe(record(**moving).as_json())
            if not appended:
                fields = {k: v for k, v in fields.items() if k not in APPENDED}
            assert text == json.dumps(fields, separators=(",", ":")) + "\n", (text, fields)
        yield text
