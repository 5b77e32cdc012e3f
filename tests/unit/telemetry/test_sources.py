"""Per-source signals on real megatron-core objects: a BlendedDataset built by
BlendedMegatronDatasetBuilder, Megatron's data loader collation and a real GPTModel's per-token
loss. Each member's loss equals a direct computation over its own samples, the token-weighted
mean equals ``lm loss``, and a single dataset (no BlendedDataset) is one member."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from megatron.core.tokenizers import MegatronTokenizer

from megatron_ext.common.features import DATASET_ID_KEY, LossInputs, MicroBatch, StepRecord
from megatron_ext.common.files import SIGNALS_FILE
from megatron_ext.common.records.signals import read_signals
from megatron_ext.common.records.sources import member_names, train_members
from megatron_ext.telemetry.adapter import TelemetryFeature
from tests.support import megatron_world as mw

DATA_FLAGS = dict.fromkeys(
    (
        "data_path",
        "data_args_path",
        "train_data_path",
        "valid_data_path",
        "test_data_path",
        "per_split_data_args_path",
    )
)


@pytest.fixture(scope="module")
def world():
    with mw.megatron_world():
        yield


def test_members_are_named_by_basename_unless_ambiguous() -> None:
    assert member_names(["/d/web_text_document", "/d/code_text_document"]) == [
        "web_text_document",
        "code_text_document",
    ]
    assert member_names(["/en/web", "/de/web", "/x/code"]) == ["/en/web", "/de/web", "code"]
    assert member_names(["/a/web", "/a/web"]) == ["web", "web#2"]


def test_the_train_split_blend_names_the_members() -> None:
    blend = mw.args(**{**DATA_FLAGS, "data_path": ["0.7", "/d/prose", "0.3", "/d/code"]})
    assert train_members(blend) == ["prose", "code"]
    per_split = mw.args(
        **{**DATA_FLAGS, "train_data_path": ["/t/a", "/t/b"], "valid_data_path": ["/v/c"]}
    )
    assert train_members(per_split) == ["a", "b"]
    assert train_members(mw.args(**DATA_FLAGS)) == []  # mock data: no members


def _prefix(root: Path, name: str, low: int, high: int, seed: int) -> str:
    """A real .bin/.idx of random documents whose tokens lie in [low, high): two members
    that a model tells apart."""
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(f"{root / name}.bin", dtype=np.uint16)
    for _ in range(40):
        document = np.append(rng.integers(low, high, int(rng.integers(8, 40))), mw.VOCAB - 1)
        builder.add_document(document, [len(document)])
    builder.finalize(f"{root / name}.idx")
    return str(root / name)


def _train_dataset(tmp_path: Path, prefixes: list[str], weights: list[float] | None):
    tokenizer = MegatronTokenizer.from_pretrained(
        metadata_path={"library": "null-text"}, vocab_size=mw.VOCAB
    )
    config = GPTDatasetConfig(
        random_seed=1,
        sequence_length=mw.SEQ,
        blend=(prefixes, weights),
        split="100,0,0",
        path_to_cache=str(tmp_path / "cache"),
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=True,  # loss masks differ per sample: token weighting matters
    )
    return BlendedMegatronDatasetBuilder(GPTDataset, [64, 0, 0], lambda: True, config).build()[0]


def _feature(tmp_path: Path, data_path: list[str], by_dataset: bool = True):
    chunk = mw.ddp(mw.tiny_gpt())
    feature = TelemetryFeature()
    feature.install(
        mw.args(
            **{**DATA_FLAGS, "data_path": data_path},
            log_bucket_grad_norms=False,
            signals_dir=str(tmp_path / "signals"),
            signals_update_ratio=False,
            num_experts=None,
            log_interval=1,
            consumed_train_samples=8,
            skipped_train_samples=0,
            log_max_attention_logit=False,
            signals_attention_logit=False,
            signals_by_dataset=by_dataset,
            log_layer_norms=False,
            straggler_factor=1.5,
            straggler_steps=5,
            straggler_min_seconds=0.0,
        )
    )
    feature.on_setup([chunk], mw.optimizer([chunk]))
    return feature, chunk


def _step(feature: TelemetryFeature, chunk, dataset, micro_batches: int = 3):
    """Micro-batches of the real dataset through the model and the feature's on_loss, then
    after_step; returns the record and, per member, the directly computed (loss sum, tokens)."""
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, shuffle=False)
    direct: dict[int, list[float]] = {}
    loss_sum = tokens = 0.0
    with torch.no_grad():
        for _, batch in zip(range(micro_batches), loader):
            per_token = chunk(
                batch["tokens"], batch["position_ids"], None, labels=batch["labels"]
            ).float()
            mask = batch["loss_mask"].reshape(-1).float()
            loss = torch.sum(per_token.reshape(-1) * mask)
            micro = MicroBatch(1, True, 0, True, dataset_ids=batch.get(DATASET_ID_KEY))
            feature.on_loss(LossInputs(micro, per_token, mask, loss, mask.sum().int()))
            loss_sum, tokens = loss_sum + float(loss), tokens + float(mask.sum())
            ids = batch.get(DATASET_ID_KEY, torch.zeros(len(per_token), dtype=torch.int64))
            for row, member in enumerate(ids.tolist()):
                got = direct.setdefault(member, [0.0, 0.0])
                got[0] += float((per_token[row] * batch["loss_mask"][row]).sum())
                got[1] += float(batch["loss_mask"][row].sum())
    losses = {"lm loss": torch.tensor(loss_sum / tokens)}
    record = StepRecord(1, losses, 1e-3, 1.0, False, 1.0, 1.0, None, None)
    feature.after_step(record)
    return record.signals, direct, loss_sum / tokens


def test_each_member_gets_its_own_samples_loss_and_the_mean_is_lm_loss(
    world, tmp_path: Path
) -> None:
    prefixes = [
        _prefix(tmp_path, "prose", 1, 40, seed=1),
        _prefix(tmp_path, "code", 60, 120, seed=2),
    ]
    dataset = _train_dataset(tmp_path, prefixes, [0.7, 0.3])
    feature, chunk = _feature(tmp_path, ["0.7", prefixes[0], "0.3", prefixes[1]])
    signals, direct, lm_loss = _step(feature, chunk, dataset)

    assert set(direct) == {0, 1}, "the batch draws from both members"
    names = ["prose", "code"]
    assert signals.tokens_by_dataset == {names[m]: round(t) for m, (_, t) in direct.items()}
    for member, (loss, count) in direct.items():
        assert signals.lm_loss_by_dataset[names[member]] == pytest.approx(loss / count, rel=1e-6)
    weighted = sum(
        signals.lm_loss_by_dataset[n] * signals.tokens_by_dataset[n] for n in names
    ) / sum(signals.tokens_by_dataset.values())
    assert weighted == pytest.approx(signals.lm_loss, rel=1e-6)
    assert signals.lm_loss == pytest.approx(lm_loss, rel=1e-6)
    # Written to the log; the accumulator starts over for the next iteration.
    (written,) = read_signals(tmp_path / "signals" / SIGNALS_FILE)
    assert written.lm_loss_by_dataset == pytest.approx(signals.lm_loss_by_dataset)
    assert written.tokens_by_dataset == signals.tokens_by_dataset
    assert not feature.sources.sums.any()


def test_a_single_dataset_is_one_member_with_every_token(world, tmp_path: Path) -> None:
    prefix = _prefix(tmp_path, "only", 1, 120, seed=3)
    dataset = _train_dataset(tmp_path, [prefix], None)
    assert DATASET_ID_KEY not in dataset[0], "Megatron does not wrap one dataset in a blend"
    feature, chunk = _feature(tmp_path, [prefix])
    signals, direct, lm_loss = _step(feature, chunk, dataset, micro_batches=2)
    assert signals.tokens_by_dataset == {"only": round(direct[0][1])}
    assert signals.lm_loss_by_dataset["only"] == pytest.approx(lm_loss, rel=1e-6)


def test_a_blend_batch_without_dataset_ids_is_refused(world, tmp_path: Path) -> None:
    feature, _ = _feature(tmp_path, ["0.5", "/d/a", "0.5", "/d/b"])
    per_token, mask = torch.ones(2, mw.SEQ), torch.ones(2 * mw.SEQ)
    inputs = LossInputs(MicroBatch(1, True, 0, True), per_token, mask, mask.sum(), mask.sum())
    with pytest.raises(RuntimeError, match="without dataset_id"):
        feature.on_loss(inputs)


class _Writer:
    """Stands in for Megatron's TensorBoard writer (tensorboard is not installed here)."""

    def __init__(self) -> None:
        self.scalars: dict[str, float] = {}

    def add_scalar(self, key: str, value: float, iteration: int) -> None:
        self.scalars[key] = value


def test_one_all_reduce_per_step_no_host_sync_and_tensorboard_keys(
    world, tmp_path: Path, monkeypatch, capsys
) -> None:
    """on_loss reads nothing back to the host; after_step adds exactly one all-reduce, the
    overlay's one after-step all-reduce of float64 values (2K for the sources, 2 per DP rank
    for the worst-rank loss, 2 per rank for the busy times); TensorBoard gets
    lm-loss-by-dataset/<name> and tokens-by-dataset/<name>; --no-signals-by-dataset leaves it
    all out."""
    import megatron_ext.telemetry.adapter as adapter
    import megatron_ext.telemetry.sources as sources

    prefixes = [_prefix(tmp_path, "web", 1, 40, seed=4), _prefix(tmp_path, "code", 60, 120, 5)]
    dataset = _train_dataset(tmp_path, prefixes, [0.5, 0.5])
    writer = _Writer()
    monkeypatch.setattr(adapter, "get_tensorboard_writer", lambda: writer)
    reduced: list[tuple[int, torch.dtype]] = []
    real = sources.dist.all_reduce
    monkeypatch.setattr(
        sources.dist,
        "all_reduce",
        lambda t, **k: (reduced.append((t.numel(), t.dtype)), real(t, **k))[1],
    )
    feature, chunk = _feature(tmp_path, ["0.5", prefixes[0], "0.5", prefixes[1]])
    loader = torch.utils.data.DataLoader(dataset, batch_size=4)
    batch = next(iter(loader))
    with torch.no_grad():
        per_token = chunk(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    mask = batch["loss_mask"].reshape(-1).float()
    micro = MicroBatch(1, True, 0, True, dataset_ids=batch[DATASET_ID_KEY])
    inputs = LossInputs(
        micro, per_token, mask, (per_token.reshape(-1) * mask).sum(), mask.sum().int()
    )
    synced: list[str] = []
    reduced.clear()  # building the model and optimizer reduced too
    for name in ("item", "tolist"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor, name, lambda t, _o=original, _n=name: (synced.append(_n), _o(t))[1]
        )
    feature.on_loss(inputs)
    assert synced == [] and reduced == []
    monkeypatch.undo()  # the record's own reads (worst rank, bucket norms) are not ours
    monkeypatch.setattr(adapter, "get_tensorboard_writer", lambda: writer)
    monkeypatch.setattr(
        sources.dist,
        "all_reduce",
        lambda t, **k: (reduced.append((t.numel(), t.dtype)), real(t, **k))[1],
    )
    record = StepRecord(1, {"lm loss": torch.tensor(1.0)}, 1e-3, 1.0, False, 1.0, 1.0, None, None)
    reduced.clear()
    feature.after_step(record)
    assert reduced == [(2 * 2 + 2 * 1 + 2 * 1, torch.float64)]
    tokens = {k.split("/")[1]: v for k, v in writer.scalars.items() if k.startswith("tokens-")}
    assert set(tokens) == {"web", "code"}
    losses = {k for k in writer.scalars if k.startswith("lm-loss-by-dataset/")}
    assert losses == {f"lm-loss-by-dataset/{n}" for n, t in tokens.items() if t} != set()
    assert sum(v for k, v in writer.scalars.items() if k.startswith("tokens")) == mask.sum()
    assert "| lm loss by dataset | web: " in capsys.readouterr().out

    off, _ = _feature(tmp_path / "off", ["0.5", prefixes[0], "0.5", prefixes[1]], False)
    assert off.sources is None
