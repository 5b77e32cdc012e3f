"""``python -m megatron_ext.supervise``: what the launch scripts exec."""

import sys

from megatron_ext.supervise.cli import main

sys.exit(main())
