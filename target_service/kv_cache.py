"""The tensors behind the paged KV pool: one K and one V page array per layer.

``PagedKVPool`` decides which page a token lives in; this class only moves bytes: scatter new
tokens' keys/values into their slots and apply copy-on-write page copies.
"""

from __future__ import annotations

import torch

from target_service.checkpoint import LlamaConfig
from target_service.kv_pool import PageCopy


class PagedKVCache:
    def __init__(
        self, config: LlamaConfig, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        shape = (config.num_layers, num_pages, page_size, config.num_kv_heads, config.head_dim)
        self.k_pages = torch.zeros(shape, dtype=dtype, device=device)  # [layers, pages, page_size, kv_heads, head_dim]
        self.v_pages = torch.zeros(shape, dtype=dtype, device=device)
        self.page_size = page_size

    def write(self, slots: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor) -> None:
        """slots [n] int64 (page * page_size + offset); new_k/new_v [layers, n, kv_heads, head_dim]."""
        flat_k = self.k_pages.view(self.k_pages.shape[0], -1, *self.k_pages.shape[3:])
        flat_v = self.v_pages.view(self.v_pages.shape[0], -1, *self.v_pages.shape[3:])
        flat_k[:, slots] = new_k
        flat_v[:, slots] = new_v

    def apply_copies(self, copies: list[PageCopy]) -> None:
        """Copy-on-write: duplicate shared pages before a sequence writes into its private copy."""
        if not copies:
            return
        src = torch.tensor([c.src_page for c in copies], device=self.k_pages.device)
        dst = torch.tensor([c.dst_page for c in copies], device=self.k_pages.device)
        self.k_pages[:, dst] = self.k_pages[:, src]
        self.v_pages[:, dst] = self.v_pages[:, src]
