"""Tensors and token trees <-> their protobuf messages; big tensors split into row chunks.

Element bytes travel little-endian in row-major order. Every dtype is moved as a byte view
(``uint8``), so bfloat16, which numpy cannot hold, takes the same path as float32. One
session's failure inside a batched step travels as a ``SessionFailure`` with its status code. Whatever
arrives from the network is checked (dtype, shape against byte count, row continuity) and a
bad message raises ``InvalidRequest``, never a crash.
"""

from __future__ import annotations

import math
from typing import Iterator

import grpc
import numpy as np
import torch

from diffspec.errors import DiffSpecError, InvalidRequest
from diffspec.rpc_status import error_for, status_for
from diffspec.sampling import TokenLogprobs
from diffspec.tree import DraftTree
from diffspec.v1 import logprobs_pb2, tensor_pb2

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
CHUNK_HEADROOM_BYTES = 16 * 1024  # room for the message framing around a chunk's data


def tensor_to_proto(tensor: torch.Tensor) -> tensor_pb2.Tensor:
    if tensor.dtype not in _NAMES:
        raise InvalidRequest(f"dtype {tensor.dtype} cannot travel; supported: {sorted(DTYPES)}")
    data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return tensor_pb2.Tensor(dtype=_NAMES[tensor.dtype], shape=list(tensor.shape), data=data)


def tensor_from_proto(message: tensor_pb2.Tensor) -> torch.Tensor:
    """A CPU tensor that owns its memory (the message can be dropped)."""
    dtype = DTYPES.get(message.dtype)
    if dtype is None:
        raise InvalidRequest(f"unknown tensor dtype {message.dtype!r}; supported: {sorted(DTYPES)}")
    shape = tuple(message.shape)
    if any(d < 0 for d in shape):
        raise InvalidRequest(f"negative tensor dimension in shape {shape}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    if math.prod(shape) * itemsize != len(message.data):
        raise InvalidRequest(
            f"tensor of shape {shape} and dtype {message.dtype} needs "
            f"{math.prod(shape) * itemsize} bytes, got {len(message.data)}"
        )
    if not message.data:
        return torch.empty(shape, dtype=dtype)
    raw = torch.from_numpy(np.frombuffer(message.data, dtype=np.uint8).copy())
    return raw.view(dtype).reshape(shape)


def split_rows(tensor: torch.Tensor, max_message_bytes: int) -> Iterator[tensor_pb2.TensorChunk]:
    """Row chunks of ``tensor`` ([rows, ...]), each under ``max_message_bytes``; at least one chunk."""
    total_rows = tensor.shape[0]
    row_bytes = max(1, math.prod(tensor.shape[1:]) * tensor.element_size())
    budget = max_message_bytes - CHUNK_HEADROOM_BYTES
    if row_bytes > budget:
        raise InvalidRequest(f"one row of {row_bytes} bytes exceeds the {max_message_bytes}-byte message limit")
    rows_per_chunk = budget // row_bytes
    for start in range(0, max(total_rows, 1), rows_per_chunk):
        yield tensor_pb2.TensorChunk(
            rows=tensor_to_proto(tensor[start : start + rows_per_chunk]), row_offset=start, total_rows=total_rows
        )


class RowJoiner:
    """Reassembles the chunks of one ``[total_rows, row_width]`` tensor, arriving in row order.

    The row count comes from the receiver (e.g. the prompt length) and memory grows only with
    the rows that actually arrive, so a lying header cannot make it allocate; a receiver that
    trusts the sender's width passes ``row_width=None`` and the first chunk sets it.
    """

    def __init__(self, total_rows: int, row_width: int | None) -> None:
        self.total_rows = total_rows
        self.row_width = row_width
        self.rows_done = 0
        self._parts: list[torch.Tensor] = []  # [rows_i, row_width] each, in row order

    @property
    def complete(self) -> bool:
        return bool(self._parts) and self.rows_done == self.total_rows

    def add(self, chunk: tensor_pb2.TensorChunk) -> None:
        rows = tensor_from_proto(chunk.rows)
        if chunk.total_rows != self.total_rows or chunk.row_offset != self.rows_done:
            raise InvalidRequest(
                f"feature chunk at row {chunk.row_offset} of {chunk.total_rows}; "
                f"expected row {self.rows_done} of {self.total_rows}"
            )
        if self.row_width is None and rows.ndim == 2:
            self.row_width = rows.shape[1]
        if rows.ndim != 2 or rows.shape[1] != self.row_width or self.rows_done + rows.shape[0] > self.total_rows:
            raise InvalidRequest(
                f"feature chunk of shape {tuple(rows.shape)} does not fit "
                f"[{self.total_rows}, {self.row_width}] at row {self.rows_done}"
            )
        if self._parts and rows.dtype != self._parts[0].dtype:
            raise InvalidRequest(f"feature chunk of dtype {rows.dtype} after chunks of {self._parts[0].dtype}")
        self._parts.append(rows)
        self.rows_done += rows.shape[0]

    def tensor(self) -> torch.Tensor:
        if not self.complete:
            raise InvalidRequest(f"features incomplete: {self.rows_done} of {self.total_rows} rows arrived")
        return self._parts[0] if len(self._parts) == 1 else torch.cat(self._parts)


def tree_to_proto(tree: DraftTree) -> tensor_pb2.DraftTree:
    return tensor_pb2.DraftTree(
        tokens=tree.tokens.tolist(), parents=tree.parents.tolist(), draft_probs=tree.draft_probs.tolist()
    )


def tree_from_proto(message: tensor_pb2.DraftTree) -> DraftTree:
    try:
        return DraftTree(
            tokens=torch.tensor(list(message.tokens), dtype=torch.long),
            parents=torch.tensor(list(message.parents), dtype=torch.long),
            draft_probs=torch.tensor(list(message.draft_probs), dtype=torch.float32),
        )
    except ValueError as bad:
        raise InvalidRequest(f"malformed draft tree: {bad}") from None


def failure_to_proto(session_id: str, failure: DiffSpecError) -> tensor_pb2.SessionFailure:
    return tensor_pb2.SessionFailure(session_id=session_id, code=status_for(failure).value[0], message=str(failure))


def error_from_failure(peer: str, message: tensor_pb2.SessionFailure) -> DiffSpecError:
    """The typed error of one session's failure in a remote step (INVALID_ARGUMENT -> InvalidRequest, ...)."""
    return error_for(peer, _STATUS_BY_NUMBER.get(message.code), message.message)


_STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def logprobs_to_proto(logprobs: TokenLogprobs) -> logprobs_pb2.TokenLogprobs:
    return logprobs_pb2.TokenLogprobs(
        logprobs=logprobs.logprobs,
        top=[logprobs_pb2.TopLogprobs(token_ids=i, logprobs=p) for i, p in zip(logprobs.top_ids, logprobs.top_logprobs)],
    )


def logprobs_from_proto(message: logprobs_pb2.TokenLogprobs) -> TokenLogprobs:
    """Raises InvalidRequest when the alternatives do not pair up with the tokens."""
    if len(message.top) != len(message.logprobs) or any(len(t.token_ids) != len(t.logprobs) for t in message.top):
        raise InvalidRequest("logprobs: one list of alternatives per token, one logprob per alternative")
    return TokenLogprobs(
        list(message.logprobs), [list(t.token_ids) for t in message.top], [list(t.logprobs) for t in message.top]
    )
