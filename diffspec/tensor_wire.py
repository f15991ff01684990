"""Torch tensors <-> the bytes they travel as, for the services (the gateway relays bytes only).

Every dtype is moved as a byte view (``uint8``), so bfloat16, which numpy cannot hold, takes the
same path as float32. A bad message raises ``InvalidRequest``, never a crash.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch

from diffspec.errors import InvalidRequest
from diffspec.feature_rows import DTYPE_SIZES, WireRows
from diffspec.v1 import tensor_pb2

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
assert set(DTYPES) == set(DTYPE_SIZES)


def _dtype_name(tensor: torch.Tensor) -> str:
    if tensor.dtype not in _NAMES:
        raise InvalidRequest(f"dtype {tensor.dtype} cannot travel; supported: {sorted(DTYPES)}")
    return _NAMES[tensor.dtype]


def _raw_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def tensor_to_proto(tensor: torch.Tensor) -> tensor_pb2.Tensor:
    return tensor_pb2.Tensor(dtype=_dtype_name(tensor), shape=list(tensor.shape), data=_raw_bytes(tensor))


def tensor_from_proto(message: tensor_pb2.Tensor) -> torch.Tensor:
    """A CPU tensor that owns its memory (the message can be dropped)."""
    dtype = DTYPES.get(message.dtype)
    if dtype is None:
        raise InvalidRequest(f"unknown tensor dtype {message.dtype!r}; supported: {sorted(DTYPES)}")
    shape = tuple(message.shape)
    if any(d < 0 for d in shape):
        raise InvalidRequest(f"negative tensor dimension in shape {shape}")
    needed = math.prod(shape) * DTYPE_SIZES[message.dtype]
    if needed != len(message.data):
        raise InvalidRequest(f"tensor of shape {shape} and dtype {message.dtype} needs {needed} bytes, got {len(message.data)}")
    if not message.data:
        return torch.empty(shape, dtype=dtype)
    raw = torch.from_numpy(np.frombuffer(message.data, dtype=np.uint8).copy())
    return raw.view(dtype).reshape(shape)


def rows_from_tensor(tensor: torch.Tensor) -> WireRows:
    """``[rows, width]`` -> its bytes on the host (one copy)."""
    if tensor.ndim != 2:
        raise InvalidRequest(f"feature rows of shape {tuple(tensor.shape)}; expected [rows, width]")
    name = _dtype_name(tensor)
    return WireRows(name, tensor.shape[1], tensor.shape[0], (memoryview(_raw_bytes(tensor)),))


def rows_to_tensor(rows: WireRows) -> torch.Tensor:
    """A CPU ``[num_rows, row_width]`` tensor that owns its memory (one copy of the bytes), allocated by
    torch: the draft's steps over a tensor that wraps a Python buffer (``torch.frombuffer``) measured an
    order of magnitude slower on CPU."""
    tensor = torch.empty((rows.num_rows, rows.row_width), dtype=DTYPES[rows.dtype])
    raw = tensor.view(-1).view(torch.uint8).numpy()
    offset = 0
    for segment in rows.segments:
        raw[offset : offset + len(segment)] = np.frombuffer(segment, dtype=np.uint8)
        offset += len(segment)
    return tensor


def split_rows(tensor: torch.Tensor, max_message_bytes: int) -> Iterator[tensor_pb2.TensorChunk]:
    """Row chunks of ``tensor`` ([rows, width]), each under ``max_message_bytes``; at least one chunk."""
    return rows_from_tensor(tensor).chunks(max_message_bytes)
