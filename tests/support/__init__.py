"""Shared test support: launches through the CPU runner, Slurm clusters, fakes, fault table.

Imported as ``tests.support.<module>`` from the repository root (pytest's ``pythonpath``).
Scripts run by path (``worker_report.py``, ``gloo_probe.py``, ``faults.py``) import no sibling
by name; the ``netns_slurm`` CLI runs as ``python -m tests.support.netns_slurm``.
"""
