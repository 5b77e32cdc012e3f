#!/usr/bin/env python3
"""JSONL -> Megatron .bin/.idx; same as ``megatron-ext preprocess`` (see --help)."""

import sys

from megatron_ext.data.preprocess import main

if __name__ == "__main__":
    sys.exit(main())
