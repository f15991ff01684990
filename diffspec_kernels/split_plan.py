"""The launch plan of a split-KV attention kernel: its tiles, and how many splits each row's keys are cut into.

Both attention kernels here (``diffspec_kernels.tree_attention_triton``, ``diffspec_kernels.draft_attention_triton``) launch a grid
(row tiles, parts, sequences x kv heads). A program owns one tile of the query rows of one (sequence, kv head), a
row being one query and one query head of that kv head's group, and one part of its keys: splits 0 ..
num_splits - 1 take equal shares of the committed keys with no mask, and a kernel may add a masked part of new
keys after them. A plan depends only on shapes, never on the live lengths (read on the device), so a padded
bucket keeps one plan and a CUDA graph can capture the call.

The tiles were measured for tree attention on an H200 at the Llama-3.1-8B shape (bf16 x head_dim 128: 256-byte
rows; L = 64K, bench/kernels.py --sweep). Rows k times as wide (fp32, head_dim 256) get tiles k times smaller,
so the q tile and two stages of key and value tiles still fit an H200's 227 KB of shared memory. A chip with
less shared memory per program (AMD's 64 KiB of LDS) gets key tiles that fit it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

# Split heuristic: enough programs to fill the chip, no split shorter than this many keys.
_PROGRAMS_PER_SM = 2
_MIN_KEYS_PER_SPLIT = 256
_MAX_SPLITS = 64
_TUNED_ROW_BYTES = 256  # bytes of a q/k/v row (bf16 x head_dim 128) the tiles were measured at
TUNED_SHARED_MEMORY_BYTES = 232448  # an H200's shared memory per program (227 KiB), which the tiles were measured in
# 128-key tiles of 256-byte rows (under 128 query rows) need 66-68 KiB, 64-key tiles 40 KiB: compiled for gfx942
# with the alignment a launch has (tests/diffspec_kernels/test_rocm_compile.py)
_SHARED_BYTES_OF_128_KEYS = 70 * 1024


@dataclass(frozen=True)
class SplitKVPlan:
    """How a split-KV partials kernel is launched; fixed for a padded batch bucket."""

    block_m: int  # query rows (queries x query heads of one kv head) per program, >= 16 for tl.dot
    block_n: int  # keys per inner-loop tile, >= 16 for tl.dot
    num_splits: int  # programs along the committed keys per (sequence, kv head, row tile)
    num_warps: int
    num_stages: int


@functools.lru_cache(maxsize=None)
def shared_memory_bytes(device: torch.device) -> int:
    """Shared memory (LDS on ROCm) one program may use, which bounds a plan's tiles: what Triton checks a
    launch against (the opt-in maximum on NVIDIA; torch reports only the 48 KiB default there)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]
    return TUNED_SHARED_MEMORY_BYTES  # the Triton interpreter on CPU: the plans of the GPU they were tuned on


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors (CUs on ROCm) a plan fills; any value is correct, it only sizes the splits."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # the Triton interpreter on CPU


def plan_split_kv(
    *,
    num_seqs: int,
    num_kv_heads: int,
    rows: int,  # query rows per (sequence, kv head): queries x group
    num_keys: int,  # committed keys per sequence that the splits share: the capacity, not the live lengths
    masked_parts: int,  # parts beside the splits: 1 for a masked part of new keys, 0 without one
    head_dim: int,
    row_bytes: int,  # bytes of a q/k/v row the tiles are sized for: head_dim x element size, or more
    num_sms: int,
    shared_bytes: int = TUNED_SHARED_MEMORY_BYTES,  # shared memory one program may use (``shared_memory_bytes``)
) -> SplitKVPlan:
    shrink = max(1, row_bytes // _TUNED_ROW_BYTES)
    # Past 128 rows, one 256-row tile over 16 warps reads the keys once instead of once per 128-row tile; it
    # fills an SM's registers, so one program per SM. Measured at T = 64: 221 us against 263 us for two 128-row
    # tiles. With wider rows it would not fit shared memory (fp32 at head_dim 128: 257 KB).
    wide = rows > 128 and shrink == 1
    block_m = 256 if wide else max(16, min(128 // max(1, shrink // 2), triton.next_power_of_2(rows)))
    # Keys per tile and warps, measured at the tuned rows: 64-row and 128-row tiles take 64 keys over 4 warps
    # where head_dim >= 128 (T = 32 at 64K: 118.8 us against 128.6 us for 128 keys over 8 warps), other tiles
    # 128 keys; the 256-row tile 64 keys over 16 warps.
    tuned_narrow = shrink == 1 and block_m in (64, 128) and head_dim >= 128
    if wide or tuned_narrow:
        block_n = 64
    else:
        block_n = 128 if shrink == 1 and shared_bytes >= _SHARED_BYTES_OF_128_KEYS else max(16, 64 // shrink)
    num_warps = 16 if wide else 8 if block_m >= 128 and not tuned_narrow else 4
    programs_per_split = max(1, num_seqs * num_kv_heads * triton.cdiv(rows, block_m))
    num_splits = min(
        ((1 if wide else _PROGRAMS_PER_SM) * num_sms) // programs_per_split - masked_parts,  # no straggler wave
        triton.cdiv(max(num_keys, 1), _MIN_KEYS_PER_SPLIT),
        _MAX_SPLITS,
    )
    # Two stages beat three or four everywhere (less shared memory, more programs resident).
    return SplitKVPlan(
        block_m=block_m,
        block_n=block_n,
        num_splits=max(1, num_splits),
        num_warps=num_warps,
        num_stages=2,
    )
