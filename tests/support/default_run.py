"""What a default run writes to its signals log, for the scale benchmarks and tests.

Why: the cost of reading a log at scale depends on what its lines hold. A default run
(``megatron-ext demo``: one dataset, no ``--spike-detect``, no optional signal) writes the
per-source fields and leaves the optional signals null; a benchmark on lines without them
measured 4 s where a real 1 M-iteration log took 38 s. :data:`RECORD` is one line of
``runs/demo/signals/signals.jsonl`` verbatim (iteration 39, written 2026-12-05 by this tree;
the empty ``recovery`` field, added since, as the writer writes it);
the benchmarks change only the values that move from line to line.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from megatron_ext.common.io import json_safe
from megatron_ext.common.records.signals import APPENDED, SignalRecord

RECORD = (
    '{"iteration":39,"attempt":1,"job_id":"local","wall_time":1796483579.574557,"consumed_s'
    'amples":312,"skipped_samples":0,"lm_loss":3.642561197280884,"z_loss":null,"max_local_l'
    'oss":3.642561197280884,"max_loss_dp_rank":0,"grad_norm":0.8882488012313843,"bucket_gra'
    'd_norms":{},"lm_loss_by_dataset":{"tiny_text_document":3.642561230575666},"tokens_by_d'
    'ataset":{"tiny_text_document":512},"params_norm":23.5390754646496,"update_ratio":null,'
    '"lr":0.00032169505539184995,"loss_scale":1.0,"num_zeros":null,"max_attention_logit":nu'
    'll,"skipped_iter":false,"nan_iter":false,"log_z":null,"update_skipped":false,"layer_gr'
    'ad_norms":{"embedding.word_embeddings":0.2087567299604416,"decoder.layers.0":0.1765581'
    '8536373838,"decoder.layers.1":0.13385723988970102,"decoder.final_layernorm":0.22405415'
    '773391724,"output_layer":0.8038132190704346},"layer_param_norms":{"embedding.word_embe'
    'ddings":5.2180399894714355,"decoder.layers.0":12.630892576773,"decoder.layers.1":12.33'
    '5358303936667,"decoder.final_layernorm":8.472464561462402,"output_layer":11.9317131042'
    '48047},"layer_update_norms":{},"slowest_rank":null,"slowest_step_time":null,"median_st'
    'ep_time":null,"straggler_rank":null,"straggler_node":null,"recovery":{}}'
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
