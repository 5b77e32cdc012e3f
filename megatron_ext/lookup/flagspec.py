"""Megatron's training-flag parser as data, so the lookup parses a run's flags in milliseconds.

``add_megatron_arguments`` lives in ``megatron/training/arguments.py``, whose imports pull in
megatron-core, torch's compiler stack and Transformer Engine probing (~5 s) only to *define*
~800 flags. The lookup needs those flags to mean exactly what they meant to the training job,
so it does not keep its own list: ``megatron_flags/<version>.json`` next to this module, one
per verified megatron-core (the parsers differ: 704 flags on 0.17.1, 750 on 0.18.2, 806 on
0.19.x), is generated from that version's own parser (``python -m megatron_ext.lookup.flagspec``
run under it), and a unit test in every CI tier checks that the installed version's spec still
equals its parser, action by action.

:func:`parse` rebuilds an argparse parser from the installed version's spec and parses with
it. It hands the whole job back to Megatron's parser (exact, slow) when no spec was generated
for the installed megatron-core, or when the command line uses one of the few flags whose
value Megatron converts with its own code (``--attention-backend``, ``--moe-layer-freq``, ...).
Defaults that are Megatron objects (``AttnBackend.auto``) become inert stand-ins
(:func:`~megatron_ext.common.checkpoint_state.stand_in`); the lookup never reads them.
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import json
import sys
from pathlib import Path
from typing import Any

from megatron_ext.common import versions
from megatron_ext.common.checkpoint_state import stand_in

SPEC_DIR = Path(__file__).with_name("megatron_flags")
_TYPES: dict[str, Any] = {"int": int, "float": float, "str": str, "bool": bool, None: None}
_ACTIONS = {
    "_StoreAction": "store",
    "_StoreTrueAction": "store_true",
    "_StoreFalseAction": "store_false",
    "BooleanOptionalAction": "boolean_optional",
}


class NeedsMegatron(Exception):
    """The command line uses a flag whose value only Megatron's own code can convert.

    An internal control-flow signal (the caller falls back to Megatron's parser), not a
    refusal, so it is no :class:`~megatron_ext.common.errors.MegatronExtError`."""


def _plain(value: Any) -> bool:
    """JSON keeps it exactly: None, bool, int, float, str and lists of them (not an IntEnum,
    which JSON would silently turn into its int)."""
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    return value is None or type(value) in (bool, int, float, str)


def _json_value(value: Any) -> tuple[bool, Any]:
    """(survives a JSON round trip unchanged, value)."""
    return _plain(value) and json.loads(json.dumps(value)) == value, value


def describe(parser: argparse.ArgumentParser) -> list[dict[str, Any]]:
    """Every flag of ``parser`` as JSON-able data (what the spec file stores)."""
    spec = []
    for action in parser._actions:  # argparse has no public accessor for its actions
        if isinstance(action, argparse._HelpAction):
            continue
        kind = _ACTIONS.get(type(action).__name__)
        if kind is None:
            raise ValueError(f"{action.option_strings}: unsupported action {type(action)}")
        type_name = next((k for k, v in _TYPES.items() if v is action.type), "megatron")
        has_default, default = _json_value(action.default)
        has_choices, choices = _json_value(list(action.choices) if action.choices else None)
        spec.append(
            {
                "flags": list(action.option_strings),
                "dest": action.dest,
                "action": kind,
                "nargs": action.nargs if kind == "store" else None,
                "type": type_name if kind == "store" else None,
                "default": default if has_default else {"megatron": repr(action.default)},
                "choices": choices if has_choices else {"megatron": repr(action.choices)},
            }
        )
    return spec


def megatron_parser() -> argparse.ArgumentParser:
    """Megatron's own parser (imports megatron.training: seconds)."""
    from megatron.training.arguments import add_megatron_arguments

    return add_megatron_arguments(
        argparse.ArgumentParser(prog="megatron flags", allow_abbrev=False)
    )


def _needs_megatron(flag: str) -> Any:
    def convert(value: str) -> Any:
        raise NeedsMegatron(f"{flag} {value}")

    return convert


def _add(parser: argparse.ArgumentParser, entry: dict[str, Any]) -> None:
    kind, flags = entry["action"], entry["flags"]
    default = entry["default"]
    opaque_default = isinstance(default, dict) and "megatron" in default
    kwargs: dict[str, Any] = {"dest": entry["dest"]}
    if kind == "store":
        delegated = entry["type"] == "megatron" or isinstance(entry["choices"], dict)
        kwargs.update(nargs=entry["nargs"], choices=None if delegated else entry["choices"])
        kwargs["type"] = _needs_megatron(flags[0]) if delegated else _TYPES[entry["type"]]
        kwargs["default"] = argparse.SUPPRESS if delegated or opaque_default else default
        parser.add_argument(*flags, **kwargs)
    elif kind == "boolean_optional":  # argparse adds the --no- spelling itself
        positive = [f for f in flags if not f.startswith("--no-")]
        parser.add_argument(
            *positive, action=argparse.BooleanOptionalAction, **kwargs, default=default
        )
    else:
        parser.add_argument(*flags, action=kind, default=default, **kwargs)


installed_version = versions.installed


def spec_file(version: str) -> Path:
    """Where the spec generated from ``version``'s parser is shipped."""
    return SPEC_DIR / f"{version}.json"


def shipped_versions() -> list[str]:
    """The megatron-core versions a spec is shipped for."""
    return sorted(p.stem for p in SPEC_DIR.glob("*.json"))


def _spec() -> list[dict[str, Any]] | None:
    """The installed megatron-core's shipped spec, or None when none describes it."""
    installed = installed_version()
    if installed is None:
        return None
    try:
        stored = json.loads(spec_file(installed).read_text())
    except (OSError, ValueError):
        return None
    return stored["actions"] if stored.get("megatron_core") == installed else None


def light_parser(spec: list[dict[str, Any]]) -> argparse.ArgumentParser:
    """An argparse parser with exactly the spec's flags, types, defaults and choices."""
    parser = argparse.ArgumentParser(prog="megatron flags", allow_abbrev=False)
    for entry in spec:
        _add(parser, entry)
    return parser


def parse(argv: list[str], namespace: argparse.Namespace) -> tuple[argparse.Namespace, list[str]]:
    """``parse_known_args`` of Megatron's parser over ``namespace`` (values there win over
    defaults, as argparse does), from the spec when possible."""
    spec = _spec()
    if spec is not None:
        try:
            # On a copy: a NeedsMegatron midway leaves the namespace half-filled with
            # defaults, which Megatron's parser would then take as given values.
            parsed, unknown = light_parser(spec).parse_known_args(
                argv, namespace=copy.deepcopy(namespace)
            )
        except NeedsMegatron:
            pass
        else:
            for entry in spec:
                if not hasattr(parsed, entry["dest"]):
                    default = entry["default"]
                    opaque = isinstance(default, dict) and "megatron" in default
                    value = stand_in("megatron default")(default["megatron"]) if opaque else default
                    setattr(parsed, entry["dest"], value)
            return parsed, unknown
    return megatron_parser().parse_known_args(argv, namespace=namespace)


def generate() -> dict[str, Any]:
    """The spec of the installed megatron-core's parser (what its ``megatron_flags/`` file
    holds)."""
    return {
        "megatron_core": importlib.metadata.version("megatron-core"),
        "generated_by": "python -m megatron_ext.lookup.flagspec",
        "actions": describe(megatron_parser()),
    }


def dump(spec: dict[str, Any]) -> str:
    """One action per line, so a megatron-core upgrade shows as a readable diff."""
    head = {k: v for k, v in spec.items() if k != "actions"}
    lines = [json.dumps(a, sort_keys=True) for a in spec["actions"]]
    body = ",\n".join(lines)
    return json.dumps(head, sort_keys=True)[:-1] + ', "actions": [\n' + body + "\n]}\n"


if __name__ == "__main__":
    # Run once under each verified megatron-core (a venv of it, from the repository root:
    # `PYTHONPATH=. <venv>/bin/python -m megatron_ext.lookup.flagspec`).
    generated = generate()
    target = spec_file(generated["megatron_core"])
    target.write_text(dump(generated))
    print(f"wrote {target}", file=sys.stderr)
