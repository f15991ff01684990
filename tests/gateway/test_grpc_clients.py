"""RemoteTarget and RemoteDraft against live services: same results as in process, deadlines applied."""

from __future__ import annotations

import asyncio

import pytest
import torch

from diffspec.errors import InvalidRequest, PeerUnavailable
from diffspec.sampling import SamplingParams
from diffspec.settings import DiffSpecSettings
from draft_service.backend import DraftOptions
from draft_service.grpc_client import RemoteDraft
from target_service.grpc_client import RemoteTarget
from tests.conftest import short_prompts

SETTINGS = DiffSpecSettings(max_message_bytes=65536)


def test_remote_target_prefill_features_equal_in_process(split_deployment, reference_target, tokenizer):
    prompt = tokenizer(short_prompts(1)[0][-2000:])["input_ids"]

    async def both():
        remote = RemoteTarget.connect(split_deployment.target.address, SETTINGS)
        try:
            got = await remote.prefill("a", prompt, SamplingParams(), want_features=True)
            step = await remote.decode("a")
            await remote.release("a")
            await remote.release("a")  # a second release is a no-op
        finally:
            await remote.close()
        want = await reference_target.prefill("b", prompt, SamplingParams(), want_features=True)
        await reference_target.release("b")
        return got, step, want

    got, step, want = asyncio.run(both())
    assert got.first_token == want.first_token and step.accepted_tokens == []
    assert got.features.shape == (len(prompt), 768) and torch.equal(got.features, want.features.cpu())
    assert step.features is not None and step.features.shape == (1, 768)


def test_remote_target_calls_end_at_their_deadline(split_deployment):
    async def late_decode():
        remote = RemoteTarget.connect(split_deployment.target.address, SETTINGS)
        try:
            bounded = remote.with_timeout(0.5)
            await bounded.prefill("s", [0, 5, 6, 7], SamplingParams(), want_features=False)
            await asyncio.sleep(0.8)
            with pytest.raises(PeerUnavailable, match="DEADLINE_EXCEEDED"):
                await bounded.decode("s")
            await bounded.release("s")
            return await remote.info()
        finally:
            await remote.close()

    info = asyncio.run(late_decode())
    assert info.max_context == 16384


def test_remote_draft_rejections_and_unknown_sessions(split_deployment):
    async def misuse():
        draft = RemoteDraft.connect(split_deployment.draft.address, SETTINGS)
        try:
            with pytest.raises(InvalidRequest, match="unknown draft service session"):
                await draft.propose("nobody")
            with pytest.raises(InvalidRequest, match="does not fit"):
                await draft.start("s", [0, 5, 6], torch.zeros(3, 10), 7, DraftOptions("full"))
            await draft.release("s")
        finally:
            await draft.close()

    asyncio.run(misuse())
