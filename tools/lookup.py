#!/usr/bin/env python3
"""Sample-id reverse lookup; same as ``megatron-ext lookup`` (see --help)."""

import sys

from megatron_ext.cli import main

if __name__ == "__main__":  # through the dispatcher: its warning filters apply too
    sys.exit(main(["lookup", *sys.argv[1:]]))
