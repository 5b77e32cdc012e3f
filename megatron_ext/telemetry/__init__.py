"""Telemetry: per-bucket grad norms, the attention-logit signal and the per-step signals log.

Cores (no Megatron import): ``bucket_layout``, ``layers`` (per-layer norms), ``sharded``
(FSDP2), ``sources``; Megatron adapters: ``adapter``, ``attention_logit``. The signals record is
:mod:`megatron_ext.common.records.signals`.
"""
