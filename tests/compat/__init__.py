"""The compatibility tier: what CI runs on every other supported megatron-core (0.18.2, 0.17.1:
``.ci/run``, each on a fresh tier venv from ``tools/compat_venv.sh``), selected with
``-m compat`` from the existing tests, so a tier costs no new launches.

:data:`SELECTED` lists node-id fragments; ``tests/conftest.py`` marks every collected test
whose node id contains one with ``compat``. A test may also be marked
``@pytest.mark.compat`` directly (e.g. the lookup's 0.17 ramp-up case). What it proves on
each version:

- the CPU runner's shims: exactly the version's own set of CUDA touch points fires in a
  world-size-1 run (``WS1_SHIMS``), and any other CUDA call trips;
- the registry verifies, every entry has a form verified on the installed version (unit
  tests, real megatron-core objects); the range's refusals fake the version and refuse before
  Megatron is imported, so they run on 0.19.2 only;
- checkpoint common state reads the version's own checkpoints;
- the layout matrix's rows: every feature at once (z-loss, weight-decay overrides, bucket
  norms, signals, detector, sample log, drill) at PP=2 (drill rollback, plan applied,
  restart past the spike) and DP=2 x PP=2 with the distributed optimizer (kill -9 after a
  checkpoint, resume bit-exact), both on the tied model (one base launch); losses against
  the single-rank base, lookup equal to the sample log. MoE with EP=2 runs on 0.19.2 only:
  its one per-version difference (the bucket norms' duplicate filter) is a registry variant
  verified on every version, and the row's two launches (4 ranks) were a quarter of a
  tier's time;
- ``--spike-skip-update``: refused on 0.17 (no ``grad_norm_skip_threshold``) with the reason,
  accepted on 0.18+;
- the lookup's copies of Megatron logic (digests per version), its flag spec, tokenizer
  descriptions and index logic against the version's own datasets, and lookup equal to the
  sample log under ``--rampup-batch-size`` (0.17 ramps, 0.18+ ignores it).
"""

# The files the tier collects (collecting the whole suite would import tests written for
# newer megatron-core APIs); .ci/run passes them with -m compat.
PATHS = (
    "tests/unit/test_registry.py",
    "tests/unit/test_versions.py",
    "tests/unit/test_checkpoint_state.py",
    "tests/unit/cpu/test_cpu_harness.py",
    "tests/e2e/test_layouts.py",
    "tests/unit/test_copies.py",
    "tests/unit/lookup/test_lookup_datasets.py",
    "tests/unit/lookup/test_lookup_tokenizer.py",
    "tests/unit/lookup/test_lookup_formats.py",
    "tests/unit/lookup/test_lookup_schedule.py",
    "tests/unit/spikes/test_update_skip.py",
    "tests/e2e/test_lookup_training.py",
    "tests/e2e/test_pretrain.py",
)
SELECTED = (
    "tests/unit/test_registry.py::",
    # Not the range checks that fake the version (0.16.1) and refuse before Megatron is
    # imported: the installed megatron-core plays no part in them (0.19.2 runs them).
    "tests/unit/test_versions.py::test_patches_refuses_0_16_1_and_runs_with_the_override",
    "tests/unit/test_checkpoint_state.py::",
    "tests/unit/cpu/test_cpu_harness.py::test_unexpected_cuda_call_trips_and_is_counted",
    "tests/unit/cpu/test_cpu_harness.py::test_shims_count_and_redirect_cuda_allocations",
    "[pp2-tied]",
    "[dp2-pp2-distopt-tied]",
    "test_pretrain.py::test_world_size_1_trains_checkpoints_and_hits_only_known_cuda_points",
)
