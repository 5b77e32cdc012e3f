"""Per-parameter weight-decay multipliers: which parameter decays how much, and why.

Flags (adapter: :mod:`megatron_ext.weight_decay.adapter`)::

    --embedding-weight-decay-mult M       input embedding (OLMo 2 trains embeddings with M=0)
    --output-layer-weight-decay-mult M    untied output layer
    --weight-decay-override GLOB=M        any parameter by name; repeatable

A parameter's decoupled decay per step is ``lr * weight_decay * wd_mult * param`` (AdamW; SGD
adds ``weight_decay * wd_mult * param`` to the gradient). The multipliers reach Megatron as
``config_overrides`` (``ParamKey`` → ``ParamGroupOverride(wd_mult=M)``) where
``get_megatron_optimizer_config`` builds them, so every parameter with the same multiplier
lands in one optimizer param group and Megatron's scheduler applies it.

Precedence, first that applies wins:

1. Megatron's own multipliers. Megatron gives ``wd_mult=0`` to 1-D parameters (norms) and
   biases (``--apply-wd-to-qk-layernorm`` exempts q/k layernorms from that rule). Those
   parameters keep Megatron's value whatever the flags say: the flags only change parameters
   Megatron decays.
2. The **last** ``--weight-decay-override`` whose GLOB matches (command-line order, so a later
   flag refines an earlier, broader one).
3. ``--embedding-weight-decay-mult`` for every parameter of the input embedding module
   (``embedding.*``: word embeddings and, with learned absolute positions,
   ``embedding.position_embeddings.weight``); ``--output-layer-weight-decay-mult`` for
   ``output_layer.weight``. Globs win over these because a name is more specific than a role.
4. ``1.0``.

Names. GLOBs are ``fnmatch`` patterns matched against the model's parameter names with
Megatron's wrapper prefixes (``module.``, from DDP and the fp16/bf16 wrapper) removed, e.g.
``decoder.layers.0.self_attention.linear_qkv.weight``. Layer indices are those of
``named_parameters()``, i.e. local to a pipeline stage and virtual chunk; the start-up map
prints every name with its stage. A GLOB that matches no parameter on any rank is an error
(a typo would otherwise train silently with the default); one that matches but decides no
parameter (all matches exempt or overridden by a later flag) is reported as a warning.

Tied embeddings (Megatron's default; ``--untie-embeddings-and-output-weights`` unties them).
The embedding and the output layer are one parameter, ``embedding.word_embeddings.weight``;
``--embedding-weight-decay-mult`` applies to it and ``--output-layer-weight-decay-mult`` is
ignored, with a warning when it differs from the embedding's multiplier.

Pipeline parallelism. With tied weights and more than one stage, the last stage holds a copy
of the embedding as ``output_layer.weight`` whose gradient is all-reduced with the first
stage's. The copy is resolved under the embedding's name, so both copies always get the same
multiplier and stay identical (a GLOB naming ``output_layer.weight`` does not split them; it
is reported). Untied, ``output_layer.weight`` is its own parameter on the last stage.

Multi-token prediction. The MTP stage's embedding copy is named
``embedding.word_embeddings.weight`` like the original and gets the same multiplier, so the
copies stay in sync. MTP's own layers (``mtp.layers.*``) are ordinary weights (GLOBs apply).

Resume. The flags are saved with the checkpoint (Megatron stores the whole argument namespace
in it). Resuming with different effective flags (including dropping them) is refused with a
message that lists both settings, because Megatron pairs saved and current optimizer param
groups by their settings (``wd_mult`` ...), not by which parameters they hold, so a changed
grouping either fails deep inside the load or silently keeps training under other multipliers.
``--no-load-optim`` and ``--finetune`` start a fresh optimizer and are not checked.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field

from megatron_ext.common.errors import Refusal

EMBEDDING_PREFIX = "embedding."
EMBEDDING_WEIGHT = "embedding.word_embeddings.weight"
OUTPUT_LAYER_WEIGHT = "output_layer.weight"
_WRAPPER_PREFIX = "module."

EMBEDDING_FLAG = "--embedding-weight-decay-mult"
OUTPUT_LAYER_FLAG = "--output-layer-weight-decay-mult"
OVERRIDE_FLAG = "--weight-decay-override"


class WeightDecayConfigError(Refusal, ValueError):
    """The weight-decay flags are malformed or cannot mean what the user wrote."""


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
    while name.startswith(_WRAPPER_PREFIX):
        name = name[len(_WRAPPER_PREFIX) :]
    return name


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
    overrides: tuple[Override, ...] = field(default=())
    tied: bool = False

    @property
    def active(self) -> bool:
        """Whether any flag is set (otherwise Megatron runs untouched)."""
        return (
            self.embedding_mult is not None
            or self.output_layer_mult is not None
            or bool(self.overrides)
        )

    def _effective_output_mult(self) -> float | None:
        return None if self.tied else self.output_layer_mult

    def name_seen_by_rules(self, name: str) -> str:
        """The name the rules match: wrappers stripped; a tied output copy is the embedding."""
        name = strip_wrappers(name)
        return EMBEDDING_WEIGHT if self.tied and name == OUTPUT_LAYER_WEIGHT else name

    def resolve(self, name: str) -> Decision:
        """Multiplier for a parameter Megatron decays (precedence in the module docstring)."""
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
        found = {o.mult for o in self.overrides}
        for mult in (self.embedding_mult, self._effective_output_mult()):
            if mult is not None:
                found.add(mult)
        return found

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

        def norm(mult: float | None) -> float:
            return 1.0 if mult is None else mult

        output = 1.0 if self.tied else norm(self.output_layer_mult)
        return norm(self.embedding_mult), output, self.overrides

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
    return WeightDecayPolicy(
        embedding_mult=None
        if embedding_mult is None
        else check_mult(embedding_mult, EMBEDDING_FLAG),
        output_layer_mult=None
        if output_layer_mult is None
        else check_mult(output_layer_mult, OUTPUT_LAYER_FLAG),
        overrides=tuple(parse_override(text) for text in overrides or ()),
        tied=tied,
    )


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
