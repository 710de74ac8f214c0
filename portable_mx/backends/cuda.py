"""NVIDIA: the Triton kernels on sm_90 (H100/H200), sm_100 (B200/GB200) and sm_120
(RTX 50), with the compute capability probed from the device. Everything NVIDIA-specific
(which architectures, tile sizes and warps per program) is here."""

from __future__ import annotations

from .triton.backend import CompiledTritonBackend
from .triton.launch import GemmConfig, TileConfig

# Element-wise kernels (quantize, dequantize, decompose), from the sm_90 compile matrix
# (benchmarks/NOTES-elementwise.md; to be confirmed by benchmarks/sweeps/elementwise_sweep.py
# on a GPU). 16 x 256 on 4 warps gives each thread one whole 32-block: quantize in 64
# registers (stochastic rounding 118, MBS-128 77, two outliers with MBS and stochastic
# rounding 138: 4 to 8 CTAs an SM, 32 KB or more of loads in flight), the
# statistics-only decompose in about 220 (a block's values all live, no shuffles; 2 CTAs
# an SM, compute-bound), no spills. decompose with its four element tensors spreads a
# block over 8 threads (16-byte stores of each tensor): 8 x 256 on 8 warps keeps it at
# 78-134 registers (8 x 256 on 4 warps spilled the heaviest recipe). dequantize: 8
# elements a thread and vector, 16 x 256: 32 registers for bf16 output, 40 for fp32 (32 x
# 256 took 44 and 112).
TILES = {
    "quantize": TileConfig(16, 256, num_warps=4),
    "quantize-heavy": TileConfig(16, 256, num_warps=4),
    "dequantize": TileConfig(16, 256, num_warps=4),
    "decompose": TileConfig(16, 256, num_warps=4),
    "decompose-full": TileConfig(8, 256, num_warps=8),
}

# GEMM defaults per target until a tuned config is found (issue 5). The native
# block-scaled MMA of sm_100 (tcgen05 ... block_scale) needs an M tile of at least 128 and
# 4 or 8 warps; sm_120's mma.sync ... block_scale has ~100 KB of shared memory per SM;
# sm_90 upcasts MXFP4 to bf16 in registers and runs wgmma, where W4A16 is the fast path.
# Small M (decode): narrow N tiles and deep K steps keep every SM streaming the weight.
# "-heavy" (MBS or OF operands) tiles are the largest of the sweep that spill no
# registers with outliers on both sides (compile matrix, ptxas -v).
GEMM_TILES = {
    "sm_100": {
        "a4w4": GemmConfig(128, 128, 256, num_warps=8, num_stages=3),
        "a4w4-heavy": GemmConfig(128, 64, 64, num_warps=8, num_stages=2),
        "a4w4-small": GemmConfig(128, 64, 256, num_warps=4, num_stages=4),
        "a4w4-small-heavy": GemmConfig(128, 64, 64, num_warps=8, num_stages=2),
        "w4a16": GemmConfig(128, 128, 128, num_warps=8, num_stages=3),
        "w4a16-heavy": GemmConfig(128, 64, 128, num_warps=8, num_stages=2),
        "w4a16-small": GemmConfig(16, 64, 256, num_warps=4, num_stages=4),
        "w4a16-small-heavy": GemmConfig(16, 64, 128, num_warps=4, num_stages=3),
    },
    "sm_120": {
        "a4w4": GemmConfig(128, 64, 128, num_warps=4, num_stages=2),
        "a4w4-heavy": GemmConfig(64, 32, 64, num_warps=4, num_stages=2),
        "a4w4-small": GemmConfig(16, 64, 256, num_warps=4, num_stages=3),
        "a4w4-small-heavy": GemmConfig(16, 64, 128, num_warps=4, num_stages=2),
        "w4a16": GemmConfig(128, 64, 128, num_warps=8, num_stages=2),
        "w4a16-heavy": GemmConfig(64, 64, 64, num_warps=4, num_stages=2),
        "w4a16-small": GemmConfig(16, 64, 256, num_warps=4, num_stages=3),
        "w4a16-small-heavy": GemmConfig(16, 64, 128, num_warps=4, num_stages=2),
    },
    "sm_90": {
        "a4w4": GemmConfig(128, 128, 128, num_warps=8, num_stages=3),
        "a4w4-heavy": GemmConfig(128, 64, 64, num_warps=8, num_stages=2),
        "a4w4-small": GemmConfig(16, 64, 256, num_warps=4, num_stages=4),
        "a4w4-small-heavy": GemmConfig(16, 64, 128, num_warps=4, num_stages=3),
        "w4a16": GemmConfig(128, 64, 128, num_warps=8, num_stages=3),
        "w4a16-small": GemmConfig(16, 64, 256, num_warps=4, num_stages=4),
        "w4a16-small-heavy": GemmConfig(16, 64, 128, num_warps=4, num_stages=3),
    },
}


class CudaBackend(CompiledTritonBackend):
    name = "cuda"
    priority = 100
    tiles = TILES
    gemm_tiles = GEMM_TILES
    scale_layouts = {"sm_100": "blackwell"}
    targets = ("sm_90", "sm_100", "sm_120")
