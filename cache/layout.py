"""Capacity arithmetic: how many bytes a token of KV cache costs, and how many blocks fit.

Pure Python (no torch): the batch policy, the `plan` command and the engine all size the
cache with this one piece of code, so the pool the engine allocates is what it predicts.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

# Bytes per stored element for each KV storage dtype name.
DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "tb": 10**12,
}


def parse_bytes(text: str | int) -> int:
    """Parse '512MiB', '1.5GiB', '2GB', '1048576' into a byte count (GiB = 2**30)."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"byte count must be >= 0, got {text}")
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot parse a byte size from {text!r} (try 512MiB, 2GiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


@dataclass(frozen=True)
class KVLayout:
    """Shape of the paged KV cache of one worker: what a block holds and what it costs."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int = 16

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}; one of {sorted(DTYPE_BYTES)}")

    @property
    def element_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) x layers x KV heads x head dim x bytes per element."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.element_bytes

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """One block of one layer's K (or V): block_size, KV heads, head dim."""
        return (self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def num_blocks_for_budget(self, budget_bytes: int) -> int:
        n = budget_bytes // self.bytes_per_block
        if n < 1:
            raise ValueError(
                f"KV budget {format_bytes(budget_bytes)} is smaller than one block "
                f"({self.bytes_per_block} bytes)"
            )
        return n

    def pool_bytes(self, num_blocks: int) -> int:
        return num_blocks * self.bytes_per_block
