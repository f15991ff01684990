"""EAGLE-3 feature rows as they cross the wire, kept as bytes: what a gateway relays without torch.

Split over processes, the target's features reach the draft through the gateway: prompt rows with
each prefill chunk, accepted rows with each verification. The gateway computes nothing on them, so
it keeps the bytes that arrived (``WireRows``: views of the received messages' data), cuts them per
session, joins a prompt's chunks and splits them into messages for the draft without decoding an
element. In process the same fields hold torch tensors; ``Features`` names either, and
``concat_rows`` and ``wire_rows`` take either. Elements are little-endian, rows row-major.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

from diffspec.errors import InvalidRequest
from diffspec.v1 import tensor_pb2

if TYPE_CHECKING:
    import torch

DTYPE_SIZES = {  # bytes per element of each dtype that can travel
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "uint8": 1,
    "bool": 1,
}
CHUNK_HEADROOM_BYTES = 16 * 1024  # room for the message framing around a chunk's data


@dataclass(frozen=True)
class WireRows:
    """A ``[num_rows, row_width]`` tensor's rows as bytes; slicing and joining copy none of them."""

    dtype: str  # a DTYPE_SIZES name
    row_width: int  # elements per row (3 * target hidden for features)
    num_rows: int
    segments: tuple[memoryview, ...]  # consecutive runs of whole rows, in row order

    @property
    def row_bytes(self) -> int:
        return self.row_width * DTYPE_SIZES[self.dtype]

    def __len__(self) -> int:
        return self.num_rows

    def __getitem__(self, rows: slice) -> WireRows:
        """Rows ``rows.start`` to ``rows.stop`` (step 1), as views of the same bytes."""
        start, stop, _ = rows.indices(self.num_rows)
        stop = max(start, stop)
        begin, end = start * self.row_bytes, stop * self.row_bytes
        parts, offset = [], 0
        for segment in self.segments:
            low, high = max(begin - offset, 0), min(end - offset, len(segment))
            if low < high:
                parts.append(segment[low:high])
            offset += len(segment)
        return WireRows(self.dtype, self.row_width, stop - start, tuple(parts))

    @staticmethod
    def concat(parts: Sequence[WireRows]) -> WireRows:
        """The rows of ``parts`` one after another (all of one dtype and width)."""
        first = parts[0]
        if any(p.dtype != first.dtype or p.row_width != first.row_width for p in parts):
            shapes = sorted({(p.dtype, p.row_width) for p in parts})
            raise InvalidRequest(f"feature rows of different dtypes or widths cannot be joined: {shapes}")
        segments = tuple(s for p in parts for s in p.segments)
        return WireRows(first.dtype, first.row_width, sum(p.num_rows for p in parts), segments)

    @staticmethod
    def from_proto(message: tensor_pb2.Tensor) -> WireRows:
        """A view of the message's data, after the checks anything from the network gets."""
        if message.dtype not in DTYPE_SIZES:
            raise InvalidRequest(f"unknown tensor dtype {message.dtype!r}; supported: {sorted(DTYPE_SIZES)}")
        shape = tuple(message.shape)
        if len(shape) != 2 or min(shape) < 0:
            raise InvalidRequest(f"feature rows of shape {shape}; expected [rows, width]")
        needed = shape[0] * shape[1] * DTYPE_SIZES[message.dtype]
        if needed != len(message.data):
            raise InvalidRequest(
                f"tensor of shape {shape} and dtype {message.dtype} needs {needed} bytes, got {len(message.data)}"
            )
        return WireRows(message.dtype, shape[1], shape[0], (memoryview(message.data),))

    def to_proto(self) -> tensor_pb2.Tensor:
        return tensor_pb2.Tensor(dtype=self.dtype, shape=[self.num_rows, self.row_width], data=b"".join(self.segments))

    def chunks(self, max_message_bytes: int) -> Iterator[tensor_pb2.TensorChunk]:
        """Row chunks, each under ``max_message_bytes``; at least one chunk."""
        budget = max_message_bytes - CHUNK_HEADROOM_BYTES
        if self.row_bytes > budget:
            raise InvalidRequest(f"one row of {self.row_bytes} bytes exceeds the {max_message_bytes}-byte message limit")
        rows_per_chunk = budget // max(1, self.row_bytes)
        for start in range(0, max(self.num_rows, 1), rows_per_chunk):
            rows = self[start : start + rows_per_chunk].to_proto()
            yield tensor_pb2.TensorChunk(rows=rows, row_offset=start, total_rows=self.num_rows)


Features = Union["torch.Tensor", WireRows]  # [rows, 3 * target hidden]: a tensor in process, bytes relayed


def concat_rows(parts: Sequence[Features]) -> Features:
    """One block of the rows of ``parts`` (all of one kind); a single part is returned as it is."""
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], WireRows):
        return WireRows.concat(parts)  # type: ignore[arg-type]
    import torch  # tensors come from an in-process target only, where torch is loaded

    return torch.cat(list(parts))


def wire_rows(features: Features) -> WireRows:
    """The rows as they travel: relayed rows as they are, a tensor encoded."""
    if isinstance(features, WireRows):
        return features
    from diffspec.tensor_wire import rows_from_tensor  # a tensor exists only where torch is loaded

    return rows_from_tensor(features)


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
        self._parts: list[WireRows] = []  # in row order

    @property
    def complete(self) -> bool:
        return bool(self._parts) and self.rows_done == self.total_rows

    def add(self, chunk: tensor_pb2.TensorChunk) -> None:
        if chunk.total_rows != self.total_rows or chunk.row_offset != self.rows_done:
            raise InvalidRequest(
                f"feature chunk at row {chunk.row_offset} of {chunk.total_rows}; "
                f"expected row {self.rows_done} of {self.total_rows}"
            )
        shape = tuple(chunk.rows.shape)
        if self.row_width is None and len(shape) == 2:
            self.row_width = shape[1]
        if len(shape) != 2 or shape[1] != self.row_width or self.rows_done + shape[0] > self.total_rows:
            raise InvalidRequest(
                f"feature chunk of shape {shape} does not fit [{self.total_rows}, {self.row_width}] at row {self.rows_done}"
            )
        rows = WireRows.from_proto(chunk.rows)
        if self._parts and rows.dtype != self._parts[0].dtype:
            raise InvalidRequest(f"feature chunk of dtype {rows.dtype} after chunks of {self._parts[0].dtype}")
        self._parts.append(rows)
        self.rows_done += rows.num_rows

    def rows(self) -> WireRows:
        if not self.complete:
            raise InvalidRequest(f"features incomplete: {self.rows_done} of {self.total_rows} rows arrived")
        return WireRows.concat(self._parts)
