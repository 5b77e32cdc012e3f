"""Incidents: the offline tools that act on a spike after training exited with the spike code
(``megatron-ext skiplist``: planner, cause tree, report, journaled apply); nothing here runs
inside training."""
