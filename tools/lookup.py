#!/usr/bin/env python3
"""Sample-id reverse lookup; same as ``megatron-ext lookup`` (see --help)."""

import sys

from megatron_ext.lookup.cli import main

if __name__ == "__main__":
    sys.exit(main())
