"""``megatron-ext lookup``: exact against megatron-core's own datasets and samplers, refuses
changed data, and agrees with what the real training loop recorded (CPU harness, DP=2).

Tiny datasets are written with megatron-core's ``IndexedDatasetBuilder`` and their caches built
by ``BlendedMegatronDatasetBuilder`` (the path training takes); the tool then reads only those
caches and the .bin/.idx.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from megatron.core.num_microbatches_calculator import (
    ConstantNumMicroBatchesCalculator,
    StepBatchsizeNumMicroBatchesCalculator,
    _build_num_microbatches_calculator,
)
from megatron.core.parallel_state import RankGenerator
from megatron.core.tokenizers import MegatronTokenizer
from megatron.training.datasets.data_samplers import (
    MegatronPretrainingRandomSampler,
    MegatronPretrainingSampler,
)

from harness import checkpoint_args, launch
from megatron_ext import cli as megatron_ext_cli
from megatron_ext.lookup import cli
from megatron_ext.lookup.config import pad_token_id
from megatron_ext.lookup.cyclic import CyclicOrder
from megatron_ext.lookup.errors import CacheMissing, ConfigError, DataChanged, PositionError
from megatron_ext.lookup.indices import DataSpec, open_train_index
from megatron_ext.lookup.inverse import find_document
from megatron_ext.lookup.position import Anchor, Schedule, parse_step_schedule
from megatron_ext.lookup.render import token_sha1
from megatron_ext.lookup.topology import Topology
from megatron_ext.sample_log_adapter import token_digest

VOCAB = 512
SURPLUS = 0.005


def _null_tokenizer():
    return MegatronTokenizer.from_pretrained(metadata_path={"library": "null-text"},
                                             vocab_size=VOCAB)


def _write_prefix(prefix: Path, documents: list[np.ndarray]) -> str:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for document in documents:
        builder.add_document(document, [len(document)])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def _documents(rng: np.random.Generator, count: int) -> list[np.ndarray]:
    """Random token documents of random lengths, each ending with the EOD id."""
    return [np.append(rng.integers(1, VOCAB - 1, int(rng.integers(1, 60))), VOCAB - 1)
            for _ in range(count)]


def _build(prefixes: list[str], weights: list[float] | None, *, per_split: bool, split: str,
           seed: int, seq: int, target: int, cache: Path, extra: bool):
    """The train dataset as megatron-core builds it (caches written to ``cache``)."""
    blend = (prefixes, weights)
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq, blend=None if per_split else blend,
        blend_per_split=[blend, None, None] if per_split else None,
        split=None if per_split else split, path_to_cache=str(cache),
        tokenizer=_null_tokenizer(), reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, mid_level_dataset_surplus=SURPLUS,
        add_extra_token_to_sequence=extra,
    )
    sizes = [target, 0 if per_split else 3, 0]
    return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()[0]


def _spec(prefixes, weights, *, per_split, split, seed, seq, target, cache, extra) -> DataSpec:
    return DataSpec(tuple(prefixes), None if weights is None else tuple(weights), per_split,
                    None if per_split else split, seed, seq, target, SURPLUS, str(cache), extra)


# --- batch arithmetic against Megatron's own calculators, samplers and rank generator ----------


def test_positions_equal_megatron_calculators_and_locate_inverts_them() -> None:
    """Constant, rounded-down and step-schedule batches walk like Megatron's training loop."""
    cases = [
        (dict(global_batch_size=12), ConstantNumMicroBatchesCalculator(12, 2, 3, False, 0)),
        (dict(global_batch_size=14, decrease_batch_size_if_needed=True),
         ConstantNumMicroBatchesCalculator(14, 2, 3, True, 0)),
        (dict(global_batch_size=6, step_schedule=parse_step_schedule("0:6 1K:12 3K:24", 16)),
         StepBatchsizeNumMicroBatchesCalculator(2, 3, False, 0, "0:6 1K:12 3K:24", 16)),
    ]
    for fields, calculator in cases:
        schedule = Schedule(micro_batch_size=2, data_parallel_size=3, train_iters=40, **fields)
        consumed = 0
        for iteration in range(1, 41):
            calculator.update(consumed, consistency_check=True)
            batch = schedule.batch(iteration)
            assert (batch.consumed_before, batch.size, batch.num_microbatches) == (
                consumed, calculator.get_current_running_global_batch_size(), calculator.get())
            for m in range(batch.num_microbatches):
                for r in range(3):
                    positions = schedule.positions(batch, m, r)
                    its, mbs, ranks = schedule.locate(positions, 0)
                    assert set(its) == {iteration} and set(mbs) == {m} and set(ranks) == {r}
            consumed += batch.size
        assert schedule.batch_at_consumed(schedule.batch(7).consumed_before).iteration == 7


def test_rampup_batch_size_is_ignored_by_megatron_core_0_19_2() -> None:
    """Why the tool treats --rampup-batch-size as a no-op (and says so)."""
    calculator = _build_num_microbatches_calculator(0, 64, 2, 4, False, None, 128)
    assert isinstance(calculator, ConstantNumMicroBatchesCalculator)
    from megatron.core import num_microbatches_calculator as nmc

    nmc.init_num_microbatches_calculator(0, [16, 8, 1000], 64, 2, 4)
    try:
        nmc.update_num_microbatches(0)
        assert nmc.get_current_global_batch_size() == 64  # no ramp-up
    finally:
        nmc.destroy_num_microbatches_calculator()


def test_skips_phases_and_anchors() -> None:
    schedule = Schedule(2, 2, 8, train_iters=30, iterations_to_skip=frozenset({13, 14}),
                        anchor=Anchor(10, 80))
    assert [schedule.batch(k).skipped for k in (12, 13, 14, 15)] == [False, True, True, False]
    assert schedule.batch(15).consumed_before == 14 * 8  # skipped batches are still consumed
    phased = Schedule(2, 2, 8, train_iters=30, phase_transitions=(10, 25))
    assert [(phased.batch(k).phase, phased.batch(k).stream_start) for k in (10, 11, 26)] == [
        (0, 72), (1, 0), (2, 0)]
    assert phased.locate(np.array([0, 15]), 1)[0].tolist() == [11, 12]
    with pytest.raises(ConfigError, match="phase"):
        Schedule(2, 2, 6, phase_transitions=(5,), step_schedule=((0, 4), (40, 8)))
    resized = Schedule(2, 2, 8, train_iters=30, anchor=Anchor(10, 120))  # GBS changed at resume
    assert not resized.history_known and resized.batch(11).consumed_before == 120
    with pytest.raises(PositionError, match="precedes checkpoint iteration 10"):
        resized.batch(3)
    with pytest.raises(PositionError, match="beyond --train-iters"):
        schedule.batch(31)


def test_cyclic_order_equals_megatrons_random_sampler() -> None:
    for total, mbs, dp, sharding in ((103, 2, 3, True), (96, 3, 2, False), (50, 1, 4, True)):
        order = CyclicOrder(total, mbs, dp, sharding)
        for rank in range(dp):
            sampler = MegatronPretrainingRandomSampler(None, total, 0, mbs, rank, dp, sharding)
            drawn = [batch for _ in range(3) for batch in sampler]  # cyclic_iter: 3 epochs
            positions = [np.arange(n * mbs * dp + rank * mbs, n * mbs * dp + (rank + 1) * mbs)
                         for n in range(len(drawn))]
            assert [order.dataset_indices(p).tolist() for p in positions] == drawn
            found, origin = order.positions_of(np.array(drawn[5]), epochs=3)
            for i, position in enumerate(positions[5].tolist()):
                assert position in found[origin == i].tolist()
    with pytest.raises(ConfigError, match="disagree"):
        CyclicOrder(10, 1, 4, False)


def test_reader_ranks_follow_megatrons_rank_generator() -> None:
    for tp, cp, dp, pp, order in ((2, 2, 3, 2, "tp-cp-ep-dp-pp"), (2, 1, 2, 3, "tp-cp-ep-pp-dp")):
        generator = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
        topology = Topology(dp, tp, pp, cp, tp_pp_dp_mapping=order.endswith("dp"))
        for group in generator.get_ranks("dp"):
            for dp_rank, rank in enumerate(group):
                tp_rank = next(g.index(rank) for g in generator.get_ranks("tp") if rank in g)
                pp_rank = next(g.index(rank) for g in generator.get_ranks("pp") if rank in g)
                cp_rank = next(g.index(rank) for g in generator.get_ranks("cp") if rank in g)
                assert topology.rank(tp=tp_rank, cp=cp_rank, dp=dp_rank, pp=pp_rank) == rank
        assert len(topology.readers(1)) == cp * len({0, pp - 1})


# --- exactness: the tool's tokens are megatron-core's dataset[i] for the sampler's ids --------


CASES = [  # prefixes, weighted, per-split, split, add_extra_token
    (3, True, False, "90,10,0", True),
    (4, True, False, "100,0,0", True),
    (3, False, False, "80,20,0", True),
    (1, False, False, "90,10,0", False),
    (3, True, True, None, True),
    (1, True, False, "100,0,0", True),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_tokens_equal_megatron_dataset_for_the_samplers_ids(tmp_path: Path, case: int) -> None:
    rng = np.random.default_rng(1000 + case)
    n_prefix, weighted, per_split, split, extra = CASES[case]
    prefixes = [_write_prefix(tmp_path / f"d{p}", _documents(rng, int(rng.integers(10, 30))))
                for p in range(n_prefix)]
    weights = rng.uniform(0.1, 1.0, n_prefix).round(3).tolist() if weighted else None
    seq, mbs, dp = int(rng.integers(8, 40)), int(rng.integers(1, 4)), int(rng.integers(1, 4))
    gbs = mbs * dp * int(rng.integers(1, 4))
    iters = int(rng.integers(10, 20))
    seed = int(rng.integers(0, 10_000))
    kw = dict(per_split=per_split, split=split, seed=seed, seq=seq, target=iters * gbs,
              cache=tmp_path / "cache", extra=extra)
    dataset = _build(prefixes, weights, **kw)
    iters = min(iters, len(dataset) // gbs)  # an unweighted blend may be smaller
    index = open_train_index(_spec(prefixes, weights, **kw))
    assert len(index) == len(dataset)
    schedule = Schedule(mbs, dp, gbs, train_iters=iters)
    pad = pad_token_id(_null_tokenizer(), False)
    for rank in range(dp):
        sampler = MegatronPretrainingSampler(len(dataset), 0, mbs, rank, dp)
        for n, ids in zip(range(iters * (gbs // (mbs * dp))), sampler):
            batch = schedule.batch(n // (gbs // (mbs * dp)) + 1)
            assert schedule.positions(batch, n % batch.num_microbatches, rank).tolist() == ids
            for sample in index.resolve(ids, pad):
                expected = dataset[sample.index]["tokens"].numpy()
                assert np.array_equal(sample.tokens, expected), (case, sample)
                assert token_sha1(sample.tokens) == token_digest(dataset[sample.index]["tokens"])
    every = index.resolve(range(len(dataset)), pad)
    if weighted or n_prefix == 1:  # an unweighted blend is one epoch of each member
        epochs = [len(m.document_index) // (m.end - m.begin) for m in index.mids]
        assert max(epochs) > 1, "the cases must span several epochs"
    for member in range(n_prefix):
        for document in rng.choice(index.mids[member].end, 3, replace=False).tolist():
            brute = sorted((s.index, span.offset, span.count) for s in every
                           if s.dataset == member for span in s.spans
                           if span.document == document)
            hits = find_document(index, member, document)
            assert sorted(zip(hits.global_indices.tolist(), hits.offsets.tolist(),
                              hits.counts.tolist())) == brute


# --- refusals: changed, moved, tampered or missing data --------------------------------------


@pytest.fixture
def built(tmp_path: Path):
    rng = np.random.default_rng(7)
    docs = [_documents(rng, 60) for _ in range(3)]
    prefixes = [_write_prefix(tmp_path / "data" / f"d{p}", d) for p, d in enumerate(docs)]
    kw = dict(per_split=False, split="100,0,0", seed=3, seq=16, target=120,
              cache=tmp_path / "cache", extra=True)
    _build(prefixes, [0.5, 0.3, 0.2], **kw)
    return tmp_path, prefixes, docs, _spec(prefixes, [0.5, 0.3, 0.2], **kw)


def test_reordered_data_is_refused_not_misanswered(built) -> None:
    root, prefixes, docs, spec = built
    before = [s.tokens for s in open_train_index(spec).resolve(range(24))]
    order = np.random.default_rng(1).permutation(len(docs[0]))
    _write_prefix(Path(prefixes[0]), [docs[0][i] for i in order])  # same docs, new order
    index = open_train_index(spec)  # counts and sizes still agree...
    with pytest.raises(DataChanged, match="re-preprocessed, reordered or edited"):
        index.resolve(range(24))  # ...but the documents moved under the caches
    _write_prefix(Path(prefixes[0]), docs[0])
    assert all(np.array_equal(a, b.tokens)
               for a, b in zip(before, open_train_index(spec).resolve(range(24))))


def test_changed_counts_moved_tampered_and_missing_caches_are_refused(built) -> None:
    root, prefixes, docs, spec = built
    _write_prefix(Path(prefixes[1]), docs[1] + [np.array([5, VOCAB - 1])])  # one more document
    with pytest.raises(DataChanged, match="61 sequences"):
        open_train_index(spec)
    _write_prefix(Path(prefixes[1]), docs[1])
    shutil.move(root / "data", root / "moved")
    with pytest.raises(DataChanged, match="--data-root"):
        open_train_index(spec)
    remapped = open_train_index(spec, data_root=[(str(root / "data"), str(root / "moved"))])
    assert len(remapped.resolve(range(8))) == 8
    shutil.move(root / "moved", root / "data")
    description = next((root / "cache").glob("*-BlendedDataset-train-description.txt"))
    original = description.read_text()
    description.write_text(original.replace('"size": 120', '"size":  120'))  # same JSON
    with pytest.raises(DataChanged, match="md5 of its contents"):
        open_train_index(spec)
    description.write_text(original.replace('"size": 120', '"size": 121'))
    with pytest.raises(CacheMissing, match="do not hash to their names"):
        open_train_index(spec)
    description.unlink()
    with pytest.raises(CacheMissing, match="--rebuild-caches"):
        open_train_index(spec)


# --- the command line ---------------------------------------------------------------------


def _flags(root: Path, prefixes: list[str]) -> list[str]:
    return ["--data-path", "0.5", prefixes[0], "0.3", prefixes[1], "0.2", prefixes[2],
            "--split", "100,0,0", "--seq-length", "16", "--micro-batch-size", "2",
            "--global-batch-size", "12", "--train-iters", "10", "--seed", "3",
            "--data-cache-path", str(root / "cli-cache"), "--data-parallel-size", "3",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
            "--iterations-to-skip", "4"]


def test_cli_table_json_out_blocklist_and_inverse(built, capsys) -> None:
    root, prefixes, docs, _ = built
    flags = _flags(root, prefixes)
    assert cli.main([*flags, "--iteration", "4"]) == 1
    assert "--rebuild-caches" in capsys.readouterr().err
    assert cli.main([*flags, "--iteration", "4", "--rebuild-caches", "--text"]) == 0
    table = capsys.readouterr().out
    assert "SKIPPED" in table and table.count("    text: ") == 12
    assert cli.main([*flags, "--iteration", "4", "--dp-rank", "1", "--json",
                     "--rampup-batch-size", "4", "4", "48"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert any("ignored by megatron-core 0.19.2" in note for note in answer["notes"])
    assert [(s["microbatch"], s["sample_index"]) for s in answer["samples"]] == [
        (0, 38), (0, 39), (1, 44), (1, 45)]
    assert answer["batch"]["skipped"] and answer["batch"]["consumed_before"] == 36
    out, blocklist = root / "batch.jsonl", root / "block.jsonl"
    assert cli.main([*flags, "--consumed-samples", "36", "--out", str(out),
                     "--emit-blocklist", str(blocklist)]) == 0
    assert "wrote 12 samples" in capsys.readouterr().err
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["sample_index"] for r in lines] == list(range(36, 48))
    blocked = [json.loads(line) for line in blocklist.read_text().splitlines()]
    assert {(b["dataset_path"], b["document"]) for b in blocked} == {
        (r["dataset_path"], d["document"]) for r in lines for d in r["documents"]}
    first = lines[0]["documents"][0]
    assert cli.main([*flags, "--document", str(first["document"]), "--dataset",
                     Path(lines[0]["dataset_path"]).name, "--json"]) == 0
    hits = json.loads(capsys.readouterr().out)["hits"]
    assert {"iteration": 4, "dp_rank": 0, "microbatch": 0, "sample_index": 36,
            "dataset_sample": lines[0]["dataset_sample"], "offset": first["offset"],
            "count": first["count"], "skipped": True} in hits
    cyclic = [*flags, "--dataloader-type", "cyclic"]
    assert cli.main([*cyclic, "--iteration", "9", "--dp-rank", "2", "--json"]) == 0
    drawn = json.loads(capsys.readouterr().out)["samples"][-1]
    assert drawn["sample_index"] not in range(96, 108)  # the cyclic order is not the stream's
    first = drawn["documents"][0]
    assert cli.main([*cyclic, "--document", str(first["document"]), "--dataset",
                     str(drawn["dataset"]), "--json"]) == 0
    hits = json.loads(capsys.readouterr().out)["hits"]
    assert {"iteration": 9, "dp_rank": 2, "microbatch": 1, "sample_index": drawn["sample_index"],
            "dataset_sample": drawn["dataset_sample"], "offset": first["offset"],
            "count": first["count"], "skipped": False} in hits
    assert "\n  lookup " in megatron_ext_cli.USAGE  # wired into `megatron-ext lookup`
    assert megatron_ext_cli.main(["lookup", *flags, "--iteration", "11"]) == 1
    assert "beyond --train-iters 10" in capsys.readouterr().err
    assert cli.main([*flags, "--iteration", "2", "--dataloader-type", "external"]) == 1
    assert "external" in capsys.readouterr().err


# --- the real training loop (CPU harness, DP=2): recorded samples == the tool's answer -------


SKIPPED = (13, 14)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_args):
    """U: 20 iterations uninterrupted; S: resumed from U's iteration-10 checkpoint with
    iterations 13 and 14 skipped. Data: a two-prefix blend of the tiny corpus."""
    root = tmp_path_factory.mktemp("lookup-e2e")
    document = data_args[data_args.index("--data-path") + 1]
    copy = root / "copy_text_document"
    for suffix in (".bin", ".idx"):
        shutil.copy(document + suffix, str(copy) + suffix)
    data = list(data_args)
    data[data.index("--data-path") + 1:data.index("--data-path") + 2] = [
        "0.4", document, "0.6", str(copy)]
    data[data.index("--data-cache-path") + 1] = str(root / "index-cache")

    def run(name: str, *more: str):
        ckpt = root / name / "ckpt"
        result = launch(root / name, [*data, "--save", str(ckpt), "--load", str(ckpt),
                                      "--save-interval", "10", *more], nproc=2)
        assert result.returncode == 0, result.log[-4000:]
        return result

    uninterrupted = run("U")
    shutil.copytree(root / "U" / "ckpt" / "iter_0000010", root / "S" / "ckpt" / "iter_0000010")
    (root / "S" / "ckpt" / "latest_checkpointed_iteration.txt").write_text("10")
    resumed = run("S", "--iterations-to-skip", *map(str, SKIPPED))
    return uninterrupted, resumed


def _session(checkpoint: Path) -> cli.Session:
    options = cli.build_parser().parse_args(["--from-checkpoint", str(checkpoint),
                                             "--iteration", "1"])
    return cli.Session(options, [])


@pytest.mark.timeout(900)
def test_harness_records_equal_the_tools_answer_including_resume_with_skips(trained) -> None:
    uninterrupted, resumed = trained
    for run, first in ((uninterrupted, 1), (resumed, 11)):
        session = _session(run.workdir / "ckpt")
        recorded = {(r.iteration, r.dp_rank, r.microbatch): r
                    for records in run.records().values() for r in records}
        for iteration in range(first, 21):
            batch = session.config.schedule.batch(iteration)
            _, answer = cli.batch_records(session, batch)
            slots = {}
            for sample in answer:
                slot = slots.setdefault((iteration, sample["dp_rank"], sample["microbatch"]),
                                        ([], []))
                slot[0].append(sample["sample_index"])
                slot[1].append(sample["token_sha1"])
            if run is resumed and iteration in SKIPPED:
                assert batch.skipped and all(s["skipped"] for s in answer)
                assert not set(slots) & set(recorded), "a skipped iteration was trained"
                continue
            assert not batch.skipped
            for key, (ids, digests) in slots.items():
                assert (recorded[key].sample_ids, recorded[key].token_sha1) == (ids, digests), key
    final = checkpoint_args(resumed.workdir / "ckpt", 20)
    assert final.iterations_to_skip == list(SKIPPED)
    assert cli.main(["--from-checkpoint", str(resumed.workdir / "ckpt"), "--iteration", "13",
                     "--sample-log", str(resumed.samples)]) == 0
    assert cli.main(["--from-checkpoint", str(uninterrupted.workdir / "ckpt"),
                     "--iteration", "13", "--sample-log", str(uninterrupted.samples)]) == 0
