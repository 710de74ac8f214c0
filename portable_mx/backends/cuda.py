"""NVIDIA: the Triton kernels on sm_90 (H100/H200), sm_100 (B200/GB200) and sm_120
(RTX 50), with the compute capability probed from the device. Everything NVIDIA-specific
(which architectures, tile sizes and warps per program) is here."""

from __future__ import annotations

from typing import Optional

import torch

from .targets import Target, probe
from .triton import mode_problem
from .triton.backend import TritonBackend
from .triton.launch import TileConfig

# Element-wise kernels, sized from the sm_90 compile matrix (registers per thread, no
# spills): 8 x 256 tiles on 4 warps hold 16 elements a thread in about 64 registers;
# recipes with Philox draws or outlier search get 8 warps (8 elements a thread), and
# decompose, which keeps x, Q and three components live, 4 rows on 8 warps.
TILES = {
    "quantize": TileConfig(8, 256, num_warps=4),
    "quantize-heavy": TileConfig(8, 256, num_warps=8),
    "dequantize": TileConfig(16, 256, num_warps=4),
    "decompose": TileConfig(4, 256, num_warps=8),
}


class CudaBackend(TritonBackend):
    name = "cuda"
    priority = 100
    tiles = TILES
    targets = ("sm_90", "sm_100", "sm_120")

    def unavailable_reason(self, device: torch.device) -> Optional[str]:
        target, why = probe(device)
        if target is None:
            return why
        if target.vendor != "nvidia":
            return f"{target.name} is an AMD GPU (the rocm backend serves it)"
        return mode_problem(interpreted=False)

    def target(self, device: torch.device) -> Optional[Target]:
        return probe(device)[0]

    def path(self, device: torch.device, op: str) -> str:
        return "native"
