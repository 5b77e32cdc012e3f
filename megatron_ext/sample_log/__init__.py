"""The sample log: per DP rank, which samples (and tokens, and losses) each micro-batch had.

``adapter`` is the ``--sample-log-dir`` feature; the record and file format it writes is in
the record core (:mod:`megatron_ext.common.records.sample_log`, no Megatron import), since the
lookup reads it.
"""
