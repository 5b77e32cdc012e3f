"""The record core: every on-disk format that one part of megatron-ext writes and another reads.

Training writes these files and the offline tools (plot, ``skiplist``, ``lookup``) read them
weeks later, so each format is defined once, here, below every feature folder: a feature or a
tool imports a record from this package, never from another feature's folder. Standard
library and the lower layer (``io``, ``files``) only; no Megatron import.

- ``signals``: the per-step signals record, its writer and readers (``--signals-dir``);
- ``ledger``: the spike ledger's events and per-attempt config lines, the incident plans;
- ``spike_config``: the detector thresholds and their ``--spike-*`` flags, as the ledger
  records them (training, the plot and the benchmark share one definition);
- ``skip_ranges``: iteration ranges and the persisted skip list (the planner writes it, the
  entry point reads it at start-up);
- ``sample_log``: the per-rank sample log and the layout log (``--sample-log-dir``; read by
  the lookup);
- ``sources``: how the per-source records (signals, ledger, drill) name a blend member;
- ``pair``: the fingerprinted ``.bin``/``.idx`` pair (preprocess writes it; training start-up
  and the lookup check it);
- ``provenance``: the pair's provenance sidecar, each document's raw record (preprocess and
  ``provenance rebuild`` write it; the lookup and ``blocklist apply`` read it).
"""
