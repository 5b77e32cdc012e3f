"""Sample-id reverse lookup: iteration + DP rank -> samples, documents and tokens, and back.

Layers, highest first (tests/unit/lookup/test_lookup_layers.py): cli, crosscheck, session,
history, mock, config, data, schedule, errors.
"""
