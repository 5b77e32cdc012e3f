"""The record core: every on-disk format one part of megatron-ext writes and another reads,
defined once below every feature folder (standard library, ``io``, ``files``; no Megatron).
``signals`` (the per-step log), ``ledger`` (spike events, incident plans), ``spike_config``,
``skip_ranges``/``skip_windows`` (the skip list), ``sample_log`` and its reader, ``sources``
(blend member names), ``pair`` (the ``.bin``/``.idx`` pair), ``provenance`` (its sidecar),
``hangs`` (hang dumps and reports).
"""
