"""NVIDIA: the Triton kernels on sm_90 (H100/H200), sm_100 (B200/GB200) and sm_120
(RTX 50), with the compute capability probed from the device. Everything NVIDIA-specific
(which architectures, tile sizes and warps per program) is here."""

from __future__ import annotations

from .triton.backend import CompiledTritonBackend
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


class CudaBackend(CompiledTritonBackend):
    name = "cuda"
    priority = 100
    tiles = TILES
    targets = ("sm_90", "sm_100", "sm_120")
