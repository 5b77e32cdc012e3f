"""The per-layer core (megatron_ext.telemetry.layers): layer entries of parameter names, the
local slot layout, the host-side split of the reduced slots and the first rising layer."""

from __future__ import annotations

import pytest

from megatron_ext.telemetry.layers import (
    GRAD,
    PARAM,
    first_rising_layer,
    layer_of,
    local_layers,
    segment_owners,
    slot_names,
    split_slots,
)


def test_a_parameter_belongs_to_its_layer_or_its_module() -> None:
    assert layer_of("module.decoder.layers.12.mlp.linear_fc1.weight") == "decoder.layers.12"
    assert layer_of("decoder.layers.3.mlp.experts.local_experts.1.linear_fc2.weight") == (
        "decoder.layers.3"
    )
    assert layer_of("embedding.word_embeddings.weight") == "embedding.word_embeddings"
    assert layer_of("decoder.final_layernorm.bias") == "decoder.final_layernorm"
    assert layer_of("output_layer.weight") == "output_layer"
    names = ["output_layer", "decoder.layers.10", "decoder.final_layernorm", "decoder.layers.9"]
    assert local_layers({False: [*names, "embedding.word_embeddings", "decoder.layers.9"]}) == {
        False: [
            "embedding.word_embeddings",
            "decoder.layers.9",
            "decoder.layers.10",
            "decoder.final_layernorm",
            "output_layer",
        ]
    }


def test_segments_index_their_kind_s_grad_and_weight_slots() -> None:
    layers = {False: ["a", "b"], True: ["b"]}
    kinds = [(False, "b"), (True, "b"), (False, "a"), (False, "b")]
    grads, weights, size = segment_owners(kinds, layers)
    # dense: grads a b, weights a b; expert: grad b, weight b
    assert (grads, weights, size) == ([1, 4, 0, 1], [3, 5, 2, 3], 6)
    assert slot_names(layers[False]) == [GRAD + "a", GRAD + "b", PARAM + "a", PARAM + "b"]


def test_reduced_slots_add_a_layer_s_parts_from_every_owner() -> None:
    names = ["b0:x", GRAD + "decoder.layers.1", GRAD + "decoder.layers.0", PARAM + "output_layer"]
    names += [GRAD + "decoder.layers.1", GRAD + "output_layer"]  # e.g. an EP rank's experts
    buckets, grads, params = split_slots(names, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    assert buckets == {"b0:x": 1.0}
    assert grads == {"decoder.layers.0": 3.0, "decoder.layers.1": 7.0, "output_layer": 6.0}
    assert list(grads) == ["decoder.layers.0", "decoder.layers.1", "output_layer"]
    assert params == {"output_layer": 4.0}


def test_the_first_layer_to_rise_before_the_onset_is_named() -> None:
    history = [(i, {"l0": 1.0, "l1": 2.0, "l2": 1.0}) for i in range(1, 81)]
    history += [
        (i, {"l0": 1.0, "l1": 2.0 + (i > 85) * 3, "l2": 1.0 + (i > 90) * 9}) for i in range(81, 101)
    ]
    assert first_rising_layer(history, 100, 20, 1.3) == ("l1", 86, pytest.approx(2.5))
    assert first_rising_layer(history[:85], 100, 20, 1.3) is None  # nothing rose
    assert first_rising_layer(history[80:], 100, 20, 1.3) is None  # no baseline before
