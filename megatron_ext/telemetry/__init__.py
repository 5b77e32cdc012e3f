"""Telemetry: per-bucket grad norms and the per-step signals log.

Cores (no Megatron import): ``bucket_layout`` (which gradient ranges make each bucket and
which slots each grad-stats group reduces), ``bucket_norms`` (names and the fused norm).
Megatron adapter: ``adapter`` (the ``--log-bucket-grad-norms`` / ``--signals-*`` feature). The
signals record itself is in the record core (:mod:`megatron_ext.common.records.signals`) and its
plot is the ``megatron-ext plot`` command (:mod:`megatron_ext.plot.draw`).
"""
