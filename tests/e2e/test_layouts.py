"""Every feature at once, at the layouts users run: the matrix of ``tests/support/layouts.py``.

One first launch per layout (every feature on, drill included) proves its losses against the
single-rank base, Σ bucket² = grad-norm² with global layer names, the weight-decay update,
the signals (stragglers included: measured every step, nobody named), per-dataset validation
(one short evaluation on a two-member blend, reducing to Megatron's lm loss), the drill's exit
on every rank, and sample log + lookup + reader ranks. The
drill restart past the spike runs for ``pp2-tied``; the kill -9 resume (bit-exact) for
``dp2-pp2-distopt-tied``; the resume of the first launch's checkpoint (bit-exact) for
``fsdp2-dp2`` (torch FSDP2 on a CPU device mesh). Layouts that cannot run on CPU (SP, CP,
Megatron-FSDP) are refused at start-up, each with its reason.
"""

from __future__ import annotations

import itertools
import math
import re
import socket
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from megatron_ext.common.files import SIGNALS_FILE, SPIKE_LEDGER_FILE, VALIDATION_FILE
from megatron_ext.common.records.ledger import read_ledger
from megatron_ext.common.records.sample_log import SampleRecord
from megatron_ext.common.records.signals import SignalRecord, latest_per_iteration, read_signals
from megatron_ext.common.records.validation import read_validation
from megatron_ext.demo import TINY_MODEL
from megatron_ext.lookup import cli
from megatron_ext.telemetry.validation import LOSS_CHECK_RTOL
from tests.support.harness import (
    GLOBAL_BATCH,
    MICRO_BATCH,
    Run,
    checkpoint_args,
    rank0_alone,
)
from tests.support.layouts import (
    BAD,
    BY_NAME,
    EVAL_INTERVAL,
    EVAL_ITERS,
    EXIT_CODE_SPIKE,
    FIRST,
    LAYOUTS,
    LR,
    RESTART_SAVE_INTERVAL,
    SAVE_INTERVAL,
    TRAIN_ITERS,
    WD,
    Layout,
    Matrix,
    expected_mult,
    model_tensors,
)

pytestmark = [pytest.mark.layouts, pytest.mark.timeout(1800)]

NAMES = [layout.name for layout in LAYOUTS]
SEQ_LENGTH = int(TINY_MODEL[TINY_MODEL.index("--seq-length") + 1])
FP32 = [layout.name for layout in LAYOUTS if not layout.bf16]
HOST = socket.gethostname()  # every rank's node
BF16_RTOL = 2.0**-8  # one bf16 unit roundoff
# Every evaluated token counts (no end-of-document masking): EVAL_ITERS global batches.
EVAL_TOKENS = EVAL_ITERS * GLOBAL_BATCH * SEQ_LENGTH
MEGATRON_VALIDATION = re.compile(
    r" validation loss at iteration (\d+)[^|]*\| lm loss value: (\S+) \|"
)
_BUCKET = re.compile(r"^(?:pp(\d+)\.)?(?:ep(\d+)\.)?b\d+:(?:layers(\d+)-(\d+)|no-layers)\[")


def _signals(run_dir: Path) -> list[SignalRecord]:
    return read_signals(run_dir / "signals" / SIGNALS_FILE)


def _trained(first: Run) -> list[SignalRecord]:
    """The first launch's records: FIRST up to the iteration the detector exited at."""
    records = _signals(first.workdir)
    assert [r.attempt for r in records] == [1] * len(records)
    return records


def _microbatches(layout: Layout) -> int:
    return GLOBAL_BATCH // (MICRO_BATCH * layout.dp)


def _evaluations(run: Run) -> list[tuple[int, float]]:
    """(iteration, lm loss) of each evaluation Megatron printed."""
    return [(int(i), float(v)) for i, v in MEGATRON_VALIDATION.findall(run.log)]


def _keyed(run: Run) -> dict[tuple[int, int, int], SampleRecord]:
    """Sample records by (iteration, DP rank, micro-batch)."""
    return {(r.iteration, r.dp_rank, r.microbatch): r for rs in run.records().values() for r in rs}


def _by_rank(records: dict[int, list[SampleRecord]]) -> dict[int, dict[int, float]]:
    """Per iteration, each DP rank's token-averaged lm loss from its sample log."""
    sums: dict[int, dict[int, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for dp_rank, recs in records.items():
        for r in recs:
            sums[r.iteration][dp_rank][0] += r.lm_loss_sum
            sums[r.iteration][dp_rank][1] += r.num_tokens
    return {k: {dp: s / n for dp, (s, n) in ranks.items()} for k, ranks in sums.items()}


@pytest.mark.parametrize("name", NAMES)
def test_first_iteration_losses_equal_the_single_rank_run(matrix: Matrix, name: str) -> None:
    layout = BY_NAME[name]
    reference = {r.iteration: r for r in _signals(matrix.base(layout).workdir)}[FIRST]
    first = _trained(matrix.first(name))[0]
    assert first.iteration == FIRST
    rtol = BF16_RTOL if layout.bf16 else 1e-5
    assert first.lm_loss == pytest.approx(reference.lm_loss, rel=rtol)
    assert first.z_loss == pytest.approx(reference.z_loss, rel=rtol)
    assert first.log_z == pytest.approx(reference.log_z, rel=rtol)
    assert first.max_attention_logit == pytest.approx(reference.max_attention_logit, rel=rtol)
    # Same weights, different reductions: fp32 grad norms agree to summation order.
    assert first.grad_norm == pytest.approx(reference.grad_norm, rel=1e-2 if layout.bf16 else 1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_bucket_norms_sum_to_the_grad_norm_under_global_layer_names(
    matrix: Matrix, name: str
) -> None:
    layout, run = BY_NAME[name], matrix.first(name)
    stage_layers, seen = layout.stage_layers(), set()
    experts: set[int] = set()
    for r in _trained(run):
        total = sum(v * v for v in r.bucket_grad_norms.values())
        assert total == pytest.approx(r.grad_norm**2, rel=1e-5), r.iteration
        for bucket in r.bucket_grad_norms:
            label, ep, low, high = _BUCKET.match(bucket).groups()
            assert (label is not None) == (layout.pp > 1), bucket
            stage = int(label or 0)
            if ep is not None:
                experts.add(int(ep))
            for layer in {int(low), int(high)} if low else set():
                assert layer in stage_layers[stage], f"{bucket}: layer {layer} is not on {stage}"
                seen.add(layer)
    assert seen == set(range(layout.num_layers)), "every layer is named by its global number"
    assert experts == (set(range(2)) if layout.model == "moe" else set())
    assert "sum of bucket grad norms" not in run.log


@pytest.mark.parametrize("name", NAMES)
def test_layer_norms_sum_to_the_grad_norm_with_every_layer_once_by_its_global_name(
    matrix: Matrix, name: str
) -> None:
    """Per-layer norms: every layer of the model once under its global name (a stage-local
    name would repeat layer 0 and leave the last ones out), Σ layer² = grad-norm², the
    weights' norms (before the step) add up to the previous record's params norm, and the
    update norms to the update ratio × params norm."""
    layout, run = BY_NAME[name], matrix.first(name)
    records = _trained(run)
    layers = {f"decoder.layers.{i}" for i in range(layout.num_layers)}
    others = {"embedding.word_embeddings", "decoder.final_layernorm"}
    others |= set() if layout.tied else {"output_layer"}
    for r in records:
        assert set(r.layer_grad_norms) == layers | others, r.layer_grad_norms
        assert set(r.layer_param_norms) == layers | others
        total = sum(v * v for v in r.layer_grad_norms.values())
        assert total == pytest.approx(r.grad_norm**2, rel=1e-5), r.iteration
        assert set(r.layer_update_norms) == layers | others
        # The main parameters' (bf16: the fp32 main copy's) change, as the ratio reads them.
        assert all(v > 0 for v in r.layer_update_norms.values()), r.layer_update_norms
        update = math.sqrt(sum(v * v for v in r.layer_update_norms.values()))
        assert update / r.params_norm == pytest.approx(r.update_ratio, rel=1e-4)
    for before, r in itertools.pairwise(records):
        weights = sum(v * v for v in r.layer_param_norms.values())
        assert weights == pytest.approx(before.params_norm**2, rel=1e-5), r.iteration
    assert "sum of layer grad norms" not in run.log


@pytest.mark.parametrize("name", FP32)
def test_weight_decay_multipliers_act_on_the_right_tensors(matrix: Matrix, name: str) -> None:
    """Adam's first step from the base's weights: p1 = p0 - lr*(wd*mult*p0 + g/(|g|+eps)), so
    u = (p0 - p1)/lr - wd*mult*p0 is bounded by 1 with the right multiplier only (checked
    against the next multiplier, so the check can fail)."""
    layout = BY_NAME[name]
    before = model_tensors(matrix.base(layout).workdir / "ckpt" / f"iter_{FIRST - 1:07d}")
    after = model_tensors(matrix.first(name).workdir / "ckpt" / f"iter_{FIRST:07d}")
    assert set(before) == set(after)
    for key, p1 in after.items():
        p0, p1 = before[key].double(), p1.double()
        mult = expected_mult(key)
        rounding = 4 * torch.finfo(torch.float32).eps * p0.abs().max().item() / LR

        def excess(m: float, p0=p0, p1=p1) -> float:
            return ((p0 - p1) / LR - WD * m * p0).abs().max().item() - 1

        assert excess(mult) <= rounding, f"{key}: not lr*wd*{mult}*p0 plus an Adam step"
        assert excess(mult + 0.25 if mult == 0 else mult - 0.25) > 20 * rounding, key
        assert (p0 - p1).abs().max().item() > LR / 2, f"{key} did not move"
    if layout.tied and layout.pp > 1:  # the last stage's copy is decayed as the embedding
        assert (
            f"pp{layout.pp - 1} output_layer.weight wd_mult=0 <- --embedding-weight-decay-mult "
            "(tied copy of embedding.word_embeddings.weight)"
        ) in matrix.first(name).log
        if "--use-distributed-optimizer" in layout.flags:
            copy = _last_stage_copy(matrix.first(name), layout)
            assert torch.equal(copy, after["embedding.word_embeddings.weight"].flatten())


def _last_stage_copy(run: Run, layout: Layout) -> torch.Tensor:
    """The tied output layer of the last stage after the first update. Model weights save it
    once (as the embedding), but the distributed optimizer saves every stage's buffers, and
    Megatron gives the shared copy a bucket of its own (bucket 0 of the last stage)."""
    import torch.distributed.checkpoint as dcp

    path = str(run.workdir / "ckpt" / f"iter_{FIRST:07d}")
    key = (
        f"optimizer.distributed.dp_group_idx_{layout.pp - 1}.gbuf_idx_0."
        "dtype_(torch.float32, torch.float32).bucket_idx_0.param"
    )
    size = dcp.FileSystemReader(path).read_metadata().state_dict_metadata[key].size
    flat = {key: torch.empty(size)}
    dcp.load(flat, checkpoint_id=path, no_dist=True)
    return flat[key]


@pytest.mark.parametrize("name", NAMES)
def test_signals_one_record_per_iteration_with_the_worst_dp_rank(matrix: Matrix, name: str) -> None:
    layout, run = BY_NAME[name], matrix.first(name)
    records = _trained(run)
    last = records[-1].iteration
    assert [r.iteration for r in records] == list(range(FIRST, last + 1))
    local = _by_rank(run.records())
    for r in records:
        ranks = local[r.iteration]
        assert sorted(ranks) == list(range(layout.dp))
        worst = max(ranks, key=ranks.get)
        assert r.max_loss_dp_rank == worst, r.iteration
        assert r.max_local_loss == pytest.approx(ranks[worst], rel=1e-6)
        # The same measure as lm loss: its mean over the (equally sized) DP ranks.
        assert sum(ranks.values()) / layout.dp == pytest.approx(r.lm_loss, rel=1e-5)
        if BAD[0] <= r.iteration <= BAD[1]:
            assert worst == layout.dp - 1, "the drill's garbage is on the last DP rank"
        assert r.update_ratio > 0 and r.params_norm > 0 and math.isfinite(r.lm_loss)
        # One dataset is one blend member, with every loss token of the global batch (the
        # per-source path at this layout: read on TP rank 0, reduced over TP x DP).
        (member,) = r.tokens_by_dataset
        assert r.tokens_by_dataset[member] == GLOBAL_BATCH * SEQ_LENGTH, r.iteration
        assert r.lm_loss_by_dataset[member] == pytest.approx(r.lm_loss, rel=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_validation_by_dataset_reduces_to_megatrons_lm_loss_counting_each_token_once(
    matrix: Matrix, name: str
) -> None:
    """The first launch's one evaluation (after FIRST): every member of the validation blend,
    each evaluated token once (TP ranks > 0 and the stages without the loss add nothing), and
    Σ member loss·tokens / Σ tokens is Megatron's printed validation lm loss."""
    run = matrix.first(name)
    records = read_validation(run.workdir / "signals" / VALIDATION_FILE)
    printed = _evaluations(run)
    assert [r.iteration for r in records] == [i for i, _ in printed] == [EVAL_INTERVAL]
    for record, (_, megatron) in zip(records, printed):
        assert (record.split, record.set_name) == ("valid", None)
        assert record.lm_loss == pytest.approx(megatron, rel=1e-6)  # printed to 7 digits
        members = matrix.validation_members
        assert set(record.lm_loss_by_dataset) == set(record.tokens_by_dataset) == members
        # Weights 1:1: each member has half of every evaluated global batch.
        assert set(record.tokens_by_dataset.values()) == {EVAL_TOKENS // 2}, record
        combined = sum(
            record.lm_loss_by_dataset[n] * t for n, t in record.tokens_by_dataset.items()
        )
        assert combined / EVAL_TOKENS == pytest.approx(record.lm_loss, rel=LOSS_CHECK_RTOL)
        low, high = sorted(record.lm_loss_by_dataset.values())
        assert high - low > 0.1, "the members differ: neither could pass as the aggregate"
    assert f" validation lm loss by dataset at iteration {EVAL_INTERVAL} | " in run.log
    assert "megatron-ext WARNING" not in run.log


@pytest.mark.parametrize("name", NAMES)
def test_stragglers_every_step_has_its_slowest_rank_and_nobody_is_named(
    matrix: Matrix, name: str
) -> None:
    """Every rank's busy time is in each step's one after-step sum: each record names the
    slowest rank against its peers' median (the console's line the same), and nobody is a
    straggler on these balanced runs."""
    layout, run = BY_NAME[name], matrix.first(name)
    for r in _trained(run):
        assert r.slowest_rank in range(layout.nproc), r
        assert r.slowest_step_time >= r.median_step_time > 0, r
        assert r.straggler_rank is None and r.straggler_node is None, r
        line = (
            f" iteration {r.iteration:8d} | slowest rank {r.slowest_rank} ({HOST}): busy "
            f"{r.slowest_step_time:.3f} s, peers' median {r.median_step_time:.3f} s"
        )
        assert line in run.log, line
    assert "is a straggler" not in run.log


@pytest.mark.parametrize("name", NAMES)
def test_drill_exits_on_every_rank_without_saving_past_the_onset(matrix: Matrix, name: str) -> None:
    layout, run = BY_NAME[name], matrix.first(name)
    exits = run.exits()
    assert sorted(exits) == list(range(layout.nproc)), run.log[-3000:]
    assert {e["exit_code"] for e in exits.values()} == {EXIT_CODE_SPIKE}, exits
    rollback = next(e for e in _ledger(run.workdir) if e["kind"] == "rollback")
    assert rollback["onset"] == BAD[0] and rollback["culprit_dp_rank"] == layout.dp - 1
    assert rollback["iteration"] == _trained(run)[-1].iteration
    saved = sorted(int(p.name.removeprefix("iter_")) for p in (run.workdir / "ckpt").glob("iter_*"))
    interval = RESTART_SAVE_INTERVAL if layout.restart else SAVE_INTERVAL
    healthy = [k for k in range(FIRST, BAD[0]) if k % interval == 0]
    assert saved == [FIRST - 1, *healthy], "no checkpoint once the spike started"


def _ledger(run_dir: Path) -> list[dict]:
    """The detector's events (the per-attempt config lines hold paths and attempts)."""
    return read_ledger(run_dir / "signals" / SPIKE_LEDGER_FILE).events


def _session(checkpoint: Path) -> cli.Session:
    options = cli.build_parser().parse_args(
        ["--from-checkpoint", str(checkpoint), "--iteration", "1"]
    )
    return cli.Session(options, [])


@pytest.mark.parametrize("name", NAMES)
def test_sample_log_and_lookup_agree_and_name_the_reader_ranks(matrix: Matrix, name: str) -> None:
    """Every DP rank's records equal megatron-ext lookup's answer, and the ranks lookup says
    read each DP rank's batches are the ranks the harness saw read them."""
    layout, run = BY_NAME[name], matrix.first(name)
    last = _trained(run)[-1].iteration
    recorded = _keyed(run)
    assert len(recorded) == (last - FIRST + 1) * GLOBAL_BATCH // MICRO_BATCH
    read = defaultdict(dict)  # DP rank -> {global rank: micro-batches read}
    for rank, record in run.exits().items():
        for dp_rank, count in record["reads"].items():
            read[int(dp_rank)][rank] = count
    session = _session(run.workdir / "ckpt")
    for iteration in range(FIRST, last + 1):
        _, answer = cli.batch_records(session, session.config.schedule.batch(iteration))
        slots: dict[tuple[int, int, int], tuple[list[int], list[str]]] = {}
        for sample in answer:
            assert sample["readers"] == sorted(read[sample["dp_rank"]]), sample["dp_rank"]
            ids, digests = slots.setdefault(
                (iteration, sample["dp_rank"], sample["microbatch"]), ([], [])
            )
            ids.append(sample["sample_index"])
            digests.append(sample["token_sha1"])
        for key, (ids, digests) in slots.items():
            if iteration in range(BAD[0], BAD[1] + 1) and key[1] == layout.dp - 1:
                assert recorded[key].sample_ids == ids  # trained on garbage: other tokens
                continue
            assert (recorded[key].sample_ids, recorded[key].token_sha1) == (ids, digests), key
    readers = {rank for ranks in read.values() for rank in ranks}
    assert len(readers) == layout.dp * min(layout.pp, 2), "TP rank 0 of first and last stage"
    steps = last - FIRST + 1 + EVAL_ITERS * len(_evaluations(run))  # evaluations read too
    per_reader = steps * _microbatches(layout)
    assert all(n == per_reader for ranks in read.values() for n in ranks.values()), read


@pytest.mark.parametrize("name", [layout.name for layout in LAYOUTS if layout.restart])
def test_drill_plan_is_applied_and_the_restart_passes_the_spike(matrix: Matrix, name: str) -> None:
    layout, first = BY_NAME[name], matrix.first(name)
    plan, second = matrix.restart(name)
    work = second.workdir  # a copy of the first launch's checkpoints and signals
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert "Roll back to checkpoint 15, skip iterations 16-22" in plan.stdout
    assert second.returncode == 0, second.log[-3000:]
    assert {e["exit_code"] for e in second.exits().values()} == {0}
    skipped = range(16, 23)
    exited_at = _trained(first)[-1].iteration
    latest = latest_per_iteration(_signals(work))
    # The rolled-back iterations keep their first records; the skipped ones get none.
    assert [(r.iteration, r.attempt) for r in latest] == [
        *((k, 1) for k in range(FIRST, exited_at + 1)),
        *((k, 2) for k in range(23, TRAIN_ITERS + 1)),
    ]
    for dp_rank, records in second.records().items():
        assert [(r.iteration, r.microbatch) for r in records] == [
            (k, m)
            for k in range(16, TRAIN_ITERS + 1)
            if k not in skipped
            for m in range(_microbatches(layout))
        ]
        for r in records:
            slot = r.microbatch * layout.dp + dp_rank
            start = (r.iteration - 1) * GLOBAL_BATCH + slot * MICRO_BATCH
            assert r.sample_ids == list(range(start, start + MICRO_BATCH))
    final = checkpoint_args(work / "ckpt", TRAIN_ITERS)
    assert final.skipped_train_samples == len(skipped) * GLOBAL_BATCH
    assert final.consumed_train_samples == TRAIN_ITERS * GLOBAL_BATCH


@pytest.mark.parametrize("name", [layout.name for layout in LAYOUTS if layout.resume])
def test_kill_9_after_a_checkpoint_then_resume_is_bit_exact(matrix: Matrix, name: str) -> None:
    """R resumes K (killed right after its checkpoint of FIRST) and must replay U (the first
    launch) bit for bit up to the same spike exit: losses, norms, the worst rank, the update
    ratio, every sample record and the detector's decision (primed from K's signals)."""
    killed, resumed = matrix.resume(name)
    assert killed.returncode != 0 and not killed.exits(), "K must die by SIGKILL"
    _assert_replays(matrix.first(name), killed.workdir, resumed)


@pytest.mark.parametrize("name", [layout.name for layout in LAYOUTS if layout.replay])
def test_resume_of_the_first_checkpoint_replays_the_first_launch(matrix: Matrix, name: str) -> None:
    """A resume from a copy of the first launch's checkpoint of FIRST (its signals and ledger
    cut at FIRST) retraces the first launch bit for bit: the layout's checkpoint saves and
    loads everything the step depends on (for FSDP2: the sharded optimizer state and Adam's
    step, registry fixes fsdp2-checkpoint-param-ids and fsdp2-resume-adam-step)."""
    resumed = matrix.replay(name)
    _assert_replays(matrix.first(name), resumed.workdir, resumed)


def test_fsdp2_shards_over_a_cpu_mesh_and_its_buckets_are_the_fully_shard_units(
    matrix: Matrix,
) -> None:
    """The row is torch FSDP2 (every rank built its mesh through the runner's shim), its
    buckets are Megatron's fully_shard units (the embedding, each layer, the root's rest), and
    its params norm is the model's: one small step from the base's weights of FIRST - 1, not
    one shard's (~0.7 of it at DP=2: megatron-core's, without fsdp2-global-params-norm)."""
    layout, run = BY_NAME["fsdp2-dp2"], matrix.first("fsdp2-dp2")
    assert all(counts.get("DeviceMesh(cuda)") for counts in run.shim_counts().values())
    base = {r.iteration: r for r in _signals(matrix.base(layout).workdir)}[FIRST - 1]
    assert _trained(run)[0].params_norm == pytest.approx(base.params_norm, rel=1e-2)
    layers = layout.num_layers
    spans = [name.split("[")[0] for name in _trained(run)[0].bucket_grad_norms]
    assert spans == [
        "b0:no-layers",
        *(f"b{i + 1}:layers{i}-{i}" for i in range(layers)),
        f"b{layers + 1}:no-layers",
    ]


def _assert_replays(uninterrupted: Run, files: Path, resumed: Run) -> None:
    """``resumed`` (whose signals and ledger are under ``files``) replays ``uninterrupted``
    from FIRST + 1 to its spike exit, bit for bit."""
    assert {e["exit_code"] for e in resumed.exits().values()} == {EXIT_CODE_SPIKE}
    expected = {r.iteration: r for r in _trained(uninterrupted)}
    replayed = {r.iteration: r for r in latest_per_iteration(_signals(files))}
    assert sorted(replayed) == sorted(expected)
    for k in range(FIRST + 1, max(expected) + 1):
        a, b = expected[k].as_json(), replayed[k].as_json()
        # Timings are not replayed: the wall time and the ranks' busy times (stragglers).
        timing = ("slowest_rank", "slowest_step_time", "median_step_time", "straggler_rank")
        for volatile in ("attempt", "wall_time", "job_id", *timing, "straggler_node"):
            a.pop(volatile), b.pop(volatile)
        assert a == b, k
    original = {k: r for k, r in _keyed(uninterrupted).items() if k[0] > FIRST}
    assert _keyed(resumed) == original
    decisions = [_ledger(run_dir) for run_dir in (uninterrupted.workdir, files)]
    for events in decisions:  # the window holds wall times and attempts: the rest must match
        for event in events:
            event.pop("window"), event.pop("attempt")
    assert decisions[0] == decisions[1] and decisions[0][-1]["iteration"] == max(expected)


def test_sequence_and_context_parallelism_are_refused_without_transformer_engine(
    data_args: list[str],
) -> None:
    cases = {
        "--sequence-parallel needs Transformer Engine or Apex": [
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
        ],
        "--context-parallel-size 2 needs Transformer Engine": ["--context-parallel-size", "2"],
    }
    with ThreadPoolExecutor(len(cases)) as pool:
        results = pool.map(rank0_alone, [[*data_args, *flags] for flags in cases.values()])
    for message, result in zip(cases, results):
        output = result.stdout + result.stderr
        assert result.returncode != 0
        assert message in output, output[-3000:]
        assert "initializing torch distributed" not in output, "refused after start-up"


def test_fsdp_layouts_that_cannot_start_are_refused_at_start_up(data_args: list[str]) -> None:
    """Megatron-FSDP on the CPU runner (its wrapper builds a 'cuda:<device>' string and
    reduce-scatters with PREMUL_SUM, which gloo lacks), and an FSDP with
    CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron asserts): one line each, before distributed init,
    no traceback."""
    cases = {
        "--use-megatron-fsdp is refused on the CPU runner": (
            ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"],
            {},
        ),
        "CUDA_DEVICE_MAX_CONNECTIONS=1 with --use-torch-fsdp2: Megatron asserts": (
            ["--use-torch-fsdp2"],
            {"CUDA_DEVICE_MAX_CONNECTIONS": "1"},
        ),
    }
    with ThreadPoolExecutor(len(cases)) as pool:
        runs = [pool.submit(rank0_alone, [*data_args, *f], env) for f, env in cases.values()]
    for message, run in zip(cases, runs):
        result = run.result()
        output = result.stdout + result.stderr
        assert result.returncode == 1, output[-3000:]
        assert message in output, output[-3000:]
        assert "Traceback" not in output and "initializing torch distributed" not in output
