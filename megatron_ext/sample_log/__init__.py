"""The sample log: per DP rank, which samples (and tokens, and losses) each micro-batch had.

``core`` holds the record and file format (no Megatron import); ``adapter`` the
``--sample-log-dir`` feature.
"""

from megatron_ext.sample_log.core import SampleLog, SampleRecord, read_records

__all__ = ["SampleLog", "SampleRecord", "read_records"]
