"""Per-dataset validation loss on real megatron-core objects: a validation BlendedDataset built
by BlendedMegatronDatasetBuilder, Megatron's collation and a real GPTModel's per-token loss,
through the registry wrappers around an evaluation of Megatron's shape. Each member's loss
equals a direct computation over its own samples and the members reduce to the aggregate."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from megatron.core.tokenizers import MegatronTokenizer

from megatron_ext.common.features import DATASET_ID_KEY, LossInputs, MicroBatch
from megatron_ext.common.files import VALIDATION_FILE
from megatron_ext.common.records.validation import read_validation
from megatron_ext.telemetry.validation import (
    ValidationFeature,
    evaluated_sets,
    evaluating_by_dataset,
    reduces_to,
    set_names,
    summed_by_dataset,
)
from tests.support import megatron_world as mw

NO_DATA = dict.fromkeys(
    ("data_path", "data_args_path", "train_data_path", "valid_data_path", "test_data_path")
) | {"per_split_data_args_path": None}


def _blend(data_path: list[str]) -> tuple:
    from megatron.training.utils import get_blend_and_blend_per_split

    return get_blend_and_blend_per_split(mw.args(**{**NO_DATA, **data_path}))


def test_the_evaluated_sets_follow_megatrons_blends() -> None:
    blend = _blend({"data_path": ["0.7", "/d/prose", "0.3", "/d/code"]})
    assert evaluated_sets(*blend, False) == {
        "valid": [["prose", "code"]],
        "test": [["prose", "code"]],
    }
    per_split = _blend(
        {"train_data_path": ["/t/a"], "valid_data_path": ["0.5", "/v/b", "0.5", "/v/c"]}
    )
    assert evaluated_sets(*per_split, False) == {"valid": [["b", "c"]]}
    # --multiple-validation-sets: Megatron evaluates each valid prefix as a set of its own.
    assert evaluated_sets(*per_split, True) == {"valid": [["b"], ["c"]]}
    assert evaluated_sets(None, None, False) == {}  # mock data
    assert set_names(2, None) == ["0", "1"] and set_names(2, ["b", "c"]) == ["b", "c"]


def test_the_reduction_check_accepts_fp_noise_and_catches_a_wrong_member() -> None:
    losses, tokens = {"a": 2.0, "b": 4.0}, {"a": 300, "b": 100}
    assert reduces_to(losses, tokens, 2.5 * (1 + 1e-7)) == (True, 2.5)
    assert not reduces_to(losses, tokens, 2.51)[0]
    assert not reduces_to({"a": 2.0}, tokens, 2.5)[0]  # a member's loss missing
    assert math.isnan(reduces_to({}, {}, 1.0)[1])


def _prefix(root: Path, name: str, low: int, high: int, seed: int) -> str:
    """A real .bin/.idx of random documents with tokens in [low, high)."""
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(f"{root / name}.bin", dtype=np.uint16)
    for _ in range(40):
        document = np.append(rng.integers(low, high, int(rng.integers(8, 40))), mw.VOCAB - 1)
        builder.add_document(document, [len(document)])
    builder.finalize(f"{root / name}.idx")
    return str(root / name)


def _valid_dataset(tmp_path: Path, prefixes: list[str], weights: list[float]):
    config = GPTDatasetConfig(
        random_seed=1,
        sequence_length=mw.SEQ,
        blend=(prefixes, weights),
        split="50,50,0",
        path_to_cache=str(tmp_path / "cache"),
        tokenizer=MegatronTokenizer.from_pretrained(
            metadata_path={"library": "null-text"}, vocab_size=mw.VOCAB
        ),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=True,  # loss masks differ per sample: token weighting matters
    )
    return BlendedMegatronDatasetBuilder(GPTDataset, [8, 48, 0], lambda: True, config).build()[1]


def _args(tmp_path: Path, data_path: list[str]):
    return mw.args(
        **{**NO_DATA, "data_path": data_path},
        signals_dir=str(tmp_path / "signals"),
        signals_by_dataset=True,
        multiple_validation_sets=False,
        consumed_train_samples=16,
    )


def _megatron_shaped(feature: ValidationFeature, chunk, dataset, wrong: float = 0.0):
    """Megatron's evaluate / evaluate_and_print_results, by signature and return value, over
    three micro-batches of ``dataset``, wrapped by the registry's wrappers; returns the
    wrapped outer function and, per member, the directly computed [loss sum, tokens]."""
    direct: dict[int, list[float]] = {}

    def evaluate(forward_step_func, data_iterator, model, *rest, eval_iters=None):
        total = torch.zeros(2)
        with torch.no_grad():
            for _, batch in zip(range(3), data_iterator):
                per_token = chunk(
                    batch["tokens"], batch["position_ids"], None, labels=batch["labels"]
                ).float()
                mask = batch["loss_mask"].reshape(-1).float()
                loss = torch.sum(per_token.reshape(-1) * mask)
                micro = MicroBatch(10, False, 0, True, dataset_ids=batch[DATASET_ID_KEY])
                feature.on_loss(LossInputs(micro, per_token, mask, loss, mask.sum().int()))
                total += torch.stack([loss, mask.sum()])
                for row, member in enumerate(batch[DATASET_ID_KEY].tolist()):
                    got = direct.setdefault(member, [0.0, 0.0])
                    got[0] += float((per_token[row] * batch["loss_mask"][row]).sum())
                    got[1] += float(batch["loss_mask"][row].sum())
        return {"lm loss": total[0] / total[1] + wrong}, None, False

    wrapped = summed_by_dataset(evaluate, feature)

    def evaluate_and_print_results(
        prefix,
        forward_step_func,
        data_iterator,
        model,
        iteration,
        process_non_loss_data_func,
        config,
        verbose=False,
        write_to_tensorboard=True,
        non_loss_data_func=None,
    ):
        loss_dict, _, _ = wrapped(forward_step_func, data_iterator, model, None, config)
        print(f" validation loss at {prefix} | lm loss value: {float(loss_dict['lm loss'])}")

    loader = torch.utils.data.DataLoader(dataset, batch_size=4, shuffle=False)
    outer = evaluating_by_dataset(evaluate_and_print_results, feature)
    return lambda: outer("iteration 10", None, iter(loader), [chunk], 10, None, None), direct


class _Writer:
    """Stands in for Megatron's TensorBoard writer (tensorboard is not installed here)."""

    def __init__(self) -> None:
        self.scalars: dict[str, tuple[float, int]] = {}

    def add_scalar(self, key: str, value: float, iteration: int) -> None:
        self.scalars[key] = (value, iteration)


@pytest.fixture(scope="module")
def world():
    with mw.megatron_world():
        yield


def _setup(tmp_path: Path, monkeypatch) -> tuple[ValidationFeature, object, object, _Writer]:
    from megatron_ext.telemetry import adapter

    prefixes = [
        _prefix(tmp_path, "prose", 1, 40, seed=1),
        _prefix(tmp_path, "code", 60, 120, seed=2),
    ]
    dataset = _valid_dataset(tmp_path, prefixes, [0.7, 0.3])
    feature = ValidationFeature()
    feature.install(_args(tmp_path, ["0.7", prefixes[0], "0.3", prefixes[1]]))
    chunk = mw.tiny_gpt()
    feature.on_setup([chunk], None)
    writer = _Writer()
    monkeypatch.setattr(adapter, "get_tensorboard_writer", lambda: writer)
    return feature, chunk, dataset, writer


def test_each_member_gets_its_own_samples_loss_and_they_reduce_to_megatrons(
    world, tmp_path: Path, monkeypatch, capsys
) -> None:
    feature, chunk, dataset, writer = _setup(tmp_path, monkeypatch)
    evaluate, direct = _megatron_shaped(feature, chunk, dataset)
    evaluate()

    (record,) = read_validation(tmp_path / "signals" / VALIDATION_FILE)
    assert set(direct) == {0, 1}, "the batches draw from both members"
    names = ["prose", "code"]
    assert record.tokens_by_dataset == {names[m]: round(t) for m, (_, t) in direct.items()}
    for member, (loss, count) in direct.items():
        assert record.lm_loss_by_dataset[names[member]] == pytest.approx(loss / count, rel=1e-6)
    total = sum(record.tokens_by_dataset.values())
    combined = sum(record.lm_loss_by_dataset[n] * t for n, t in record.tokens_by_dataset.items())
    assert combined / total == pytest.approx(record.lm_loss, rel=1e-6)
    assert (record.iteration, record.split, record.set_name) == (10, "valid", None)
    assert record.consumed_samples == 16 and record.attempt == 1
    out = capsys.readouterr().out
    megatron_line = out.index(" validation loss at iteration 10 |")
    assert out.index(" validation lm loss by dataset at iteration 10 | prose: ") > megatron_line
    assert "WARNING" not in out
    assert writer.scalars == {
        f"lm-loss-validation-by-dataset/{n}": (record.lm_loss_by_dataset[n], 10) for n in names
    }
    assert feature.sums is None and feature.evaluation is None  # nothing carried over


def test_training_micro_batches_are_not_counted_and_a_mismatch_warns(
    world, tmp_path: Path, monkeypatch, capsys
) -> None:
    feature, chunk, dataset, _ = _setup(tmp_path, monkeypatch)
    feature.begin("iteration 3", 3, True)
    feature.start_set()
    per_token, mask = torch.ones(2, mw.SEQ), torch.ones(2 * mw.SEQ)
    train = MicroBatch(3, True, 0, True, dataset_ids=torch.tensor([0, 1]))
    feature.on_loss(LossInputs(train, per_token, mask, mask.sum(), mask.sum().int()))
    assert not feature.sums.sums.any()
    feature.sums = feature.evaluation = None
    evaluate, _ = _megatron_shaped(feature, chunk, dataset, wrong=0.01)
    evaluate()
    assert "megatron-ext WARNING: iteration 10: the members' validation lm loss" in (
        capsys.readouterr().out
    )


def test_multiple_validation_sets_are_one_line_each_named_as_megatron_names_them(
    world, tmp_path: Path, monkeypatch, capsys
) -> None:
    """--multiple-validation-sets: Megatron's evaluate runs once per --valid-data-path prefix
    (a GPTDataset each, no dataset_id); each set is one record, named by Megatron's suffix."""
    from megatron_ext.telemetry import adapter

    feature = ValidationFeature()
    paths = {"train_data_path": ["/t/a"], "valid_data_path": ["/v/web", "/v/code"]}
    feature.install(
        mw.args(
            **{**NO_DATA, **paths},
            signals_dir=str(tmp_path / "signals"),
            signals_by_dataset=True,
            multiple_validation_sets=True,
            validation_set_names=["w", "c"],
            consumed_train_samples=0,
        )
    )
    feature.on_setup([], None)
    writer = _Writer()
    monkeypatch.setattr(adapter, "get_tensorboard_writer", lambda: writer)
    feature.begin("iteration 5", 5, True)
    for value in (2.0, 3.0):
        feature.start_set()
        per_token, mask = torch.full((2, mw.SEQ), value), torch.ones(2 * mw.SEQ)
        micro = MicroBatch(5, False, 0, True)  # a GPTDataset's batch: no dataset_id
        feature.on_loss(LossInputs(micro, per_token, mask, mask.sum() * value, mask.sum().int()))
        feature.end_set({"lm loss": torch.tensor(value)}, False)
    feature.report()
    web, code = read_validation(tmp_path / "signals" / VALIDATION_FILE)
    assert (web.set_name, web.lm_loss_by_dataset, web.lm_loss) == ("w", {"web": 2.0}, 2.0)
    assert (code.set_name, code.tokens_by_dataset) == ("c", {"code": 2 * mw.SEQ})
    assert set(writer.scalars) == {
        "lm-loss-validation-w-by-dataset/web",
        "lm-loss-validation-c-by-dataset/code",
    }
    assert " validation-c lm loss by dataset at iteration 5 | code: 3.0000" in (
        capsys.readouterr().out
    )
