"""Per-parameter weight-decay multipliers: which parameter decays how much, and why. The
flags' precedence: Megatron's 1-D/bias rule, the last matching GLOB, the embedding/output-layer
flags, then 1.0 (docs/weight-decay.md). No Megatron imports.
"""

from __future__ import annotations

import fnmatch
import math
import re
from dataclasses import dataclass

from megatron_ext.common.errors import Refusal

EMBEDDING_PREFIX = "embedding."
EMBEDDING_WEIGHT = "embedding.word_embeddings.weight"
OUTPUT_LAYER_WEIGHT = "output_layer.weight"

EMBEDDING_FLAG = "--embedding-weight-decay-mult"
OUTPUT_LAYER_FLAG = "--output-layer-weight-decay-mult"
OVERRIDE_FLAG = "--weight-decay-override"


class WeightDecayConfigError(Refusal, ValueError):
    """The weight-decay flags are malformed or cannot mean what the user wrote."""


# The args a policy is made of (saved in a checkpoint, compared on resume).
WEIGHT_DECAY_ARGS = (
    "embedding_weight_decay_mult",
    "output_layer_weight_decay_mult",
    "weight_decay_override",
)


class WeightDecayResumeError(Refusal, RuntimeError):
    """A resume would continue the optimizer under different weight-decay multipliers."""


def check_mult(value: float, what: str) -> float:
    """A multiplier must be a finite number >= 0 (a negative one would grow the weights)."""
    if not math.isfinite(value) or value < 0:
        raise WeightDecayConfigError(
            f"{what}: weight-decay multiplier must be finite and >= 0, got {value!r}"
        )
    return float(value)


@dataclass(frozen=True)
class Override:
    """One ``--weight-decay-override GLOB=MULT``."""

    glob: str
    mult: float

    def __str__(self) -> str:
        return f"{self.glob}={self.mult:g}"


def parse_override(text: str) -> Override:
    """Parse ``GLOB=MULT``; the last ``=`` separates them so a GLOB may contain ``=``."""
    glob, sep, mult = text.rpartition("=")
    glob, mult = glob.strip(), mult.strip()
    if not sep or not glob or not mult:
        raise WeightDecayConfigError(
            f"{OVERRIDE_FLAG} {text!r}: expected GLOB=MULT, e.g. '*.linear_proj.weight=0.5'"
        )
    try:
        value = float(mult)
    except ValueError:
        raise WeightDecayConfigError(
            f"{OVERRIDE_FLAG} {text!r}: {mult!r} is not a number"
        ) from None
    return Override(glob, check_mult(value, f"{OVERRIDE_FLAG} {text!r}"))


def strip_wrappers(name: str) -> str:
    """The model's own parameter name, without DDP / Float16Module ``module.`` prefixes."""
    return re.sub(r"^(module\.)+", "", name)


@dataclass(frozen=True)
class Decision:
    """The multiplier the flags give a parameter Megatron decays, and which flag decided."""

    mult: float
    source: str


@dataclass(frozen=True)
class WeightDecayPolicy:
    """The three flags plus whether the embedding and the output layer are one parameter."""

    embedding_mult: float | None = None
    output_layer_mult: float | None = None
    overrides: tuple[Override, ...] = ()
    tied: bool = False

    @property
    def active(self) -> bool:
        """Whether any flag is set (otherwise Megatron runs untouched)."""
        return bool(self.overrides) or (self.embedding_mult, self.output_layer_mult) != (None, None)

    def _effective_output_mult(self) -> float | None:
        return None if self.tied else self.output_layer_mult

    def name_seen_by_rules(self, name: str) -> str:
        """The name the rules match: wrappers stripped; a tied output copy is the embedding."""
        name = strip_wrappers(name)
        return EMBEDDING_WEIGHT if self.tied and name == OUTPUT_LAYER_WEIGHT else name

    def resolve(self, name: str) -> Decision:
        """Multiplier for a parameter Megatron decays (precedence: docs/weight-decay.md)."""
        seen = self.name_seen_by_rules(name)
        tied_note = f" (tied copy of {EMBEDDING_WEIGHT})" if seen != strip_wrappers(name) else ""
        for override in reversed(self.overrides):
            if fnmatch.fnmatchcase(seen, override.glob):
                return Decision(override.mult, f"{OVERRIDE_FLAG} {override}{tied_note}")
        if self.embedding_mult is not None and seen.startswith(EMBEDDING_PREFIX):
            return Decision(self.embedding_mult, f"{EMBEDDING_FLAG}{tied_note}")
        output_mult = self._effective_output_mult()
        if output_mult is not None and seen == OUTPUT_LAYER_WEIGHT:
            return Decision(output_mult, OUTPUT_LAYER_FLAG)
        return Decision(1.0, f"default{tied_note}")

    def multipliers(self) -> set[float]:
        """Every multiplier the flags can hand out."""
        roles = (self.embedding_mult, self._effective_output_mult())
        return {o.mult for o in self.overrides} | {m for m in roles if m is not None}

    def warnings(self) -> list[str]:
        """Settings that are legal but do not do what they seem to (tied weights)."""
        if not self.tied:
            return []
        found = []
        embedding = 1.0 if self.embedding_mult is None else self.embedding_mult
        if self.output_layer_mult is not None and self.output_layer_mult != embedding:
            found.append(
                f"{OUTPUT_LAYER_FLAG} {self.output_layer_mult:g} is ignored: the embedding and "
                f"output layer are tied (one parameter, {EMBEDDING_WEIGHT}), which gets "
                f"{EMBEDDING_FLAG} ({embedding:g}). Use --untie-embeddings-and-output-weights "
                "to decay them differently."
            )
        for override in self.overrides:
            if fnmatch.fnmatchcase(OUTPUT_LAYER_WEIGHT, override.glob) and not fnmatch.fnmatchcase(
                EMBEDDING_WEIGHT, override.glob
            ):
                found.append(
                    f"{OVERRIDE_FLAG} {override} matches {OUTPUT_LAYER_WEIGHT}, but with tied "
                    f"embeddings that is the embedding ({EMBEDDING_WEIGHT}) and rules see it "
                    "under that name, so this override does not apply to it."
                )
        return found

    def comparable(self) -> tuple:
        """What must be equal between a checkpoint and its resume: unset == 1.0; an output
        multiplier is irrelevant when tied; override order matters (last match wins)."""
        output = self._effective_output_mult()
        return (
            1.0 if self.embedding_mult is None else self.embedding_mult,
            1.0 if output is None else output,
            self.overrides,
        )

    def describe(self) -> str:
        """The flags as they would be typed."""
        parts = []
        if self.embedding_mult is not None:
            parts.append(f"{EMBEDDING_FLAG} {self.embedding_mult:g}")
        if self.output_layer_mult is not None:
            parts.append(f"{OUTPUT_LAYER_FLAG} {self.output_layer_mult:g}")
        parts += [f"{OVERRIDE_FLAG} '{o}'" for o in self.overrides]
        return " ".join(parts) or "no weight-decay multiplier flags"


def policy_from_values(
    embedding_mult: float | None,
    output_layer_mult: float | None,
    overrides: list[str] | None,
    tied: bool,
) -> WeightDecayPolicy:
    """Validate raw flag values into a policy (raises :class:`WeightDecayConfigError`)."""
    embedding, output = (
        None if mult is None else check_mult(mult, flag)
        for mult, flag in ((embedding_mult, EMBEDDING_FLAG), (output_layer_mult, OUTPUT_LAYER_FLAG))
    )
    overrides_ = tuple(parse_override(text) for text in overrides or ())
    return WeightDecayPolicy(embedding, output, overrides_, tied)


def check_resume(saved: WeightDecayPolicy, current: WeightDecayPolicy, checkpoint: str) -> None:
    """Refuse a resume whose multipliers differ from those the checkpoint trained with."""
    if saved.comparable() == current.comparable():
        return
    raise WeightDecayResumeError(
        f"megatron-ext: the checkpoint {checkpoint} was trained with {saved.describe()}, but "
        f"this run sets {current.describe()}. Megatron matches the checkpoint's optimizer "
        "param groups to this run's by their settings (wd_mult ...), not by the parameters "
        "in them, so a different grouping would fail during the load or continue silently "
        "under other multipliers. Resume with the checkpoint's flags, or pass "
        "--no-load-optim to start a fresh optimizer state under the new ones."
    )


@dataclass
class GlobUsage:
    """Across all ranks: how many parameters each override's GLOB matched and decided."""

    matched: list[int]
    decided: list[int]

    @classmethod
    def empty(cls, policy: WeightDecayPolicy) -> GlobUsage:
        """No parameter seen yet."""
        return cls([0] * len(policy.overrides), [0] * len(policy.overrides))

    def count(self, policy: WeightDecayPolicy, name: str, decided_by_flags: bool) -> None:
        """Record one parameter; ``decided_by_flags`` is False when Megatron's rule won."""
        seen = policy.name_seen_by_rules(name)
        winner = None
        for index, override in enumerate(policy.overrides):
            if fnmatch.fnmatchcase(seen, override.glob):
                self.matched[index] += 1
                winner = index
        if winner is not None and decided_by_flags:
            self.decided[winner] += 1

    def add(self, other: GlobUsage) -> None:
        """Sum another rank's (pipeline stage's) counts into these."""
        self.matched = [a + b for a, b in zip(self.matched, other.matched)]
        self.decided = [a + b for a, b in zip(self.decided, other.decided)]

    def problems(self, policy: WeightDecayPolicy) -> tuple[list[str], list[str]]:
        """(errors, warnings): a GLOB matching nothing is an error, deciding nothing a warning."""
        errors, warnings = [], []
        for override, matched, decided in zip(policy.overrides, self.matched, self.decided):
            if not matched:
                errors.append(
                    f"{OVERRIDE_FLAG} '{override}' matches no parameter (names as "
                    "in the map above; wrapper 'module.' prefixes are not part of them)"
                )
            elif not decided:
                warnings.append(
                    f"{OVERRIDE_FLAG} '{override}' decides no parameter: its {matched} matches "
                    "are 1-D/bias parameters Megatron never decays, or a later override wins"
                )
        return errors, warnings
