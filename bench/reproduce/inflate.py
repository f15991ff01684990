"""``--inflate-8b``: the 8B-shaped pair built on the GPU by the shared ``tools/inflate.py``.

It computes the small pair's function with Llama-3.1-8B's matrix shapes (14 GB target, 593 MB head;
vocabulary 8,192 and draft vocabulary 4,096 stay the small pair's: state that beside any number).
A pair already built from the same two source directories is reused.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
from pathlib import Path

import torch


def inflated_dir(base_model: Path, draft_model: Path) -> Path:
    """One folder per (target, head) source pair: a pair built from another head is never reused."""
    sources = hashlib.sha1(f"{base_model.resolve()}\n{draft_model.resolve()}".encode()).hexdigest()[:10]
    return Path(tempfile.gettempdir()) / f"diffspec-8b-{base_model.resolve().name}-{sources}"


def inflate_command(shared_dir: Path, base_model: Path, draft_model: Path, out: Path) -> list[str]:
    return [sys.executable, str(shared_dir / "tools" / "inflate.py"),
            "--target", str(base_model), "--head", str(draft_model), "--out", str(out)]


def inflate_pair(shared_dir: Path, base_model: Path, draft_model: Path) -> tuple[Path, Path]:
    """(target, head) directories of the 8B-shaped pair, built now unless already there."""
    tool = shared_dir / "tools" / "inflate.py"
    if not tool.exists():
        raise SystemExit(f"--inflate-8b: no {tool}; pass --shared-dir pointing at the folder that holds tools/inflate.py")
    if not torch.cuda.is_available():
        raise SystemExit("--inflate-8b builds a 14 GB Llama-3.1-8B-shaped pair on the GPU; no GPU is visible here")
    out = inflated_dir(base_model, draft_model)
    target, head = out / "target", out / "head"
    if not ((target / "config.json").exists() and (head / "config.json").exists()):
        subprocess.run(inflate_command(shared_dir, base_model, draft_model, out), check=True)
    return target, head
