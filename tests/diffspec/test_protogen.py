"""The committed gRPC stubs match the .proto files (regenerate: ``python -m diffspec.protogen``)."""

from __future__ import annotations

import shutil

from diffspec.protogen import PROTO_ROOT, STUB_DIR, stale_stubs


def test_committed_stubs_are_fresh():
    assert stale_stubs() == [], "stubs are stale: run `python -m diffspec.protogen` and commit diffspec/v1"


def test_an_edited_proto_makes_its_stubs_stale(tmp_path):
    shutil.copytree(PROTO_ROOT, tmp_path / "proto")
    gateway = tmp_path / "proto" / "diffspec" / "v1" / "gateway.proto"
    gateway.write_text(
        gateway.read_text().replace("message TokenizeRequest {", "message TokenizeRequest {\n  bool x = 9;")
    )
    assert stale_stubs(tmp_path / "proto", STUB_DIR) == ["gateway_pb2.py", "gateway_pb2.pyi"]
