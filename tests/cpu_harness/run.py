"""Run ``pretrain_gpt_ext.py`` on CPU: install the counted CUDA shims, then the real entry point.

Usage (world size 2): ``python -m torch.distributed.run --nproc-per-node 2
tests/cpu_harness/run.py <megatron and megatron-ext args>``.

Besides the shim counters, each rank records what tests cannot read from the run's own files:
how many micro-batches it read from the data iterator, per DP rank it read them for, and the
exit code it chose (written the moment ``SystemExit`` reaches this script, so a rank that
exits on its own is told apart from one torchrun terminated after a peer exited first).
"""

import sys
from pathlib import Path

if __name__ == "__main__":  # checkpoint saving spawns helper processes that re-import main
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import shims

    shims.install()

    import pretrain_gpt_ext

    shims.record_batch_reads()
    try:
        pretrain_gpt_ext.main(sys.argv[1:])
    except SystemExit as exc:
        shims.record_exit(exc.code)
        raise
    shims.record_exit(0)
