"""Run ``pretrain_gpt_ext.py`` on CPU: install the counted CUDA shims, then the real entry point.

Usage (world size 2): ``python -m torch.distributed.run --nproc-per-node 2
tests/cpu_harness/run.py <megatron and megatron-ext args>``.
"""

import sys
from pathlib import Path

if __name__ == "__main__":  # checkpoint saving spawns helper processes that re-import main
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import shims

    shims.install()

    import pretrain_gpt_ext

    pretrain_gpt_ext.main(sys.argv[1:])
