"""Spikes: the online detector, the rollback + skip planner, skip lists and the drill.

Cores (no Megatron import): ``detector``, ``planner``, ``skip_ranges``, ``drill``. Megatron
adapter: ``adapter`` (the ``--spike-*``, skip-list and drill features). Command:
``cli`` (``megatron-ext skiplist``).
"""
