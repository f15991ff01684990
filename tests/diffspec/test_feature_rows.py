"""Feature rows as bytes: bit-exact against the tensors they came from, sliced and joined without
decoding, chunked under the message limit, bad messages rejected."""

from __future__ import annotations

import pytest
import torch

from diffspec.errors import InvalidRequest
from diffspec.feature_rows import DTYPE_SIZES, RowJoiner, WireRows, concat_rows, wire_rows
from diffspec.tensor_wire import DTYPES, rows_from_tensor, rows_to_tensor, split_rows, tensor_from_proto, tensor_to_proto
from diffspec.v1 import tensor_pb2


def random_rows(rows: int, width: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, width, generator=generator) * 100).to(dtype)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_rows_round_trip_is_bit_exact_for_every_dtype(dtype):
    tensor = random_rows(5, 3, dtype)
    rows = rows_from_tensor(tensor)
    assert (rows.dtype, rows.row_width, len(rows), rows.row_bytes) == (rows.dtype, 3, 5, 3 * DTYPE_SIZES[rows.dtype])
    back = rows_to_tensor(WireRows.from_proto(tensor_pb2.Tensor.FromString(rows.to_proto().SerializeToString())))
    assert back.dtype == dtype and back.shape == tensor.shape and torch.equal(bits(back), bits(tensor))


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("shape", [(3, 5), (7,), (), (0, 4)])
def test_tensor_round_trip_is_bit_exact(dtype, shape):
    tensor = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 100).to(dtype)
    back = tensor_from_proto(tensor_pb2.Tensor.FromString(tensor_to_proto(tensor).SerializeToString()))
    assert back.dtype == dtype and back.shape == tensor.shape and torch.equal(bits(back), bits(tensor))


def test_bfloat16_travels_as_its_raw_16_bits():
    tensor = torch.tensor([[1.0, -2.5, 3.140625]], dtype=torch.bfloat16)
    message = rows_from_tensor(tensor).to_proto()
    assert message.dtype == "bfloat16" and len(message.data) == 6
    assert torch.equal(rows_to_tensor(WireRows.from_proto(message)), tensor)


# (rows of each joined part, slice): slices inside one part, across parts, empty and clipped
SLICES = [
    ([10], slice(0, 10)),
    ([10], slice(3, 7)),
    ([4, 4, 4], slice(2, 10)),
    ([4, 4, 4], slice(4, 8)),
    ([4, 0, 4], slice(3, 5)),
    ([4, 4], slice(6, 6)),
    ([4, 4], slice(5, 100)),
    ([1, 1, 1, 1], slice(1, 3)),
]


@pytest.mark.parametrize("parts, rows", SLICES)
def test_slices_of_joined_rows_equal_the_tensor_slices(parts, rows):
    tensors = [random_rows(n, 6, seed=i) for i, n in enumerate(parts)]
    joined = concat_rows([rows_from_tensor(t) for t in tensors])
    assert isinstance(joined, WireRows) and len(joined) == sum(parts)
    expected = torch.cat(tensors)[rows]
    part = joined[rows]
    assert len(part) == expected.shape[0] and torch.equal(rows_to_tensor(part), expected)
    assert sum(len(s) for s in part.segments) == expected.numel() * 4  # views of whole rows only


def test_concat_and_wire_rows_take_tensors_in_process():
    tensors = [random_rows(2, 4), random_rows(3, 4, seed=1)]
    assert torch.equal(concat_rows(tensors), torch.cat(tensors))
    assert concat_rows(tensors[:1]) is tensors[0]
    relayed = rows_from_tensor(tensors[0])
    assert wire_rows(relayed) is relayed and torch.equal(rows_to_tensor(wire_rows(tensors[1])), tensors[1])
    with pytest.raises(InvalidRequest, match="cannot be joined"):
        WireRows.concat([relayed, rows_from_tensor(random_rows(1, 5))])


def test_chunks_stay_under_the_limit_and_join_back():
    features = random_rows(1000, 768)  # 3 KB a row, 3 MB in all
    limit = 256 * 1024
    chunks = list(split_rows(features, limit))
    assert len(chunks) > 10 and all(c.ByteSize() < limit for c in chunks)
    joiner = RowJoiner(total_rows=1000, row_width=768)
    for chunk in chunks:
        assert not joiner.complete
        joiner.add(tensor_pb2.TensorChunk.FromString(chunk.SerializeToString()))
    assert joiner.complete and torch.equal(rows_to_tensor(joiner.rows()), features)
    empty = list(rows_from_tensor(random_rows(0, 8)).chunks(limit))
    assert len(empty) == 1 and empty[0].total_rows == 0


def test_joiner_rejects_chunks_out_of_order_misshaped_or_missing():
    chunks = list(split_rows(random_rows(1000, 64), 65536))
    with pytest.raises(InvalidRequest, match="expected row 0"):
        RowJoiner(1000, 64).add(chunks[1])
    with pytest.raises(InvalidRequest, match="does not fit"):
        RowJoiner(1000, 32).add(chunks[0])
    with pytest.raises(InvalidRequest, match="of 50"):
        RowJoiner(50, 64).add(chunks[0])
    with pytest.raises(InvalidRequest, match="incomplete"):
        RowJoiner(1000, 64).rows()
    with pytest.raises(InvalidRequest, match="exceeds"):
        list(split_rows(random_rows(2, 100_000), 65536))
    joiner = RowJoiner(2, None)
    joiner.add(chunk_of(random_rows(1, 4), row_offset=0, total_rows=2))
    with pytest.raises(InvalidRequest, match="dtype float16 after chunks of float32"):
        joiner.add(chunk_of(random_rows(1, 4, torch.float16), row_offset=1, total_rows=2))


def chunk_of(tensor: torch.Tensor, row_offset: int, total_rows: int) -> tensor_pb2.TensorChunk:
    return tensor_pb2.TensorChunk(rows=rows_from_tensor(tensor).to_proto(), row_offset=row_offset, total_rows=total_rows)


@pytest.mark.parametrize(
    "message, error",
    [
        (tensor_pb2.Tensor(dtype="complex64", shape=[1, 1], data=b"\0" * 8), "unknown tensor dtype"),
        (tensor_pb2.Tensor(dtype="float32", shape=[2, 2], data=b"\0" * 12), "needs 16 bytes"),
        (tensor_pb2.Tensor(dtype="float32", shape=[-1, 4], data=b""), "expected \\[rows, width\\]"),
        (tensor_pb2.Tensor(dtype="float32", shape=[4], data=b"\0" * 16), "expected \\[rows, width\\]"),
    ],
)
def test_bad_rows_are_invalid_requests(message, error):
    with pytest.raises(InvalidRequest, match=error):
        WireRows.from_proto(message)


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
