"""Bridge's own recipe functions as a user runs them (docs/examples/bridge_recipe.py): the
vanilla GPT one, Llama 3 8B 16k (TP 2 of its TP4 PP2 CP2) and Qwen3-30B-A3B (EP 2 of its EP 4),
the last two built from a HuggingFace config in an offline cache, shrunk, mock data and
NullTokenizer, through ``megatron_ext.bridge.pretrain`` with the README's flags, one launch of
two ranks each: it trains to the last iteration; the signals log has every iteration with z
loss and bucket norms (Σ bucket² = grad-norm²); the sample log records the mock samples; and
``megatron-ext lookup`` of an iteration answers mock samples equal to the sample log's."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

from megatron_ext.common.files import SIGNALS_FILE
from megatron_ext.common.records.signals import read_signals
from tests.support.drill import lookup_equals_records
from tests.support.harness import RUNNER, Run, run_logged

SCRIPT = Path(__file__).resolve().parents[2] / "docs" / "examples" / "bridge_recipe.py"
ITERS, GLOBAL_BATCH, MICRO_BATCH, RANKS = 4, 8, 2, 2
README_FLAGS = ["--z-loss-coeff", "1e-5", "--embedding-weight-decay-mult", "0"]
README_FLAGS += ["--log-bucket-grad-norms", "--spike-detect"]
# What the recipe keeps: bf16_mixed, the fused CE ("te": routed to the overlay's kernel), its
# layout kind at two ranks (Bridge prints its config).
ROUTED = "megatron-ext z-loss: --cross-entropy-fusion-impl te"
RECIPES = {  # recipe: (DP size, lines of its log)
    "vanilla_gpt": (2, ("bf16: True", "cross_entropy_loss_fusion: True")),
    "llama3": (1, ("bf16: True", ROUTED, "tensor_model_parallel_size: 2")),
    "qwen3_moe": (
        2,
        ("bf16: True", ROUTED, "expert_model_parallel_size: 2", "load_balancing_loss"),
    ),
}
# HuggingFace configs as the recipes name them, tiny: the recipe shrinks the model anyway.
HF_CONFIGS = {
    ("meta-llama/Meta-Llama-3-8B", "main"): {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "rope_theta": 500000.0,
        "max_position_embeddings": 8192,
        "vocab_size": 128256,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    ("Qwen/Qwen3-30B-A3B", "ad44e777bcd18fa416d9da3bd8f70d33ebb85d39"): {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "head_dim": 16,
        "moe_intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "rope_theta": 1000000.0,
        "max_position_embeddings": 4096,
        "vocab_size": 151936,
        "router_aux_loss_coef": 0.001,
    },
}
COMMON = {
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "torch_dtype": "bfloat16",
}


def hf_cache(root: Path) -> Path:
    """An offline HuggingFace cache holding each recipe's ``config.json`` (no weights)."""
    for (repo, revision), config in HF_CONFIGS.items():
        model = root / "hub" / f"models--{repo.replace('/', '--')}"
        commit = revision if revision != "main" else "0" * 40
        (model / "snapshots" / commit).mkdir(parents=True)
        (model / "snapshots" / commit / "config.json").write_text(json.dumps(COMMON | config))
        (model / "refs").mkdir()
        (model / "refs" / "main").write_text(commit)
    return root


def _launch(work: Path, recipe: str, cache: Path) -> Run:
    work.mkdir(parents=True)
    env = dict(os.environ, HF_HOME=str(cache), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    env |= {"PYTHONUNBUFFERED": "1", "MEGATRON_EXT_HARNESS_COUNTS": str(work / "counts")}
    cmd = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
        *(f"--nproc-per-node={RANKS}", str(RUNNER), "--bridge-script", str(SCRIPT)),
        *("--recipe", recipe, "--work", str(work), "--train-iters", str(ITERS)),
        *("--save-interval", str(ITERS), "--global-batch-size", str(GLOBAL_BATCH)),
        *("--micro-batch-size", str(MICRO_BATCH), *README_FLAGS),
        *("--signals-dir", str(work / "signals"), "--sample-log-dir", str(work / "samples")),
    ]
    return run_logged(cmd, work, env, timeout=400)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return hf_cache(tmp_path_factory.mktemp("hf"))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_a_bridge_recipe_as_users_run_it(recipe: str, cache: Path, tmp_path: Path) -> None:
    dp, lines = RECIPES[recipe]
    run = _launch(tmp_path / "run", recipe, cache)
    assert run.returncode == 0, run.log[-4000:]
    assert f"iteration        {ITERS}/       {ITERS} |" in run.log, run.log[-4000:]
    assert all(line in run.log for line in lines), [line for line in lines if line not in run.log]
    signals = read_signals(run.workdir / "signals" / SIGNALS_FILE)
    assert [r.iteration for r in signals] == list(range(1, ITERS + 1))
    for record in signals:
        assert record.z_loss is not None and record.z_loss > 0, record
        assert record.bucket_grad_norms, record
        squares = sum(v * v for v in record.bucket_grad_norms.values())
        assert math.isclose(squares, record.grad_norm**2, rel_tol=1e-4), record
    records = run.records()
    assert sorted(records) == list(range(dp))
    per_rank = GLOBAL_BATCH // MICRO_BATCH // dp
    for rank in records.values():
        assert [r.iteration for r in rank] == [
            i for i in range(1, ITERS + 1) for _ in range(per_rank)
        ]
    layout = json.loads((run.samples / "layout.jsonl").read_text().splitlines()[0])
    assert layout["mock_data"] is True and layout["data_path"] is None, layout
    _check_lookup(run, records, tmp_path)


def _check_lookup(run: Run, records: dict, out_dir: Path) -> None:
    """``megatron-ext lookup`` of the last iteration on the Bridge checkpoint: mock samples,
    no documents, equal (ids and token digests) to the sample log's."""
    for sample in lookup_equals_records(run, records, ITERS, out_dir):
        assert sample["documents"] == [], sample
        assert sample["mock"].startswith(f"mock sample {sample['sample_index']}, no document")
