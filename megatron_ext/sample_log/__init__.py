"""The sample log (``--sample-log-dir``): per DP rank, the samples, tokens and losses of each
micro-batch. Its format lives in :mod:`megatron_ext.common.records.sample_log` (the lookup
reads it)."""
