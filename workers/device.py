"""Device and dtype choice: `--dtype auto` is bfloat16 on CUDA and on CPUs with native
bfloat16 arithmetic (AVX512-BF16, AMX, Arm BF16), else float32."""

from __future__ import annotations

import platform
from functools import lru_cache

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but CUDA is not available")
    return dev


@lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return platform.machine() == "arm64"  # Apple silicon (M2+) has BF16
    return any(f in flags.split() for f in ("avx512_bf16", "amx_bf16", "bf16"))


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda" or cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]
