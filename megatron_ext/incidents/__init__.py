"""Incidents: the offline tools that act on a spike after training exited with the spike code.

Nothing here runs inside training; everything reads the record core
(:mod:`megatron_ext.common.records`:
signals, spike ledger, skip list) and the checkpoint directory. Cores (no Megatron import):
``planner`` (rollback target + skip window), ``causes`` (the decision tree that names a cause),
``report`` (the incident report), ``transaction`` (the journaled ``--apply``, finished by the
entry point at start-up when a kill interrupted it). Command: ``cli`` (``megatron-ext
skiplist``).
"""
