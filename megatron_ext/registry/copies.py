"""The registry's table of Megatron logic the overlay copies
(:mod:`megatron_ext.registry.copy_check`).

Part of the one manifest of upstream dependencies (:mod:`megatron_ext.registry.table` imports it and
``megatron-ext patches`` lists it); a table of its own to keep registry.py within its size.
Every copy here is the lookup's (scope "tools"): the lookup verifies them when it runs, and
training start-up skips them, so a tool's copy never blocks a training job.
"""

from __future__ import annotations

import sys

from megatron_ext.common.versions import ALL, V17, V18, V19
from megatron_ext.registry.copy_check import Copy, Source, digest, installed_version

_TRAINING = "megatron.training.training"
_DATASETS = "megatron.core.datasets"
_CALCULATOR = "megatron.core.num_microbatches_calculator"
_LOOKUP = "megatron_ext.lookup"

# tests/unit/lookup/ prove each copy equals the Megatron objects it mirrors on the installed
# version; `python -m megatron_ext.registry.copies` prints the installed version's digests.
COPIES: tuple[Copy, ...] = (
    Copy(
        name="lookup-sampler",
        targets=(
            "megatron.training.datasets.data_samplers:MegatronPretrainingSampler",
            "megatron.training.datasets.data_samplers:MegatronPretrainingRandomSampler",
        ),
        used_by=(f"{_LOOKUP}.position", f"{_LOOKUP}.cyclic"),
        reason="Which DP rank and micro-batch read which sample: the single sampler's slices "
        "of the consumed-samples stream, the cyclic sampler's per-epoch permutation.",
        sources=(Source(ALL, "e3397d1e7ca1e1eb"),),
    ),
    Copy(
        name="lookup-microbatch-calculator",
        targets=(
            f"{_CALCULATOR}:_build_num_microbatches_calculator",
            f"{_CALCULATOR}:ConstantNumMicroBatchesCalculator",
            f"{_CALCULATOR}:StepBatchsizeNumMicroBatchesCalculator",
        ),
        used_by=(f"{_LOOKUP}.position", f"{_LOOKUP}.config"),
        reason="Each iteration's global batch: constant (rounded down with "
        "--decrease-batch-size-if-needed), or --step-batch-size-schedule's thresholds in "
        "tokens; --rampup-batch-size ignored from 0.18 on.",
        sources=(
            Source((*V18, *V19), "1135b26e454f3bda"),
            Source(
                V17,
                "5fbaa45214919cc4",
                targets=(
                    f"{_CALCULATOR}:_build_num_microbatches_calculator",
                    f"{_CALCULATOR}:ConstantNumMicroBatchesCalculator",
                    f"{_CALCULATOR}:_round",
                ),
                note="No step schedule; --rampup-batch-size builds the ramp-up calculator "
                "(lookup-rampup).",
            ),
        ),
    ),
    Copy(
        name="lookup-rampup",
        targets=(f"{_CALCULATOR}:RampupBatchsizeNumMicroBatchesCalculator",),
        used_by=(f"{_LOOKUP}.position",),
        reason="megatron-core 0.17 ramps the batch up by consumed samples (float steps); "
        "the lookup follows it for runs its checkpoint args show 0.17 trained.",
        sources=(
            Source(V17, "d709ef79a3640bc7"),
            Source(
                (*V18, *V19),
                "084f6871d65f0bf7",
                targets=(f"{_CALCULATOR}:init_num_microbatches_calculator",),
                note="No ramp-up calculator: init_num_microbatches_calculator warns that "
                "--rampup-batch-size is deprecated and ignores it.",
            ),
        ),
    ),
    Copy(
        name="lookup-train-iters",
        targets=(f"{_TRAINING}:update_train_iters",),
        used_by=(f"{_LOOKUP}.config",),
        reason="Sample-based runs: how many iterations --train-samples gives.",
        sources=(
            Source((*V18, *V19), "37a59f2118982794"),
            Source(V17, "b9821d7d38897e9c", note="Counts the ramp-up with unrounded sizes."),
        ),
    ),
    Copy(
        name="lookup-cache-descriptions",
        targets=(
            f"{_DATASETS}.megatron_dataset:MegatronDataset.__init__",
            f"{_DATASETS}.megatron_dataset:MegatronDataset._key_config_attributes",
            f"{_DATASETS}.gpt_dataset:GPTDataset._build_document_sample_shuffle_indices",
            f"{_DATASETS}.blended_dataset:BlendedDataset.__init__",
            f"{_DATASETS}.blended_megatron_dataset_builder:_get_size_per_split_per_dataset",
        ),
        used_by=(f"{_LOOKUP}.caches", f"{_LOOKUP}.indices"),
        reason="The caches are found by their description.txt (fields, md5 in the file "
        "names, blend member sizes with the surplus) and checked by their epochs and counts.",
        sources=(
            Source(V19, "d252f88be4ced304"),
            Source(
                V17 + V18,
                "e8cb363594b3e2d9",
                note="numpy.load where 0.19 has safe_numpy_load: the same files and names "
                "(cache files are byte-identical from 0.17.1 to 0.19.2).",
            ),
        ),
    ),
    Copy(
        name="lookup-gpt-sample",
        targets=(
            f"{_DATASETS}.gpt_dataset:GPTDataset.__getitem__",
            f"{_DATASETS}.gpt_dataset:GPTDataset._query_document_sample_shuffle_indices",
            f"{_DATASETS}.blended_dataset:BlendedDataset.__getitem__",
        ),
        used_by=(f"{_LOOKUP}.indices", f"{_LOOKUP}.dataset"),
        reason="A global sample -> blend member -> shuffled sample -> documents and token "
        "spans (with the extra label token), pad tokens mapped to 0.",
        sources=(
            Source(V19, "d15939aaa5fd2756"),
            Source(V17 + V18, "56075f434c3664a3", note="The same samples (tests/unit/lookup)."),
        ),
    ),
    Copy(
        name="lookup-tokenizer-description",
        targets=(
            "megatron.core.tokenizers.utils.build_tokenizer:build_tokenizer",
            "megatron.core.tokenizers.text.text_tokenizer:MegatronTokenizerText.unique_identifiers",
        ),
        used_by=(f"{_LOOKUP}.tokenizer",),
        reason="--text rebuilds the run's tokenizer from its args and matches the caches by "
        "the tokenizer's identifiers: renamed args and added identifiers per version.",
        sources=(
            Source((*V18, *V19), "da65b16f64464dbd"),
            Source(
                V17,
                "bee89c1ff076e184",
                note="tokenizer_special_tokens / tokenizer_metadata (0.18: special_tokens / "
                "metadata_path); no chat_template, SentencePiece whitespace or Null pad "
                "identifiers.",
            ),
        ),
    ),
    Copy(
        name="lookup-megatron-flags",
        targets=("megatron.training.arguments:add_megatron_arguments",),
        used_by=(f"{_LOOKUP}.flagspec",),
        reason="The lookup parses a run's flags with this parser rebuilt from "
        "megatron_flags/<version>.json, generated from it (tests compare every action).",
        sources=(
            Source(V19, "393bea44dcc11bcc"),
            Source(V18, "f586bf8183fc6c46"),
            Source(V17, "34a834e3a3e637db"),
        ),
    ),
    Copy(
        name="lookup-indexed-dataset-format",
        targets=(
            f"{_DATASETS}.indexed_dataset:_INDEX_HEADER",
            f"{_DATASETS}.indexed_dataset:DType",
            f"{_DATASETS}.indexed_dataset:_IndexReader.__init__",
            f"{_DATASETS}.indexed_dataset:IndexedDataset.get",
        ),
        used_by=(
            f"{_LOOKUP}.formats",
            "megatron_ext.common.records.pair",
            "megatron_ext.data.checks",
            "megatron_ext.data.provenance",
        ),
        reason="The lookup, the pair check, the split check and the provenance rebuild read "
        ".idx/.bin as this reader does (the layout is defined once, in records/pair.py): "
        "header, version 1, dtype code, counts, then the three arrays; tokens as "
        "IndexedDataset.get slices them.",
        sources=(Source(ALL, "63a03efdcae6fc7f"),),
    ),
    Copy(
        name="lookup-data-flag-rules",
        targets=(
            f"{_DATASETS}.utils:get_blend_from_list",
            "megatron.training.utils.common_utils:get_blend_and_blend_per_split",
            f"{_DATASETS}.blended_megatron_dataset_config:parse_and_normalize_split",
            f"{_DATASETS}.blended_megatron_dataset_config:convert_split_vector_to_split_matrix",
        ),
        used_by=(f"{_LOOKUP}.formats",),
        reason="--data-path weights/prefixes, which data flag wins, --split -> the train "
        "split's [begin, end).",
        sources=(
            Source(V19, "819a174565fabc15"),
            Source(V18, "16a0b5e543c7d348", note="The same code as 0.17's (0.19 changed it)."),
            Source(
                V17,
                "16a0b5e543c7d348",
                targets=(
                    f"{_DATASETS}.utils:get_blend_from_list",
                    "megatron.training.utils:get_blend_and_blend_per_split",
                    f"{_DATASETS}.blended_megatron_dataset_config:parse_and_normalize_split",
                    f"{_DATASETS}.blended_megatron_dataset_config:"
                    "convert_split_vector_to_split_matrix",
                ),
                note="megatron.training.utils is a module (0.18: a package, the function in "
                "its common_utils).",
            ),
        ),
    ),
)


if __name__ == "__main__":  # the digests to record after re-verifying a copy on a version
    print(f"megatron-core {installed_version()}:")
    for entry in COPIES:
        try:
            print(f"  {entry.name}: {digest(entry.source_for().targets or entry.targets)}")
        except LookupError as exc:
            print(f"  {entry.name}: missing ({exc})", file=sys.stderr)
