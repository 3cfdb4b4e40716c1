"""How a model multiplies activations by weights on a given device and dtype.

The kernel also decides the layout weights are stored in, because on CPUs layout matters:
  - float32 on CPU with oneDNN: weights reordered once into oneDNN's blocked layout and
    multiplied with its prepacked GEMM, which beats F.linear most at few rows (decode).
  - float32 on CPU without oneDNN: weights stored transposed, [in, out], where MKL's
    matrix-vector product streams faster than over [out, in].
  - bfloat16 on a CPU without BF16 instructions: [out, in]; one row runs torch's bf16 GEMV
    (fast, memory-bound), several rows run as float32 arithmetic on the bfloat16 operands
    rounded back to bfloat16 (what a native BF16 GEMM does: fp32 accumulation), because
    torch's own bf16 GEMM there is several times slower.
  `python -m workers.benchmark` measures the result end to end.
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


class CpuOneDNNFloat32Kernel(LinearKernel):
    BATCH_HINT = 8  # the row count oneDNN tunes the packing for; every count works

    def prepare(self, w: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), self.BATCH_HINT)

    def __call__(self, x, w, b=None):
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, b, "none", [], "")


class CpuFloat32Kernel(LinearKernel):
    transposed = True

    def __call__(self, x, w, b=None):
        return torch.mm(x, w) if b is None else torch.addmm(b, x, w)


class CpuEmulatedBf16Kernel(LinearKernel):
    compute_dtype = torch.float32

    def __init__(self) -> None:
        # One reusable float32 buffer for the widened weight: a fresh 7-113 MB allocation per
        # product would be mmap'd and page-faulted every time.
        self._scratch = torch.empty(0)

    def __call__(self, x, w, b=None):
        if x.shape[0] == 1:
            return F.linear(x, w, b)
        if self._scratch.numel() < w.numel():
            self._scratch = torch.empty(w.numel(), device=w.device)
        wf = self._scratch[: w.numel()].view(w.shape)
        wf.copy_(w)
        return F.linear(x.float(), wf, None if b is None else b.float()).to(x.dtype)


def pick_kernel(dtype: torch.dtype, device: torch.device) -> LinearKernel:
    if device.type == "cpu" and dtype == torch.float32:
        if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                            "_linear_pointwise"):
            return CpuOneDNNFloat32Kernel()
        return CpuFloat32Kernel()
    if device.type == "cpu" and dtype == torch.bfloat16 and not cpu_has_native_bf16():
        return CpuEmulatedBf16Kernel()
    return LinearKernel()
