"""``diffspec``: generate, serve and train-draft; flags derive from the settings models."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import sys
from pathlib import Path

from diffspec.cli_flags import add_model_flags, model_from_flags
from diffspec.errors import DiffSpecError
from diffspec.settings import DiffSpecSettings

SERVE_ROLES = ("all", "target", "draft", "gateway")  # all = the three in one process, on one port


def _generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate a continuation, streaming it to the terminal")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--in-process", action="store_true", help="run target and draft in this process (default)")
    where.add_argument("--gateway", metavar="HOST:PORT", help="call a running gateway instead")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-file", type=Path, help="file holding the prompt text")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass kept")
    p.add_argument("--seed", type=int, default=None, help="fixes the sampling stream")
    p.add_argument("--stop", action="append", default=[], help="stop sequence (repeatable)")
    p.add_argument("--config", dest="tree_config", default=None, help="tree budget total_tokens:threshold:depth")
    p.add_argument("--json", action="store_true", help="print one JSON object per chunk, the last with stats")
    add_model_flags(p, DiffSpecSettings, skip={"tree_config"})


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the gRPC services (default: all in one process)")
    p.add_argument("role", nargs="?", default="all", choices=SERVE_ROLES)
    p.add_argument("--target", dest="target_address", default=None, help="target service host:port")
    p.add_argument("--draft", dest="draft_address", default=None, help="draft service host:port")
    add_model_flags(p, DiffSpecSettings, skip={"target_address", "draft_address"})


def _train_parser(sub: argparse._SubParsersAction) -> None:
    from draft_service.trainer import TrainConfig

    p = sub.add_parser("train-draft", help="train an EAGLE-3 head for a target on a text/code corpus")
    add_model_flags(p, TrainConfig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="diffspec", description=__doc__)
    parser.add_argument("--log-level", default="WARNING", help="python logging level")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _serve_parser(sub)
    _train_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "generate":
            from diffspec.cli_generate import run_generate

            return asyncio.run(run_generate(args, model_from_flags(DiffSpecSettings, args)))
        if args.command == "serve":
            from diffspec.cli_serve import run_serve

            return run_serve(args.role, model_from_flags(DiffSpecSettings, args))
        from draft_service.trainer import TrainConfig, train_draft

        summary = train_draft(model_from_flags(TrainConfig, args))
        print(json.dumps(dataclasses.asdict(summary)))
        return 0
    except DiffSpecError as failure:
        print(f"diffspec: error: {failure}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
