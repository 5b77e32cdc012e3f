"""The shared lower layer: what every feature, tool and command may import, and which imports
only itself (tests/unit/test_architecture.py). Standard-library helpers (atomic files, names on
disk, errors and exit codes, how an attempt ended, the run lock's lease), the ``Feature`` base
(:mod:`.features`), the supported megatron-core range (:mod:`.versions`) and the record core
(:mod:`.records`: every file one part writes and another reads)."""
