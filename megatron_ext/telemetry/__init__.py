"""Telemetry: per-bucket grad norms and the per-step signals log.

Cores (no Megatron import): ``bucket_norms``, ``signals``, ``plot`` (``megatron-ext plot``).
Megatron adapter: ``adapter`` (the ``--log-bucket-grad-norms`` / ``--signals-*`` feature).
"""
