"""Telemetry: bucket and layer norms, the attention-logit signal, stragglers, per-dataset
losses and the per-step signals log (:mod:`megatron_ext.common.records.signals`).
"""
