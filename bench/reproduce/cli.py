"""Flags of ``python -m bench.reproduce``; each one left out keeps the preset's value."""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields, replace
from pathlib import Path

from bench.reproduce import profiling
from bench.reproduce.arms import baseline_arms
from bench.reproduce.presets import PRESETS, ProtocolConfig, parse_tune_prompts_at
from cli.flags import parse_switch
from diffspec.errors import InvalidRequest
from draft_service.options import DraftOptions, validate_options

EPILOG = """presets:
  smoke   one long-context case, a short tuning pass, a short paired evaluation (CPU CI, 1-minute GPU check)
  full    4K/16K/32K/64K/128K (where the prompts allow), 8 prompts per length, every arm
  custom  the smoke defaults with every flag passed through

models default to the settings: DIFFSPEC_BASE_MODEL=/path/to/Llama-3.1-8B-Instruct
DIFFSPEC_DRAFT_MODEL=/path/to/EAGLE3-LLaMA3.1-Instruct-8B python -m bench.reproduce --preset full
"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.reproduce", description=__doc__, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", required=True, choices=list(PRESETS))
    p.add_argument("--base-model", type=Path, help="target checkpoint directory (default: the settings')")
    p.add_argument("--draft-model", type=Path, help="EAGLE-3 head directory (default: the settings')")
    p.add_argument("--data-files", type=Path, nargs="+", help="JSONL with a 'text' field per line, or plain text files")
    p.add_argument("--context-targets", type=int, nargs="+", help="prompt tokens per evaluated context")
    p.add_argument("--candidate-configs", nargs="+", help="DiffSpec tree budgets to tune over, total:threshold:depth")
    p.add_argument("--policies", nargs="+", help="DiffSpec tree policies to tune over (chain, uniform<K>, full, online)")
    p.add_argument("--salience-candidates", nargs="+", type=parse_switch, metavar="{on,off}",
                   help="DiffSpec working set settings to tune over: on (the salience working set), off (the whole context)")
    p.add_argument("--tune-max-new-tokens", type=int, help="tokens per tuning run")
    p.add_argument("--eval-max-new-tokens", type=int, help="tokens per evaluation run")
    p.add_argument("--prompts", type=int, help="evaluation prompts per context")
    p.add_argument("--tune-prompts", type=int, help="tuning prompts per context (after the evaluation prompts)")
    p.add_argument("--tune-prompts-at", nargs="+", metavar="CONTEXT=N",
                   help="tuning prompts at a context instead of --tune-prompts, e.g. 4096=8 16384=8 (short "
                   "contexts' runs are cheap; more prompts rank the candidates closer)")
    p.add_argument("--tune-finalists", type=int, help="best candidates of the tuning pass that run again on every "
                   "tuning prompt with --eval-max-new-tokens; the fastest of them is evaluated (0: no final round)")
    p.add_argument("--temperature", type=float, help="0 = greedy; above it every arm samples with --seed, is "
                   "compared with Auto's tokens and judged by the sampled near-tie rule, and the greedy transformers "
                   "reference does not run")
    p.add_argument("--seed", type=int, help="sampling seed, the same for every arm of a prompt")
    p.add_argument("--baseline-arms", nargs="+", choices=list(baseline_arms()), help="arms beside DiffSpec tuned")
    p.add_argument("--baseline-config", help="tree budget of the EAGLE-3 baseline arms")
    p.add_argument("--warmup-tokens", type=int, help="untimed tokens per arm and context before timing")
    p.add_argument("--reference-prompts", type=int, help="evaluated prompts of the shortest context that "
                   "transformers generate (greedy, serving dtype) also runs, beside Auto (0: none)")
    p.add_argument("--inflate-8b", action="store_true", default=None,
                   help="build the 8B-shaped pair from the models with SHARED_DIR/tools/inflate.py and run on it")
    p.add_argument("--shared-dir", type=Path, help="the shared folder: default data files and tools/inflate.py")
    p.add_argument("--out-dir", type=Path, help="write here instead of results/<preset>_<timestamp>/")
    p.add_argument("--resume", action="store_true", default=None, help="continue the run in --out-dir: its "
                   "finished runs are reused, the rest are generated (the same flags as that run)")
    p.add_argument("--nsys", action="store_true", help="profile with Nsight Systems: one report spanning "
                   "the first evaluated prompt's arms at the first context (needs nsys on PATH)")
    p.add_argument("--fp32-attention-backend", choices=["auto", "triton", "torch"],
                   help="attention of the exactness rule's fp32 runs (default: the serving settings'); a judging cost only")
    p.add_argument("--judge-minutes", type=float, help="judging time after which divergences not yet judged are "
                   "left unchecked and the report is written (--resume judges them later; default: no limit)")
    p.add_argument("--same-prompts", type=parse_switch, metavar="{on,off}", help="on: every context takes the "
                   "prompts long enough for the longest context, so ratios across contexts compare the same texts "
                   "(full's default); off: each context the first prompts that fill it")
    p.add_argument("--profile-window", action="store_true", default=None, help=argparse.SUPPRESS)  # set by --nsys
    return p


def config_from(args: argparse.Namespace) -> ProtocolConfig:
    """The preset with every flag given replacing its field."""
    given = {f.name: getattr(args, f.name) for f in fields(ProtocolConfig)
             if f.name != "preset" and getattr(args, f.name, None) is not None}
    given = {name: tuple(value) if isinstance(value, list) else value for name, value in given.items()}
    config = replace(PRESETS[args.preset], preset=args.preset, **given)  # custom starts from smoke's values
    if config.judge_minutes is not None and config.judge_minutes < 0:
        raise InvalidRequest(f"--judge-minutes {config.judge_minutes}: minutes, 0 or more")
    try:
        unknown = [c for c, _ in parse_tune_prompts_at(config.tune_prompts_at) if c not in config.context_targets]
    except ValueError as bad:
        raise InvalidRequest(str(bad)) from None
    if unknown:
        raise InvalidRequest(f"--tune-prompts-at: {unknown} not among the contexts {list(config.context_targets)}")
    if config.tune_finalists < 0:
        raise InvalidRequest(f"--tune-finalists {config.tune_finalists}: a count of candidates, 0 or more")
    for policy in config.policies:
        for tree_config in (*config.candidate_configs, config.baseline_config):
            validate_options(DraftOptions(policy, tree_config))
    return config


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    if args.resume and args.out_dir is None:
        parser().error("--resume needs --out-dir: the folder of the run to continue")
    try:
        config = config_from(args)
    except InvalidRequest as bad:
        parser().error(str(bad))
    if args.nsys:
        return profiling.run_under_nsys(argv, config)
    from bench.reproduce.protocol import run_protocol  # loads torch and the engine

    return run_protocol(config, argv).exit_code
