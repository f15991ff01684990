"""The generate flags as one ``GenerateRequest``, checked before any model loads.

The same message goes to a gateway or, in process, through the gateway's own conversion, so
both paths share one set of rules and defaults. It carries only what the user set: whatever
is left unset takes the server's default (in process: the settings, flags and ``DIFFSPEC_*``).
The sampling flags derive from ``SamplingFlags``, and the Python client's ``generate_request``
builds the message, so the CLI and ``diffspec.client`` name every field alike.
"""

from __future__ import annotations

import argparse

from pydantic import BaseModel, ConfigDict, Field

from cli.flags import model_from_flags
from diffspec.errors import InvalidRequest
from diffspec.sampling_params import MAX_LOGPROBS
from diffspec.v1 import gateway_pb2
from draft_service.tree_budget import TreeBudget, TreePolicy

REQUEST_FIELDS = ("policy", "tree_config", "salience", "max_new_tokens")  # settings fields a request may override
INT64 = 2**63


class SamplingFlags(BaseModel):
    """How ``diffspec generate`` samples: each field is a flag and the ``GenerateRequest`` field of its name.
    The defaults are the server's, shown in the help; only the flags given are sent, so temperature, top-p
    and top-k left unset take the checkpoint's generation_config.json values where the server reads them."""

    model_config = ConfigDict(extra="forbid")

    temperature: float | None = Field(None, ge=0, allow_inf_nan=False, description="0 = greedy; unset = the "
                                      "checkpoint's generation_config.json value, else 0")  # fmt: skip
    top_p: float | None = Field(None, gt=0, le=1, description="nucleus mass kept, after top-k; unset = the "
                                "checkpoint's, else 1")  # fmt: skip
    top_k: int | None = Field(None, ge=0, lt=2**31, description="most likely tokens kept before top-p; 0 = all; "
                              "unset = the checkpoint's, else 0")  # fmt: skip
    seed: int | None = Field(None, ge=-INT64, lt=INT64, description="fixes the sampling stream (sample i of n "
                             "derives its own from it)")  # fmt: skip
    stop: list[str] = Field(default_factory=list, description="stop sequences")
    stop_token_ids: list[int] = Field(default_factory=list, description="token ids that end a sample, unemitted")
    n: int = Field(1, ge=1, lt=2**31, description="independent samples of the prompt")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="report each token's logprob and this "
                                 "many most likely alternatives (in --json)")  # fmt: skip


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return args.prompt
    try:
        return args.prompt_file.read_text()
    except (OSError, UnicodeDecodeError) as bad:
        raise InvalidRequest(f"cannot read --prompt-file: {bad}") from None


def request_from_flags(args: argparse.Namespace, text: str) -> gateway_pb2.GenerateRequest:
    """The request the flags describe; raises InvalidRequest for an empty prompt, a bad sampling value, a
    bad policy or tree config."""
    if not text:
        raise InvalidRequest("the prompt is empty")  # the gateway's rule, found before anything loads
    sampling = model_from_flags(SamplingFlags, args)
    given = {name: getattr(args, name) for name in REQUEST_FIELDS if getattr(args, name) is not None}
    from diffspec.client import generate_request  # the gRPC stubs: not for the commands that only train

    message = generate_request(text, **sampling.model_dump(include=sampling.model_fields_set), **given)
    check_draft_fields(message.policy, message.tree_config)
    return message


def check_draft_fields(policy: str, tree_config: str) -> None:
    """A policy and tree config are checked whenever they are given, Auto or not ("" = not given)."""
    if policy and policy != "auto":
        TreePolicy.parse(policy)
    if tree_config:
        TreeBudget.parse(tree_config)
