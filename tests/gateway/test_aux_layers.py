"""A head whose ``eagle_aux_hidden_state_layer_ids`` differ from the target's default (2, L//2, L-3 rule):
the target extracts the head's layers for its sessions, in one process and split over three, and the
draft receives exactly those layers' features (a tiny Llama-3.1-layout target, a published-layout head).
In one process the target takes the head's layers as its own; split, it keeps its default (1, 2, 3) and
each speculative session asks for the head's.
Speculative output and logprobs equal Auto's, over the wire too."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Iterator

import pytest
import torch

from diffspec.sampling import SamplingParams, TokenLogprobs
from diffspec.settings import DiffSpecSettings
from diffspec.tensor_wire import rows_to_tensor
from draft_service.backend import DraftBatch
from draft_service.grpc_client import RemoteDraft
from draft_service.options import DraftOptions
from gateway.assembly import build_engine, head_feature_layers
from gateway.engine import SpeculativeEngine
from gateway.request import GenerationRequest
from target_service.llama import LlamaModel
from tests.conftest import write_random_llama
from tests.draft_service.test_head_fit import published_head
from tests.gateway.conftest import assert_all_released, collect
from tests.gateway.servers import ServerProcess, free_port
from tests.gateway.tiny_tokenizer import write_llama3_tokenizer

HEAD_LAYERS = (0, 2, 3)  # the 4-layer target's default is (1, 2, 3)
PROMPT = [0, *range(5, 45)]
CHAIN = DraftOptions("chain", "8:0.0:4")


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("aux-layers")
    target = write_random_llama(root / "target", llama3_rope=True, tie_embeddings=False, max_shard_size="60KB")
    write_llama3_tokenizer(target)
    return target, published_head(target, root / "head", list(HEAD_LAYERS), nested=False)


def capture_starts(engine: SpeculativeEngine) -> list[torch.Tensor]:
    """The prompt features of every draft start the engine sends from now on."""
    seen: list[torch.Tensor] = []
    step = engine.draft.step

    def recording(batch: DraftBatch):  # noqa: ANN202
        seen.extend(_tensor(start.features) for start in batch.starts)
        return step(batch)

    engine.draft.step = recording
    return seen


def _tensor(features) -> torch.Tensor:  # noqa: ANN001 - a tensor in process, WireRows when split
    return (features if isinstance(features, torch.Tensor) else rows_to_tensor(features)).float()


def logprobs_of(engine: SpeculativeEngine, request: GenerationRequest) -> TokenLogprobs:
    async def go() -> list[TokenLogprobs]:
        return [chunk.logprobs async for chunk in engine.generate(request) if chunk.logprobs is not None]

    return TokenLogprobs.join(asyncio.run(go()))


def check_features_and_lossless(engine: SpeculativeEngine, target_dir: Path) -> None:
    assert engine.core.feature_layers == HEAD_LAYERS
    starts = capture_starts(engine)
    auto = collect(engine, GenerationRequest(PROMPT, 16))[0]
    speculative = collect(engine, GenerationRequest(PROMPT, 16, draft=CHAIN))[0]
    assert speculative == auto
    auto_logprobs = logprobs_of(engine, GenerationRequest(PROMPT, 8, SamplingParams(logprobs=2)))
    drafted_logprobs = logprobs_of(engine, GenerationRequest(PROMPT, 8, SamplingParams(logprobs=2), draft=CHAIN))
    assert drafted_logprobs.top_ids == auto_logprobs.top_ids and len(auto_logprobs) == 8
    assert torch.allclose(torch.tensor(drafted_logprobs.logprobs), torch.tensor(auto_logprobs.logprobs), atol=1e-4)
    model = LlamaModel.from_pretrained(target_dir, torch.device("cpu"), torch.float32)
    _, want = model.forward_dense(torch.tensor([PROMPT]), HEAD_LAYERS)
    _, default = model.forward_dense(torch.tensor([PROMPT]), (1, 2, 3))
    assert len(starts) == 2 and all(start.shape == want[0].shape for start in starts)
    assert all(torch.allclose(start, want[0], atol=1e-4) for start in starts)
    assert not torch.allclose(starts[0], default[0], atol=1e-2)  # not the target's default layers


def test_in_process_the_target_extracts_the_heads_layers(pair):
    target_dir, head_dir = pair
    engine = build_engine(DiffSpecSettings(base_model=target_dir, draft_model=head_dir, num_pages=64, dtype="float32"))
    try:
        assert engine.target.feature_layers == HEAD_LAYERS  # its own, so its CUDA graphs hold them
        check_features_and_lossless(engine, target_dir)
        assert_all_released(engine)
    finally:
        engine.close()


def test_split_the_gateway_asks_the_draft_which_layers(pair, tmp_path):
    target_dir, head_dir = pair
    env = {"DIFFSPEC_BASE_MODEL": str(target_dir), "DIFFSPEC_DRAFT_MODEL": str(head_dir), "DIFFSPEC_DTYPE": "float32"}
    servers = [ServerProcess(role, tmp_path, env=env) for role in ("target", "draft")]
    try:
        for server in servers:
            server.wait_serving()
        settings = DiffSpecSettings(
            base_model=target_dir, draft_model=head_dir, target_address=servers[0].address,
            draft_address=servers[1].address, max_message_bytes=65536,
        )  # fmt: skip
        engine = build_engine(settings)
        try:
            check_features_and_lossless(engine, target_dir)
        finally:
            engine.close()
    finally:
        for server in servers:
            server.stop()


def test_a_draft_that_does_not_answer_leaves_the_targets_default_in_one_log_line(caplog):
    draft = RemoteDraft.connect(f"127.0.0.1:{free_port()}", DiffSpecSettings())
    try:
        with caplog.at_level(logging.WARNING, logger="gateway.assembly"):
            assert head_feature_layers(draft, timeout=0.5) == ()
    finally:
        draft.close()
    assert len(caplog.records) == 1 and "target's default" in caplog.records[0].getMessage()
    assert head_feature_layers(None, timeout=0.5) == ()
