"""What a run leaves in its folder: results.json (everything, raw runs included), results.md (the
tables), tuned_profile.json (the tuning pass's winners, for ``DIFFSPEC_TUNING_PROFILE``), one plot per
dataset, reproduce.log (written while it ran), and runs.jsonl with protocol.json (each run as it
finished, for ``--resume``: ``checkpoint.py``)."""

from __future__ import annotations

import json
import logging
import platform
import subprocess
import time
from dataclasses import asdict, fields
from typing import TYPE_CHECKING

import torch

from bench.reproduce.draft_steps import DraftStep
from bench.reproduce.plots import plot_summaries
from bench.reproduce.policy_pairs import policy_pairs
from bench.reproduce.presets import ProtocolConfig
from bench.reproduce.report import markdown, to_dicts
from bench.reproduce.tuning import write_tuned_profile
from diffspec.settings import DiffSpecSettings

if TYPE_CHECKING:
    from bench.reproduce.protocol import ProtocolResult

log = logging.getLogger("bench.reproduce")


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"


def git_commit() -> str:
    """The checkout's commit, with ``-dirty`` when its files differ from it (a copied working tree)."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_outputs(
    result: ProtocolResult, config: ProtocolConfig, settings: DiffSpecSettings, argv: list[str], started: float
) -> None:
    command = "python -m bench.reproduce " + " ".join(argv)
    header = (f"# Reproduce run: {config.preset}\n\n`{command}`\n\n{device_name()}, torch {torch.__version__}, "
              f"commit {git_commit()}, {time.strftime('%Y-%m-%d %H:%M', time.localtime(started))}; "
              f"target `{settings.base_model}`, head `{settings.draft_model}`; temperature {config.temperature}. "
              "Decode-only: tokens after the first over decode seconds. End-to-end: all new tokens over the "
              "client's seconds from request to last token (prefill and time to first token included).")
    pairs = policy_pairs(result.runs, result.scores)
    counts = {v: sum(1 for r in result.runs if r.exactness and r.exactness.verdict == v)
              for v in ("exact", "near-tie", "mismatch", "unchecked")}
    document = {
        "command": command,
        "preset": config.preset,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "seconds": round(time.time() - started, 1),
        "device": device_name(),
        "torch": torch.__version__,
        "commit": git_commit(),
        "config": json.loads(json.dumps(asdict(config), default=str)),
        "settings": json.loads(settings.model_dump_json()),
        "exactness": {"passed": result.exit_code == 0 and not counts["unchecked"], **counts},  # unchecked: not shown
        "tuning": to_dicts(result.scores),
        "policy_pairs": to_dicts(pairs),
        "summaries": to_dicts(result.summaries),
        "draft_step_fields": [f.name for f in fields(DraftStep)],  # the columns of every run's draft_steps
        "runs": [r.to_dict() for r in result.runs],
        "warmup_draft_steps": [w.to_dict() for w in result.warmup_draft_steps],
    }
    (result.out_dir / "results.json").write_text(json.dumps(document, indent=1))
    provenance = {key: document[key] for key in ("command", "started", "device", "commit")}
    provenance.update(base_model=str(settings.base_model), draft_model=str(settings.draft_model))
    profile = write_tuned_profile(result.out_dir, result.scores, provenance)
    table = markdown(result.summaries, result.scores, header, pairs)
    (result.out_dir / "results.md").write_text(table)
    plots = plot_summaries(result.summaries, result.out_dir)
    written = [p.name for p in (*plots, *([profile] if profile else []))]
    log.info("wrote %s: results.json, results.md, %s, reproduce.log", result.out_dir, ", ".join(written))
    print(table, flush=True)
