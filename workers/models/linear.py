"""How a model multiplies activations by weights on a given device and dtype.

The kernel also decides the layout weights are stored in, because on CPUs layout matters:
  - float32 on CPU: weights stored transposed, [in, out]. MKL's matrix-vector product over
    that layout streams at memcpy speed (~22 GB/s here) against ~13 GB/s for the [out, in]
    layout torch's F.linear uses, and batch-1 decode is nothing but matrix-vector products.
  - bfloat16 on a CPU without BF16 instructions: [out, in]; one row runs torch's bf16 GEMV
    (fast, memory-bound), several rows run as float32 arithmetic on the bfloat16 operands
    rounded back to bfloat16 (what a native BF16 GEMM does: fp32 accumulation), because
    torch's own bf16 GEMM there is ~6x slower.
  - everything else (CUDA, CPUs with native BF16): F.linear on [out, in].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.device import cpu_has_native_bf16


class LinearKernel:
    transposed = False
    compute_dtype: torch.dtype | None = None  # dtype attention should compute in

    def prepare(self, w: torch.Tensor) -> torch.Tensor:
        """Weight [out, in] -> the stored layout."""
        return w.t().contiguous() if self.transposed else w.contiguous()

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None):
        return F.linear(x, w, b)

    def embed(self, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of an embedding matrix stored with `prepare`."""
        if self.transposed:
            return w.index_select(1, ids).t()
        return F.embedding(ids, w)


class CpuFloat32Kernel(LinearKernel):
    transposed = True

    def __call__(self, x, w, b=None):
        return torch.mm(x, w) if b is None else torch.addmm(b, x, w)


class CpuEmulatedBf16Kernel(LinearKernel):
    compute_dtype = torch.float32

    def __call__(self, x, w, b=None):
        if x.shape[0] == 1:
            return F.linear(x, w, b)
        return F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)


def pick_kernel(dtype: torch.dtype, device: torch.device) -> LinearKernel:
    if device.type == "cpu" and dtype == torch.float32:
        return CpuFloat32Kernel()
    if device.type == "cpu" and dtype == torch.bfloat16 and not cpu_has_native_bf16():
        return CpuEmulatedBf16Kernel()
    return LinearKernel()
