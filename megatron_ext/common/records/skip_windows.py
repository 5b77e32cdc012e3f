"""Skip windows kept in samples, and the checkpoint a start-up resumes from (no Megatron).

At another ``--global-batch-size`` the same iterations hold other samples: :func:`place` maps
a rollback window's samples to the iterations that hold them now, from the checkpoint being
loaded (:func:`resume_point`). :func:`check_batch_change` refuses a batch change in one line.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from megatron_ext.common.bridge_state import BridgeStateError
from megatron_ext.common.checkpoint_state import UnreadableState, read_saved_args
from megatron_ext.common.files import checkpoint_dir, read_checkpoint_tracker


@dataclass(frozen=True)
class Window:
    """One skip-list item: iterations ``first``-``last`` and, for a rollback's window, the
    consumed-sample indices ``samples`` (inclusive) they stand for."""

    first: int
    last: int
    samples: tuple[int, int] | None = None

    def iterations(self) -> str:
        return f"{self.first}-{self.last}" if self.first != self.last else str(self.first)

    def text(self) -> str:
        """The skip-file line (``A-B`` or ``A-B samples S-T``)."""
        if self.samples is None:
            return self.iterations()
        return f"{self.first}-{self.last} samples {self.samples[0]}-{self.samples[1]}"


@dataclass(frozen=True)
class ResumePoint:
    """Where the training resumes: the checkpoint it loads, as that checkpoint's args say."""

    iteration: int  # the checkpoint's iteration; training resumes at iteration + 1 (0: fresh)
    consumed: int  # consumed_train_samples when it was saved
    global_batch: int | None  # its --global-batch-size (None: a fresh start)
    skipped: frozenset[int]  # what the run that saved it skipped (iterations_to_skip)


FRESH = ResumePoint(0, 0, None, frozenset())


def resume_point(argv: list[str]) -> ResumePoint | None:
    """The checkpoint Megatron will load (``--ckpt-step``, else the tracker in ``--load``), read
    from its saved args; :data:`FRESH` when none will be loaded; None when it cannot be read
    here (a damaged tracker, a layout the quick reader does not know: Megatron's load says)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--load")
    parser.add_argument("--ckpt-step", type=int)
    parser.add_argument("--finetune", action="store_true")
    known = parser.parse_known_args(argv)[0]
    if not known.load or known.finetune:  # --finetune starts at iteration 0, sample 0
        return FRESH
    try:
        iteration = (
            known.ckpt_step if known.ckpt_step is not None else read_checkpoint_tracker(known.load)
        )
    except ValueError:
        return None
    if iteration is None:
        return FRESH
    try:
        saved = read_saved_args(checkpoint_dir(known.load, iteration))
    except (UnreadableState, BridgeStateError, OSError):  # Megatron's (Bridge's) load says
        return None
    return ResumePoint(
        iteration,
        int(getattr(saved, "consumed_train_samples", 0) or 0),
        getattr(saved, "global_batch_size", None),
        frozenset(int(i) for i in (getattr(saved, "iterations_to_skip", None) or ())),
    )


def place(window: Window, resume: ResumePoint, global_batch: int) -> tuple[list[Window], str]:
    """``window`` at ``global_batch`` from ``resume``: iteration k > resume.iteration trains
    samples ``consumed + (k - iteration - 1)·batch`` onward, so the samples not yet consumed
    are the covering iterations (a partial batch at either end is skipped whole, and said so).
    A window already consumed stays as recorded (history); the part of one that straddles the
    resume stays as its iterations up to it. Also returns a note when the iterations change."""
    if window.samples is None or window.samples[1] < resume.consumed:
        return [window], ""
    start, end = max(window.samples[0], resume.consumed), window.samples[1]
    first = resume.iteration + 1 + (start - resume.consumed) // global_batch
    last = resume.iteration + -(-(end + 1 - resume.consumed) // global_batch)
    placed = Window(first, last, (start, end))
    history = [Window(window.first, resume.iteration)] if window.first <= resume.iteration else []
    if (first, last) == (window.first, window.last):
        return [*history, placed], ""
    note = (
        f"skip window of samples {start}-{end} (planned as iterations {window.iterations()}) "
        f"is iterations {placed.iterations()} at global batch {global_batch}"
    )
    low = resume.consumed + (first - resume.iteration - 1) * global_batch
    high = resume.consumed + (last - resume.iteration) * global_batch - 1
    if (low, high) != (start, end):
        note += (
            f"; they hold samples {low}-{high}: the {high - low - end + start} sample(s) outside "
            f"the window are skipped too (it is not a whole number of batches of {global_batch})"
        )
    return [*history, placed], note


def check_batch_change(argv: list[str], resume: ResumePoint | None, batch: int | None) -> None:
    """Refuse in one line what Megatron refuses with an assertion traceback deep in the
    checkpoint load: a changed global batch under an iteration-based LR schedule (its warmup and
    decay are counted in samples, iterations x global batch) without choosing whose schedule
    wins. With ``--no-load-optim`` or ``--finetune`` Megatron loads no schedule."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--train-iters", type=int)
    for flag in (
        "--override-opt_param-scheduler",
        "--use-checkpoint-opt_param-scheduler",
        "--no-load-optim",
        "--finetune",
    ):
        spellings = {flag, flag.replace("_", "-")}
        parser.add_argument(*sorted(spellings), action="store_true", dest="chosen")
    known = parser.parse_known_args(argv)[0]
    if not (resume and resume.global_batch and batch and known.train_iters) or known.chosen:
        return
    if batch != resume.global_batch:
        raise ValueError(
            f"--global-batch-size {batch} differs from the {resume.global_batch} of the "
            f"checkpoint at iteration {resume.iteration}, and Megatron's LR schedule (counted in "
            "samples) would refuse it with an assertion: add --override-opt_param-scheduler "
            "(this run's schedule) or --use-checkpoint-opt_param-scheduler (the checkpoint's)"
        )
