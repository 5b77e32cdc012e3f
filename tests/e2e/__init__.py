"""Real launches (marked ``e2e`` by tests/conftest.py)."""
