"""The commands in README.md's and docs/*.md's fenced shell blocks run as written.

Each block runs as one bash session in a copy of the repository's layout (``../shared`` beside it), in
the order written: RUN commands as written and checked for their exit status and an expected string,
SERVER commands in the background with a wait until they serve (what a reader does before typing the
next command), the other kinds skipped (tests/docs/commands.py says why). Port numbers move to free
ports, consistently within a block, so a block never meets another server. Every command must be in
the table, and every relative path a command names must exist (or, for an output, its folder).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from diffspec.settings import REPO_ROOT, SHARED_DIR
from tests.docs.commands import COMMANDS, Kind

DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(?:bash|sh|shell)\n(.*?)^```", re.M | re.S)
PORTS = re.compile(r"\b(50051|50061|50062|8000|9100)\b")  # the ports the docs use
DEFAULT_LISTEN_PORT = "50051"  # a server without --listen binds 127.0.0.1:50051
OUTPUT_FLAGS = {"--out", "--out-dir", "--csv"}  # each tool makes its output's folders
SECONDS_PER_COMMAND = 180  # a 2-core machine, first imports cold
MARK = "::: command"


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int  # of the opening fence, 1-based
    commands: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.doc.relative_to(REPO_ROOT)}:{self.line}"


def doc_blocks() -> list[Block]:
    blocks = []
    for doc in DOCS:
        text = doc.read_text()
        for fence in FENCE.finditer(text):
            body = re.sub(r"\s*\\\n\s*", " ", fence.group(1))  # continuation lines joined with one space
            commands = tuple(line.rstrip() for line in body.splitlines() if line.strip())
            blocks.append(Block(doc, text.count("\n", 0, fence.start()) + 1, commands))
    return blocks


BLOCKS = doc_blocks()
RUN_BLOCKS = [b for b in BLOCKS if any(COMMANDS.get(c) and COMMANDS[c].kind is Kind.RUN for c in b.commands)]


def test_every_command_is_classified_and_every_entry_is_used():
    written = [c for b in BLOCKS for c in b.commands]
    unclassified = [c for c in written if c not in COMMANDS]
    assert not unclassified, "classify these in tests/docs/commands.py:\n" + "\n".join(unclassified)
    assert not set(COMMANDS) - set(written), "entries no doc has any more"
    skipped = [c for c, entry in COMMANDS.items() if entry.kind not in (Kind.RUN, Kind.SERVER) and not entry.why]
    assert not skipped, f"say why these are not run: {skipped}"


def input_paths(command: str) -> list[str]:
    """The relative paths a command reads: arguments (or NAME=value values) that name a file or folder."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)  # redirections and ; apart from words
    lexer.whitespace_split = True
    words = list(lexer)
    paths = []
    for before, word in zip(["", *words], words):
        word = word.split("=", 1)[1] if re.match(r"^[A-Z_]+=", word) else word
        if "/" in word and not word.startswith(("/", "-", "{", "$", "http")) and ":" not in word.split("/")[0]:
            paths += [] if before in OUTPUT_FLAGS else [word]
    return paths


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.name)
def test_input_paths_exist(block: Block):
    if not SHARED_DIR.exists() and any("../shared" in c for c in block.commands):
        pytest.skip(f"{SHARED_DIR} is absent")  # fails instead where ../shared is required (tests/conftest.py)
    for command in block.commands:
        for path in input_paths(command):
            assert (REPO_ROOT / path).exists(), f"{block.name}: {command!r} reads {path}, which does not exist"


def free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def listen_address(server: str) -> str:
    words = shlex.split(server, comments=True)
    address = words[words.index("--listen") + 1] if "--listen" in words else f"127.0.0.1:{DEFAULT_LISTEN_PORT}"
    return address.replace("0.0.0.0", "127.0.0.1")


def block_script(block: Block) -> tuple[str, list[str]]:
    """One bash session for the block (ports not yet moved), and the RUN commands it runs, in order."""
    lines = ["set -e", "trap 'kill $(jobs -p) 2>/dev/null || true; wait' EXIT"]  # a block may start no server
    ran = []
    for command in block.commands:
        entry = COMMANDS[command]
        if entry.kind is Kind.RUN:
            lines += [f"echo '{MARK} {len(ran)}'", command]
            ran.append(command)
        elif entry.kind is Kind.SERVER:
            server = command if command.split("#")[0].rstrip().endswith("&") else f"{command} &"
            address = listen_address(command)
            lines += [server, f"python -m diffspec.health_probe {address} --wait-for $! --timeout {SECONDS_PER_COMMAND}"]
            words = shlex.split(command, comments=True)
            if "--http-listen" in words:
                http = words[words.index("--http-listen") + 1]
                lines.append(f"until curl -sf {http}/ready >/dev/null; do sleep 0.5; done")
    return "\n".join(lines) + "\n", ran


def starts_a_server(block: Block) -> bool:
    return any(COMMANDS[c].kind is Kind.SERVER for c in block.commands if c in COMMANDS)


@pytest.mark.parametrize(
    "block", [pytest.param(b, marks=[pytest.mark.slow] if starts_a_server(b) else []) for b in RUN_BLOCKS],
    ids=lambda b: b.name,
)  # a block that starts servers takes tens of seconds
def test_block_runs_as_written(block: Block, tmp_path: Path):
    script, ran = block_script(block)
    moved = {port: free_port() for port in set(PORTS.findall(script)) | {DEFAULT_LISTEN_PORT}}
    script = PORTS.sub(lambda m: moved[m.group(1)], script)
    layout = tmp_path / REPO_ROOT.name  # the repository's entries linked, so what a command writes lands here
    layout.mkdir()
    for entry in REPO_ROOT.iterdir():
        if entry.name not in {"runs", "results", ".git"}:
            (layout / entry.name).symlink_to(entry)
    if SHARED_DIR.exists():
        (tmp_path / "shared").symlink_to(SHARED_DIR)
    env = {**os.environ, "DIFFSPEC_LISTEN": f"127.0.0.1:{moved[DEFAULT_LISTEN_PORT]}"}
    with subprocess.Popen(
        ["bash", "-c", script], cwd=layout, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    ) as session:  # fmt: skip
        try:
            output, _ = session.communicate(timeout=SECONDS_PER_COMMAND * (len(block.commands) + 1))
        except subprocess.TimeoutExpired:
            os.killpg(session.pid, signal.SIGKILL)
            output, _ = session.communicate()
            pytest.fail(f"{block.name} timed out:\n{output[-4000:]}")
    parts = output.split(MARK)
    last = len(parts) - 2  # the index of the last command that started
    assert session.returncode == 0, f"{block.name}: {ran[last] if last >= 0 else 'a server'} failed:\n{output[-4000:]}"
    assert last == len(ran) - 1
    for i, command in enumerate(ran):
        said = parts[i + 1]
        assert COMMANDS[command].expect in said, f"{command!r} printed no {COMMANDS[command].expect!r}:\n{said[-3000:]}"
