"""``megatron-ext``: one console script, one subcommand per tool.

Each subcommand's module owns its parser; this only dispatches (importing a command's module,
and so its dependencies, only when used) and keeps optional-dependency import warnings out of
the commands' output (:mod:`megatron_ext.common.quiet`).
"""

from __future__ import annotations

import importlib
import sys

from megatron_ext.common.errors import exit_on_error
from megatron_ext.common.quiet import silence_import_noise

USAGE = """usage: megatron-ext <command> [args]

commands:
  preprocess   JSONL -> Megatron .bin/.idx (trains an offline BPE tokenizer if asked)
  demo         tiny corpus + tiny GPT trained by the real Megatron loop (CPU or GPU)
  train        train on your own data on CPU: --cpu runs pretrain_gpt_ext.py on the CPU harness
  skiplist     plan (and --apply) a rollback + skip after a spike exit (code 42)
  patches      list the runtime patches megatron-ext applies to Megatron, and verify them
  lookup       iteration + DP rank -> samples, documents, tokens; document -> iterations
  provenance   rebuild a dataset's provenance sidecar (document -> file, line, id); show it
  blocklist    apply a lookup's blocklist to the raw JSONL shards (filtered copies)
  plot         signals log -> PNG: loss, grad norm, params norm, max logit, spike candidates
  supervise    the launchers' attempt loop and exit-code policy (see launch/)
"""


# Subcommand -> module with ``main(argv) -> int``.
COMMANDS: dict[str, str] = {
    "preprocess": "megatron_ext.data.preprocess",
    "demo": "megatron_ext.demo",
    "train": "megatron_ext.train",
    "patches": "megatron_ext.patches",
    "skiplist": "megatron_ext.incidents.cli",
    "lookup": "megatron_ext.lookup.cli",
    "provenance": "megatron_ext.data.provenance",
    "blocklist": "megatron_ext.data.blocklist",
    "plot": "megatron_ext.plot.draw",
    "supervise": "megatron_ext.supervise.cli",
}


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``megatron-ext <command> ...``."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    module = COMMANDS.get(argv[0])
    if module is None:
        print(f"megatron-ext: unknown command {argv[0]!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    silence_import_noise()
    # A refusal that a command does not report itself still ends as its message, no traceback.
    return exit_on_error(lambda: importlib.import_module(module).main(argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
