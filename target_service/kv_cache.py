"""The tensors behind the paged KV pool: one K and one V page array per layer.

``PagedKVPool`` decides which page a token lives in; this class only moves bytes: scatter new
tokens' keys/values into their slots (the KV-commit kernel on a GPU, its reference elsewhere)
and apply copy-on-write page copies.
"""

from __future__ import annotations

from typing import Callable

import torch

from diffspec.devices import upload

from diffspec_kernels.kv_commit_ref import kv_commit_reference
from diffspec_kernels.dispatch import triton_kernels_on
from diffspec.model_config import LlamaConfig
from target_service.kv_pool import PageCopy

KVCommit = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def _kv_commit_for(device: torch.device) -> KVCommit:
    if not triton_kernels_on(device):
        return kv_commit_reference
    from diffspec_kernels.kv_commit_triton import kv_commit_triton

    return kv_commit_triton


class PagedKVCache:
    def __init__(
        self, config: LlamaConfig, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        shape = (config.num_layers, num_pages, page_size, config.num_kv_heads, config.head_dim)
        self.k_pages = torch.zeros(shape, dtype=dtype, device=device)  # [layers, pages, page_size, kv_heads, head_dim]
        self.v_pages = torch.zeros(shape, dtype=dtype, device=device)
        self.page_size = page_size
        self._commit = _kv_commit_for(torch.device(device))

    def write(self, new_k: torch.Tensor, new_v: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Rows ``rows`` of new_k/new_v [layers, tokens, kv_heads, head_dim] into flat slots (page * page_size + offset)."""
        self._commit(self.k_pages, self.v_pages, new_k, new_v, rows, slots)

    def apply_copies(self, copies: list[PageCopy]) -> None:
        """Copy-on-write: duplicate shared pages before a sequence writes into its private copy."""
        if not copies:
            return
        src = upload(torch.tensor([c.src_page for c in copies], dtype=torch.int64), self.k_pages.device)
        dst = upload(torch.tensor([c.dst_page for c in copies], dtype=torch.int64), self.k_pages.device)
        self.k_pages[:, dst] = self.k_pages[:, src]
        self.v_pages[:, dst] = self.v_pages[:, src]
