"""Fault tests, each naming its fault (tests/support/faults.py renders docs/faults.md)."""
