"""Derive argparse flags from a pydantic model, so the CLI never keeps a second list by hand.

Every field becomes ``--field-name`` with the field's description as help. Only flags the
user gave are passed to the model, so environment variables (``DIFFSPEC_*``) still apply
to everything else.
"""

from __future__ import annotations

import argparse
import types
import typing
from pathlib import Path
from typing import Any, Iterable, TypeVar

from pydantic import BaseModel, ValidationError

from diffspec.errors import InvalidRequest

Model = TypeVar("Model", bound=BaseModel)

_TRUE = {"1", "true", "on", "yes"}
_FALSE = {"0", "false", "off", "no"}


def parse_switch(text: str) -> bool:
    """on/off, true/false, yes/no, 1/0."""
    lowered = text.lower()
    if lowered in _TRUE | _FALSE:
        return lowered in _TRUE
    raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")


def flag_name(field: str) -> str:
    return f"--{field.replace('_', '-')}"


def _flag_type(annotation: Any) -> dict[str, Any]:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):  # an optional X is typed as X: unset is the default
        kinds = [kind for kind in typing.get_args(annotation) if kind is not type(None)]
        return _flag_type(kinds[0]) if len(kinds) == 1 else {"type": str}
    if origin is typing.Literal:
        return {"choices": [str(c) for c in typing.get_args(annotation)]}
    if origin is list:  # --stop a b and --stop a --stop b alike
        return {"nargs": "+", "action": "extend", **_flag_type(typing.get_args(annotation)[0])}
    if annotation is bool:
        return {"type": parse_switch, "metavar": "on|off"}
    if annotation in (int, float, Path, str):
        return {"type": annotation}
    return {"type": str}


def _shown(value: Any) -> str:
    """A default as the user would type it: on|off for switches, space-separated lists."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return " ".join(str(v) for v in value) or "none"
    return str(value)


def add_model_flags(
    parser: argparse.ArgumentParser, model: type[BaseModel], fields: Iterable[str], title: str
) -> None:
    """One ``--flag`` per named field of ``model``, in a help group of its own (defaults stay in the model)."""
    group = parser.add_argument_group(title)
    for name in fields:
        field = model.model_fields[name]
        required = field.is_required()
        default = "required" if required else f"default: {_shown(field.get_default(call_default_factory=True))}"
        group.add_argument(
            flag_name(name),
            dest=name,
            default=None,
            required=required,
            help=f"{field.description or ''} ({default})",
            **_flag_type(field.annotation),
        )


def model_from_flags(model: type[Model], args: argparse.Namespace) -> Model:
    """Build ``model`` from the flags that were given; bad values -> InvalidRequest naming the flag."""
    given = {name: getattr(args, name) for name in model.model_fields if getattr(args, name, None) is not None}
    try:
        return model(**given)
    except ValidationError as bad:
        raise InvalidRequest(validation_message(bad, model.model_config.get("env_prefix", ""))) from None


def validation_message(bad: ValidationError, env_prefix: str = "") -> str:
    """pydantic's errors as ``--flag: what is wrong``, one per field, without pydantic's URLs."""
    lines = []
    for error in bad.errors(include_url=False):
        name = str(error["loc"][0]) if error["loc"] else ""
        where = flag_name(name) if name else "settings"
        if name and env_prefix:
            where += f" (or {env_prefix}{name.upper()})"
        lines.append(f"{where}: {error['msg']}")
    return "; ".join(lines)
