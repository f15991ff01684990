"""Regenerate the gRPC stubs in ``diffspec/v1/`` from ``proto/diffspec/v1/*.proto``.

``python -m diffspec.protogen`` rewrites the committed stubs; ``stale_stubs()`` regenerates
into a scratch directory and names every committed stub that differs, so a test can catch
a ``.proto`` edit without its stubs. Version stamps (``7.35.1``, ``'1.84.0'``) are ignored
in the comparison: a different grpcio-tools release is not a different API.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

from diffspec.settings import REPO_ROOT

PROTO_ROOT = REPO_ROOT / "proto"
STUB_DIR = REPO_ROOT / "diffspec" / "v1"
STUB_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
_VERSION = re.compile(r"\d+\.\d+\.\d+|\b\d+,\n\s+\d+,\n\s+\d+,")  # dotted, and the runtime check's 3 args


def proto_files(proto_root: Path = PROTO_ROOT) -> list[Path]:
    return sorted((proto_root / "diffspec" / "v1").glob("*.proto"))


def generate(out_root: Path, proto_root: Path = PROTO_ROOT) -> None:
    """Run protoc (from grpcio-tools) with the python, grpc and pyi plugins into ``out_root``."""
    args = [
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"--pyi_out={out_root}",
        *[str(p) for p in proto_files(proto_root)],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {proto_root}")


def stale_stubs(proto_root: Path = PROTO_ROOT, stub_dir: Path = STUB_DIR) -> list[str]:
    """Stub files (names in ``stub_dir``) missing, extra or different from a fresh generation."""
    with tempfile.TemporaryDirectory() as scratch:
        generate(Path(scratch), proto_root)
        fresh_dir = Path(scratch) / "diffspec" / "v1"
        fresh = {p.name: _normalized(p) for p in fresh_dir.iterdir() if p.name.endswith(STUB_SUFFIXES)}
    committed = {p.name: _normalized(p) for p in stub_dir.iterdir() if p.name.endswith(STUB_SUFFIXES)}
    return sorted(name for name in fresh.keys() | committed.keys() if fresh.get(name) != committed.get(name))


def _normalized(path: Path) -> str:
    return _VERSION.sub("<version>", path.read_text())


def main() -> int:
    generate(REPO_ROOT)
    print(f"regenerated the stubs of {len(proto_files())} proto files in {STUB_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
