"""The generate flags as one ``GenerateRequest``, checked before any model loads.

The same message goes to a gateway or, in process, through the gateway's own conversion, so
both paths share one set of rules and defaults. It carries only what the user set: whatever
is left unset takes the server's default (in process: the settings, flags and ``DIFFSPEC_*``).
"""

from __future__ import annotations

import argparse
import math

from diffspec.errors import InvalidRequest
from diffspec.v1 import gateway_pb2
from draft_service.tree_budget import TreeBudget, TreePolicy

REQUEST_FIELDS = ("policy", "tree_config", "salience", "max_new_tokens")  # settings fields a request may override


def temperature(text: str) -> float:
    """argparse type: a finite temperature >= 0."""
    value = float(text)
    if not 0.0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"must be finite and >= 0, got {text}")
    return value


def top_p(text: str) -> float:
    """argparse type: a nucleus mass in (0, 1]."""
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return args.prompt
    try:
        return args.prompt_file.read_text()
    except (OSError, UnicodeDecodeError) as bad:
        raise InvalidRequest(f"cannot read --prompt-file: {bad}") from None


def request_from_flags(args: argparse.Namespace, text: str) -> gateway_pb2.GenerateRequest:
    """The request the flags describe; raises InvalidRequest for an empty prompt, a bad policy or tree config."""
    if not text:
        raise InvalidRequest("the prompt is empty")  # the gateway's rule, found before anything loads
    message = gateway_pb2.GenerateRequest(text=text, temperature=args.temperature, stop=args.stop)
    for name in (*REQUEST_FIELDS, "top_p", "seed"):
        if getattr(args, name) is not None:
            setattr(message, name, getattr(args, name))
    check_draft_fields(message.policy, message.tree_config)
    return message


def check_draft_fields(policy: str, tree_config: str) -> None:
    """A policy and tree config are checked whenever they are given, Auto or not ("" = not given)."""
    if policy and policy != "auto":
        TreePolicy.parse(policy)
    if tree_config:
        TreeBudget.parse(tree_config)
