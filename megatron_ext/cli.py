"""``megatron-ext``: one console script, one subcommand per tool.

Each subcommand's implementation owns its own parser; this module only dispatches, so the
``tools/`` wrappers and the subcommands share one code path.
"""

from __future__ import annotations

import sys
from typing import Callable

USAGE = """usage: megatron-ext <command> [args]

commands:
  preprocess   JSONL -> Megatron .bin/.idx (trains an offline BPE tokenizer if asked)
  demo         tiny corpus + tiny GPT trained by the real Megatron loop (CPU or GPU)
  skiplist     plan (and --apply) a rollback + skip after a spike exit (code 42)
  patches      list the runtime patches megatron-ext applies to Megatron, and verify them
  lookup       iteration + DP rank -> samples, documents, tokens; document -> iterations
  plot         signals log -> PNG: loss, grad norm, params norm, max logit, spike candidates
"""


def _preprocess(argv: list[str]) -> int:
    from megatron_ext.data.preprocess import main

    return main(argv)


def _demo(argv: list[str]) -> int:
    from megatron_ext.demo import main

    return main(argv)


def _patches(argv: list[str]) -> int:
    from megatron_ext.patch_report import main

    return main(argv)


def _lookup(argv: list[str]) -> int:
    from megatron_ext.lookup.cli import main

    return main(argv)


def _plot(argv: list[str]) -> int:
    from megatron_ext.plot import main

    return main(argv)


def _skiplist(argv: list[str]) -> int:
    from megatron_ext.skiplist_cli import main

    return main(argv)


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "preprocess": _preprocess,
    "demo": _demo,
    "patches": _patches,
    "skiplist": _skiplist,
    "lookup": _lookup,
    "plot": _plot,
}


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``megatron-ext <command> ...``."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command = COMMANDS.get(argv[0])
    if command is None:
        print(f"megatron-ext: unknown command {argv[0]!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return command(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
