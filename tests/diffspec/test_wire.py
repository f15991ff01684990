"""Tensor, tree and session-failure codec: exact round trips, chunking under the message limit,
bad messages rejected."""

from __future__ import annotations

import grpc
import pytest
import torch

from diffspec.errors import (
    CheckpointError,
    DeadlineExceeded,
    DiffSpecError,
    InvalidRequest,
    KVPoolExhausted,
    PeerUnavailable,
    ResourceExhausted,
)
from diffspec.tree import DraftTree
from diffspec.v1 import tensor_pb2
from diffspec.wire import (
    DTYPES,
    RowJoiner,
    error_from_failure,
    failure_to_proto,
    split_rows,
    tensor_from_proto,
    tensor_to_proto,
    tree_from_proto,
    tree_to_proto,
)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("shape", [(3, 5), (7,), (), (0, 4)])
def test_tensor_round_trip_is_bit_exact(dtype, shape):
    torch.manual_seed(0)
    tensor = (torch.randn(shape) * 100).to(dtype)
    back = tensor_from_proto(tensor_pb2.Tensor.FromString(tensor_to_proto(tensor).SerializeToString()))
    assert back.dtype == dtype and back.shape == tensor.shape
    assert torch.equal(back.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))


def test_bfloat16_travels_as_its_raw_16_bits():
    tensor = torch.tensor([1.0, -2.5, 3.140625], dtype=torch.bfloat16)
    message = tensor_to_proto(tensor)
    assert message.dtype == "bfloat16" and len(message.data) == 6
    assert torch.equal(tensor_from_proto(message), tensor)


@pytest.mark.parametrize(
    "message, error",
    [
        (tensor_pb2.Tensor(dtype="complex64", shape=[1], data=b"\0" * 8), "unknown tensor dtype"),
        (tensor_pb2.Tensor(dtype="float32", shape=[2, 2], data=b"\0" * 12), "needs 16 bytes"),
        (tensor_pb2.Tensor(dtype="float32", shape=[-1, 4], data=b""), "negative"),
    ],
)
def test_bad_tensors_are_invalid_requests(message, error):
    with pytest.raises(InvalidRequest, match=error):
        tensor_from_proto(message)


def test_split_rows_stays_under_the_limit_and_joins_back():
    features = torch.randn(1000, 768)  # 3 KB a row, 3 MB in all
    limit = 256 * 1024
    chunks = list(split_rows(features, limit))
    assert len(chunks) > 10 and all(c.ByteSize() < limit for c in chunks)
    joiner = RowJoiner(total_rows=1000, row_width=768)
    for chunk in chunks:
        assert not joiner.complete
        joiner.add(tensor_pb2.TensorChunk.FromString(chunk.SerializeToString()))
    assert joiner.complete and torch.equal(joiner.tensor(), features)


def test_joiner_rejects_chunks_out_of_order_misshaped_or_missing():
    chunks = list(split_rows(torch.randn(1000, 64), 65536))
    with pytest.raises(InvalidRequest, match="expected row 0"):
        RowJoiner(1000, 64).add(chunks[1])
    with pytest.raises(InvalidRequest, match="does not fit"):
        RowJoiner(1000, 32).add(chunks[0])
    with pytest.raises(InvalidRequest, match="of 50"):
        RowJoiner(50, 64).add(chunks[0])
    with pytest.raises(InvalidRequest, match="incomplete"):
        RowJoiner(1000, 64).tensor()
    with pytest.raises(InvalidRequest, match="exceeds"):
        list(split_rows(torch.randn(2, 100_000), 65536))


def test_tree_round_trip_and_malformed_trees():
    tree = DraftTree(torch.tensor([5, 6, 7, 8]), torch.tensor([-1, 0, 0, 1]), torch.tensor([1.0, 0.5, 0.25, 0.125]))
    back = tree_from_proto(tree_to_proto(tree))
    assert all(torch.equal(getattr(back, f), getattr(tree, f)) for f in ("tokens", "parents", "draft_probs"))
    for bad in [
        tensor_pb2.DraftTree(),
        tensor_pb2.DraftTree(tokens=[1, 2], parents=[-1, 1], draft_probs=[1, 1]),
        tensor_pb2.DraftTree(tokens=[1, 2], parents=[-1], draft_probs=[1, 1]),
    ]:
        with pytest.raises(InvalidRequest, match="malformed draft tree"):
            tree_from_proto(bad)


# raised at the service -> its status code on the wire -> what the gateway's engine sees
FAILURES = [
    (InvalidRequest("token ids out of the vocabulary"), grpc.StatusCode.INVALID_ARGUMENT, InvalidRequest),
    (KVPoolExhausted("need 4 pages, 1 free"), grpc.StatusCode.RESOURCE_EXHAUSTED, ResourceExhausted),
    (ResourceExhausted("no arena slot"), grpc.StatusCode.RESOURCE_EXHAUSTED, ResourceExhausted),
    (PeerUnavailable("still loading"), grpc.StatusCode.UNAVAILABLE, PeerUnavailable),
    (DeadlineExceeded("too late"), grpc.StatusCode.DEADLINE_EXCEEDED, PeerUnavailable),
    (CheckpointError("no weights"), grpc.StatusCode.FAILED_PRECONDITION, PeerUnavailable),
    (DiffSpecError("sampling overflow"), grpc.StatusCode.INTERNAL, PeerUnavailable),
]


@pytest.mark.parametrize("raised, code, kind", FAILURES, ids=[type(f[0]).__name__ for f in FAILURES])
def test_session_failure_round_trip_keeps_the_kind_and_the_message(raised, code, kind):
    message = tensor_pb2.SessionFailure.FromString(failure_to_proto("s-7", raised).SerializeToString())
    assert message.session_id == "s-7" and message.code == code.value[0] and message.message == str(raised)
    back = error_from_failure("target service", message)
    assert type(back) is kind
    if kind is PeerUnavailable:  # the peer could not do the work: named, with its code and its words
        assert str(back) == f"target service unavailable ({code.name}): {raised}"
    else:  # a rejection is meant for the caller and keeps the service's message as is
        assert str(back) == str(raised)


@pytest.mark.parametrize("code", [0, 999, -1])
def test_session_failure_with_a_code_that_is_no_error_is_peer_unavailable(code):
    """OK (0) or a number grpc does not know: the session still failed, and the engine must not trust it."""
    back = error_from_failure("draft service", tensor_pb2.SessionFailure(session_id="s", code=code, message="?"))
    assert isinstance(back, PeerUnavailable) and str(back).startswith("draft service unavailable (")
