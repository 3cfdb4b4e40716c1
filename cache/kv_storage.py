"""Torch storage behind the block pool: per-layer K and V tensors in fixed-size blocks.

One allocation holds the whole pool, shaped [layers, 2, blocks, block_size, kv_heads, head_dim],
so its size is exactly `layout.pool_bytes(num_blocks)`.
"""

from __future__ import annotations

import torch

from cache.layout import KVLayout

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class KVCacheStorage:
    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device | str) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        self.tensor = torch.zeros(
            (layout.num_layers, 2, num_blocks, layout.block_size, layout.num_kv_heads,
             layout.head_dim),
            dtype=TORCH_DTYPES[layout.dtype],
            device=self.device,
        )
        # Flat per-layer views indexed by slot = block * block_size + offset.
        slots = num_blocks * layout.block_size
        self._flat = [
            (self.tensor[i, 0].view(slots, layout.num_kv_heads, layout.head_dim),
             self.tensor[i, 1].view(slots, layout.num_kv_heads, layout.head_dim))
            for i in range(layout.num_layers)
        ]

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of layer i, each [num_slots, kv_heads, head_dim]."""
        return self._flat[i]
