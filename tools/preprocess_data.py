#!/usr/bin/env python3
"""JSONL -> Megatron .bin/.idx; same as ``megatron-ext preprocess`` (see --help)."""

import sys

from megatron_ext.cli import main

if __name__ == "__main__":  # through the dispatcher: its warning filters apply too
    sys.exit(main(["preprocess", *sys.argv[1:]]))
