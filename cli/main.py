"""``diffspec``: generate, serve and train-draft; flags derive from the settings models.

Help, argument errors and the checks that need no model import neither torch nor the
services: each command's own module is imported only once its arguments are known good.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import sys
from pathlib import Path

from cli import request
from cli.flags import add_model_flags, flag_name, model_from_flags
from diffspec.errors import DiffSpecError
from diffspec.settings import DiffSpecSettings

SERVE_ROLES = ("all", "target", "draft", "gateway")  # all = the three in one process, on one port
SERVER_FIELDS = (  # settings only a server reads: generate has no flag for them
    "listen",
    "target_address",
    "draft_address",
    "max_message_bytes",
    "max_sessions",
    "client_max_requests",
    "client_max_tokens",
    "metrics_port",
    "keepalive_seconds",
    "keepalive_timeout_seconds",
    "shutdown_grace_seconds",
    "peer_wait_seconds",
    "step_timeout_seconds",
    "http_listen",
    "tokenize_threads",
    "max_tokenizations",
    "tls_client_ca",
)
CONNECTION_FIELDS = ("tls_ca", "tls_cert", "tls_key", "auth_token")  # how generate reaches a gateway, or none
INTERRUPTED = 130  # the shell's code for a command ended by SIGINT


def model_fields() -> list[str]:
    """The settings fields that configure the models of an in-process generate."""
    skip = {*SERVER_FIELDS, *request.REQUEST_FIELDS}
    return [name for name in DiffSpecSettings.model_fields if name not in skip]


def _generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate a continuation, streaming it to the terminal")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--in-process", action="store_true", help="load target and draft in this process (default)")
    where.add_argument("--gateway", metavar="HOST:PORT", help="call a running gateway instead")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-file", type=Path, help="file holding the prompt text")
    output = p.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="one JSON object per chunk, the last with all stats")
    output.add_argument("--vs-auto", action="store_true", help="run the request with Auto too; print the speedup")
    add_model_flags(p, request.SamplingFlags, request.SamplingFlags.model_fields, "sampling (unset: the server's defaults)")
    add_model_flags(p, DiffSpecSettings, request.REQUEST_FIELDS, "request (unset: the server's defaults)")
    add_model_flags(p, DiffSpecSettings, model_fields(), "in-process models (DIFFSPEC_* env works too)")


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the gRPC services (default: all in one process)")
    p.add_argument("role", nargs="?", default="all", choices=SERVE_ROLES)
    p.add_argument("--target", dest="target_address", default=None, help="target service host:port")
    p.add_argument("--draft", dest="draft_address", default=None, help="draft service host:port")
    fields = [name for name in DiffSpecSettings.model_fields if name not in ("target_address", "draft_address")]
    add_model_flags(p, DiffSpecSettings, fields, "settings (DIFFSPEC_* env works too)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diffspec", description=__doc__.split("\n")[0])
    parser.add_argument("--log-level", default="WARNING", help="python logging level (default: WARNING)")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _serve_parser(sub)
    # its flags come from TrainConfig: _train_draft parses the arguments this parser leaves
    sub.add_parser("train-draft", add_help=False, help="train an EAGLE-3 head for a target on a text/code corpus")
    return parser


def _train_draft(rest: list[str]) -> int:
    from draft_service.train_config import TrainConfig

    parser = argparse.ArgumentParser(prog="diffspec train-draft", description="Train an EAGLE-3 head.")
    add_model_flags(parser, TrainConfig, TrainConfig.model_fields, "training")
    config = model_from_flags(TrainConfig, parser.parse_args(rest))
    from draft_service.trainer import train_draft  # torch: only once the arguments are known good

    summary = train_draft(config)
    print(json.dumps(dataclasses.asdict(summary)))
    return 0


def _run(args: argparse.Namespace, rest: list[str]) -> int:
    if args.command == "train-draft":
        return _train_draft(rest)
    settings = model_from_flags(DiffSpecSettings, args)
    if args.command == "generate":
        from cli.generate import run_generate

        given = [
            flag_name(name)
            for name in model_fields()
            if getattr(args, name) is not None and name not in CONNECTION_FIELDS
        ]
        return asyncio.run(run_generate(args, settings, given))
    from cli.serve import run_serve

    return run_serve(args.role, settings)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "train-draft":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return _run(args, rest)
    except DiffSpecError as failure:
        print(f"diffspec: error: {failure}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ndiffspec: interrupted", file=sys.stderr)
        return INTERRUPTED
