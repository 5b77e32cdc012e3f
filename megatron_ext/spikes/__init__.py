"""Spikes: what runs inside training when the loss jumps.

Cores (no Megatron import): ``detector`` (the streaming spike detector; ``megatron-ext plot``
replays it) and ``drill`` (the corrupt-batch drill). Megatron adapter: ``adapter`` (the
``--spike-*``, skip-list and drill features). The thresholds, the ledger and the skip list are
records (:mod:`megatron_ext.common.records`); the offline rollback + skip planner is in
:mod:`megatron_ext.incidents`.
"""
