"""The attack suite shares the gRPC tests' fixtures: the bundled pair, its Auto reference, server processes."""

from tests.gateway.conftest import (  # noqa: F401 - fixtures
    auto_reference,
    draft_head_dir,
    embedded_server,
    reference_target,
    split_deployment,
    tokenizer,
)
