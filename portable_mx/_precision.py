"""Matmul precision control shared by the reference backend and the high-precision
backward GEMM: torch's fp32 matmuls in full fp32, never TF32 or bf16 internally."""

from __future__ import annotations

import torch


class HighestPrecision:
    """Context: fp32 matmuls in full fp32 (no TF32) while inside."""

    def __enter__(self) -> None:
        self._prev = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")

    def __exit__(self, *exc) -> None:
        torch.set_float32_matmul_precision(self._prev)
