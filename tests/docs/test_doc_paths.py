"""Every file a doc names is in the repository: README.md and docs/*.md send readers to no file outside it
(``../shared``'s models, data and tools aside, which the docs describe) and to no path that has moved."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from diffspec.settings import REPO_ROOT

DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
CODE_SPAN = re.compile(r"`([\w./-]+)`")  # `path/like/this.py`, `dir/`; not commands with spaces
OUTSIDE = re.compile(r"(?<![\w/])(/work/|/home/|DESIGN\.md|STYLE\.md)")


def named_paths(doc: Path) -> list[str]:
    """Relative paths a doc names in code spans: words with a slash that do not start one (routes, /dev)."""
    return [p for p in CODE_SPAN.findall(doc.read_text()) if "/" in p.rstrip("/") and not p.startswith("/")]


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_every_named_path_is_in_the_repository(doc: Path):
    missing = []
    for path in named_paths(doc):
        target = REPO_ROOT / path
        if path.startswith("../"):
            if path.rstrip("/") != "../shared" and not path.startswith("../shared/"):
                missing.append(f"{path} (outside the repository)")
        elif not target.exists() and (Path(path).suffix == ".py" or not target.parent.is_dir()):
            missing.append(path)  # an output (bench/results/x.json) needs only its folder; source never is one
    assert not missing, f"{doc.name} names paths that are not in the repository: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_no_doc_sends_readers_outside_the_repository(doc: Path):
    assert not OUTSIDE.findall(doc.read_text()), f"{doc.name} names a file outside the repository"
