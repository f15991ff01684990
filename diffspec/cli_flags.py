"""Derive argparse flags from a pydantic model, so the CLI never keeps a second list by hand.

Every field becomes ``--field-name`` with the field's description as help. Only flags the
user gave are passed to the model, so environment variables (``DIFFSPEC_*``) still apply
to everything else.
"""

from __future__ import annotations

import argparse
import typing
from pathlib import Path
from typing import Any, TypeVar

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
    raise argparse.ArgumentTypeError(f"expected on/off, got {text!r}")


def _flag_type(annotation: Any) -> dict[str, Any]:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return {"choices": [str(c) for c in typing.get_args(annotation)]}
    if origin is list:
        return {"nargs": "+", **_flag_type(typing.get_args(annotation)[0])}
    if annotation is bool:
        return {"type": parse_switch, "metavar": "on|off"}
    if annotation in (int, float, Path, str):
        return {"type": annotation}
    return {"type": str}


def add_model_flags(parser: argparse.ArgumentParser, model: type[BaseModel], skip: set[str] = frozenset()) -> None:
    """One ``--flag`` per field of ``model`` (defaults stay in the model)."""
    group = parser.add_argument_group(model.__name__)
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        group.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            default=None,
            help=f"{field.description or ''} (default: {field.get_default(call_default_factory=True)})",
            **_flag_type(field.annotation),
        )


def model_from_flags(model: type[Model], args: argparse.Namespace, **overrides: Any) -> Model:
    """Build ``model`` from the flags that were given (plus overrides); bad values -> InvalidRequest."""
    given = {name: getattr(args, name) for name in model.model_fields if getattr(args, name, None) is not None}
    try:
        return model(**{**given, **overrides})
    except ValidationError as bad:
        raise InvalidRequest(f"invalid setting: {bad}") from None
