"""A failure that comes back after its rollback: roll back further, skip more, then stop.

Why: a rollback + skip helps only when the trouble lies in the skipped stretch. It does not
when the rollback target itself is bad (Megatron-LM #5281: a damaged checkpoint that produces
a NaN a few iterations after every load), when the bad data runs on past the window, or when a
GPU's persistent fault reproduces anywhere. Each would bring the same failure back right after
the relaunch, and the supervisor would roll back to the same target again until its budget ran
out (issue #30).

So an incident whose onset falls after an applied rollback's target and within its skip
window's reach (the window's end + one window length) *repeats* that rollback (and, through it,
the rollbacks it repeated). The plan then goes to a checkpoint older than every target tried
and skips from there to past every window and onset seen, plus one window. After
:data:`MAX_REPEATS` repeats it stops, naming what was tried. A replay under the ``confirm``
policy (no window) is the confirmation step itself, never a repeat. No Megatron import.
"""

from __future__ import annotations

from typing import Any

MAX_REPEATS = 2


def repeated(incident: dict[str, Any], applied: list[dict[str, Any]], n: int) -> list[dict]:
    """The applied rollbacks (``applied.jsonl`` records, oldest first) that ``incident``
    repeats, oldest first; empty when it is a new failure. ``n``: the skip window's length."""
    chain: list[dict[str, Any]] = []
    onset = int(incident["onset"])
    for record in reversed(applied):
        window = record.get("skip_window")
        if not window or record.get("action") != "rollback-and-skip":
            break
        if not int(record["rollback_to"]) < onset <= int(window[1]) + n:
            break
        chain.append(record)
        onset = int(record["onset"])
    return chain[::-1]


def limit(chain: list[dict[str, Any]], limit: int) -> int:
    """The newest iteration a repeat may roll back to: before every target tried."""
    return min([limit, *(int(r["rollback_to"]) - 1 for r in chain)])


def window_end(chain: list[dict[str, Any]], target: int, iteration: int, n: int) -> int:
    """The skip window's end: past every window and incident seen, plus one window length."""
    reached = [iteration, *(int(r["skip_window"][1]) for r in chain)]
    return max(target + n, max(reached) + n) if chain else target + n


def tried(chain: list[dict[str, Any]]) -> str:
    return "; ".join(
        f"incident {int(r['incident']):03d} (onset {r['onset']}): rolled back to "
        f"{r['rollback_to']}, skipped {r['skip_window'][0]}-{r['skip_window'][1]}"
        for r in chain
    )


def refuse_if_exhausted(chain: list[dict[str, Any]], onset: int) -> str | None:
    """The refusal when the failure has come back too often; None while a try is left."""
    if len(chain) <= MAX_REPEATS:
        return None
    return (
        f"the failure came back at onset {onset} after {len(chain)} rollbacks that each rolled "
        f"back further and skipped more ({tried(chain)}); stopping instead of rolling back "
        "again. Likely: a checkpoint that fails after every load (Megatron-LM #5281: compare "
        "the losses right after each resume), a persistent GPU fault (the ranks and nodes in "
        "the ledger and Megatron's result-rejected tracker), or bad data longer than every "
        "window (`megatron-ext lookup` of the onsets). Fix the cause, then relaunch; "
        "`skiplist --undo` reverts the last rollback"
    )


def note(chain: list[dict[str, Any]]) -> str:
    """The summary's sentence for a repeat (empty for a new failure)."""
    if not chain:
        return ""
    return (
        f" The same failure came back after {tried(chain)}: rolling back to a checkpoint older "
        f"than every target tried and skipping past every window seen (repeat {len(chain)} of "
        f"at most {MAX_REPEATS})."
    )
