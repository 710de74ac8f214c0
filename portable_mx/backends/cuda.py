"""NVIDIA: the Triton kernels on sm_90 (H100/H200), sm_100 (B200/GB200) and sm_120
(RTX 50), with the compute capability probed from the device. Everything NVIDIA-specific
(which architectures, tile sizes and warps per program) is here."""

from __future__ import annotations

import dataclasses
import functools

import torch

from .triton.backend import CompiledTritonBackend
from .triton.launch import GemmConfig, TileConfig

# Element-wise kernels (quantize, dequantize, decompose), from the sm_90 compile matrix
# (benchmarks/NOTES-elementwise.md; to be confirmed by benchmarks/sweeps/elementwise_sweep.py
# on a GPU). 16 x 256 on 4 warps gives each thread one whole 32-block: quantize in 64
# registers (stochastic rounding 122, MBS-128 80, two outliers 79, two outliers with MBS
# and stochastic rounding 101: 4 to 8 CTAs an SM, 32 KB or more of loads in flight), the
# statistics-only decompose in about 220 (a block's values all live, no shuffles; 2 CTAs
# an SM, compute-bound), no spills. decompose with its four element tensors spreads a
# block over threads that reduce it together (the words loaded as a plain [rows, words]
# tile: decompose._load_words says why): 8 x 256 on 8 warps keeps it at 78-134 registers
# (8 x 256 on 4 warps spilled the heaviest recipe; registers as measured before the load
# change of 2026-11-26, which the compile matrix still passes without spills). dequantize:
# 16 x 256, VEC code bytes a thread (one 16-byte store): 32 registers to bf16, 42 to fp32,
# up to 79 with macro factors and two outliers (sm_90), no spills.
TILES = {
    "quantize": TileConfig(16, 256, num_warps=4),
    "quantize-heavy": TileConfig(16, 256, num_warps=4),
    "dequantize": TileConfig(16, 256, num_warps=4),
    "decompose": TileConfig(16, 256, num_warps=4),
    "decompose-full": TileConfig(8, 256, num_warps=8),
}

# sm_90, measured (benchmarks/results/nvidia-h200-2026-11-26b/, element-wise sweep, H200,
# 8192 x 8192 bf16 against a device copy): the plain quantize at two 32-blocks a thread
# moves its bytes faster, 0.77 of copy at 32 x 256 on 4 warps against 0.70 at 16 x 256
# (16 x 256 on 2 warps 0.75, 64 x 256 on 8 warps 0.75: the same two blocks a thread); MBS
# at two blocks a thread is slower (0.47 and 0.33 against 0.51), so it keeps one.
# The masked variant (ragged tiles) of a stochastic quantize names ptxas' ceiling (255):
# without it ptxas held the heaviest recipe (stochastic, MBS-256, OF-2) at 128 registers
# with an 8-byte spill under triton 3.6; with it 105 and none, stochastic alone 126 -> 118
# (with outliers only, the ceiling would cost registers: 72 -> 96, 79 -> 102; not taken).
# NOTES-elementwise.md section 12.
TARGET_TILES = {
    "sm_90": {
        "quantize": TileConfig(32, 256, num_warps=4),
        "quantize-macro": TileConfig(16, 256, num_warps=4),
        "quantize-stochastic-masked": TileConfig(16, 256, num_warps=4, extra=(("maxnreg", 255),)),
    },
}

# GEMM defaults per target until a tuned config is found (issue 5); block_m counts tokens
# (the left operand's rows), block_n weight rows. sm_100's native block-scaled MMA
# (tcgen05 ... block_scale) needs an M tile of at least 128 and 4 or 8 warps; sm_120's
# mma.sync ... block_scale has ~100 KB of shared memory per SM. split_k=0 ("-small",
# "-mid"): as many programs per output tile as fill the GPU (backend.resolve_split_k), the
# decode path; prefill tiles do not split (M > 128 gives enough tiles).
#
# sm_90 runs the upcast kernel (gemm_upcast.py) on the hopper value layout: the decoded
# weight is wgmma's register operand, the tokens its N (16 at decode). Prefill 128 tokens
# x 256 weight rows x 128 K on 8 warps, 3 stages (triton_kernels' Hopper choice, 246
# registers, 147 KB of shared memory; no split-K: the combine would spill), M <= 128
# 64 x 256 x 128 with split-K (M = 128: 64 tiles x 2 splits) for A4W4 and 128 x 128 x 128
# (one token tile, the weight decoded once; split-K 2 at M = 128) for W4A16: 40.8 us
# against 46.9 us at M = 128 x 8192^2 on an H200 (benchmarks/results/nvidia-h200-2026-11-26/
# gemm_sweep.json, the same run and weights); decode 16 x 128 x 128 on 4
# warps, 4 stages, a tile shape whose wgmma chain ptxas (CUDA 12.8, the one Triton 3.6
# ships) does not serialize (C7515 in `ptxas -v`; benchmarks/NOTES-gemm.md). "-heavy"
# (MBS, OF) tiles are the largest that spill no registers with outliers and macro factors on
# both sides under Triton 3.6 and 3.9 (compile matrix). benchmarks/NOTES-gemm.md has the
# derivation. Other "-heavy" tiles, and sm_100's decode tile (16 x 64 x 128), are sized
# the same way.
GEMM_TILES = {
    "sm_100": {
        "a4w4": GemmConfig(128, 128, 256, num_warps=8, num_stages=3),
        "a4w4-heavy": GemmConfig(128, 32, 64, num_warps=8, num_stages=2),
        "a4w4-small": GemmConfig(128, 64, 256, num_warps=4, num_stages=4, split_k=0),
        "a4w4-small-heavy": GemmConfig(128, 32, 64, num_warps=8, num_stages=2),
        "w4a16": GemmConfig(128, 128, 128, num_warps=8, num_stages=3),
        "w4a16-heavy": GemmConfig(128, 64, 128, num_warps=8, num_stages=2),
        "w4a16-small": GemmConfig(16, 64, 128, num_warps=4, num_stages=4, split_k=0),
        "w4a16-small-heavy": GemmConfig(16, 64, 128, num_warps=4, num_stages=3),
    },
    "sm_120": {
        "a4w4": GemmConfig(128, 64, 128, num_warps=4, num_stages=2),
        "a4w4-heavy": GemmConfig(64, 32, 64, num_warps=4, num_stages=2),
        "a4w4-small": GemmConfig(16, 64, 256, num_warps=4, num_stages=3, split_k=0),
        "a4w4-small-heavy": GemmConfig(16, 64, 64, num_warps=4, num_stages=2),
        "w4a16": GemmConfig(128, 64, 128, num_warps=8, num_stages=2),
        "w4a16-heavy": GemmConfig(64, 64, 64, num_warps=4, num_stages=2),
        # K steps of 128: with 170 SMs (RTX 5090) the decode splits K in 2, and 16 x 64 x 256
        # then spilled 4 bytes under Triton 3.6 with a bias (168 registers; compile matrix)
        "w4a16-small": GemmConfig(16, 64, 128, num_warps=4, num_stages=3, split_k=0),
        "w4a16-small-heavy": GemmConfig(16, 64, 128, num_warps=4, num_stages=2),
    },
    "sm_90": {
        "a4w4": GemmConfig(128, 256, 128, num_warps=8, num_stages=3),
        "a4w4-mid": GemmConfig(64, 256, 128, num_warps=8, num_stages=3, split_k=0),
        "a4w4-heavy": GemmConfig(64, 64, 64, num_warps=4, num_stages=2),
        "a4w4-small": GemmConfig(16, 128, 128, num_warps=4, num_stages=4, split_k=0),
        "a4w4-small-heavy": GemmConfig(16, 64, 128, num_warps=4, num_stages=3, split_k=0),
        "w4a16": GemmConfig(128, 256, 128, num_warps=8, num_stages=3),
        "w4a16-mid": GemmConfig(128, 128, 128, num_warps=8, num_stages=3, split_k=0),
        "w4a16-heavy": GemmConfig(128, 64, 128, num_warps=8, num_stages=3),
        "w4a16-small": GemmConfig(16, 128, 128, num_warps=4, num_stages=4, split_k=0),
        "w4a16-small-heavy": GemmConfig(16, 64, 128, num_warps=4, num_stages=3, split_k=0),
    },
}


class CudaBackend(CompiledTritonBackend):
    name = "cuda"
    priority = 100
    tiles = TILES
    target_tiles = TARGET_TILES
    gemm_tiles = GEMM_TILES
    scale_layouts = {"sm_100": "blackwell"}
    upcast_layouts = {"sm_90": "hopper"}
    upcast_asm = ("sm_90",)
    gemm_sms = {"sm_90": 132, "sm_100": 148, "sm_120": 170}  # sm_120: RTX 5090, as tuning/cost.py's device
    grouped_min_block_m = {"sm_100": 128}  # tcgen05's block-scaled MMA: M tiles of 128
    # The grouped GEMM's tiles where the dense ones spill with its index vectors, bias and
    # activation (compile matrix): sm_90's prefill 128 x 256 x 128 (8-224 bytes, Triton
    # 3.9) becomes 128 x 128 x 128 (163-190 registers, no serialized wgmma chain); on
    # sm_120 under Triton 3.6, the W4A16 prefill 128 x 64 x 128 (32 bytes with an fp32
    # store) takes K steps of 64 and the heavy decode 16 x 64 x 128 (8 bytes) too
    # "w4a16-pair" (fp16 tokens times the weight's outliers, two more MMAs a K step, with
    # the gather, bias and activation epilogue): the dense tiles spilled 4-48 bytes there
    # (triton 3.6); these compile with none under 3.6 and 3.9
    grouped_tiles = {
        "sm_90": {"a4w4": GemmConfig(128, 128, 128, num_warps=8, num_stages=3),
                  "w4a16": GemmConfig(128, 128, 128, num_warps=8, num_stages=3),
                  "w4a16-pair": GemmConfig(128, 64, 64, num_warps=8, num_stages=3)},
        "sm_100": {"w4a16-pair": GemmConfig(128, 64, 64, num_warps=8, num_stages=3)},
        "sm_120": {"w4a16": GemmConfig(128, 64, 64, num_warps=8, num_stages=2),
                   "w4a16-pair": GemmConfig(64, 32, 64, num_warps=4, num_stages=2),
                   # (the dense decode's K 128 spills with the grouped GEMM's index vectors under 3.6)
                   "w4a16-small": GemmConfig(16, 64, 256, num_warps=4, num_stages=3, split_k=0),
                   "w4a16-small-heavy": GemmConfig(16, 64, 64, num_warps=4, num_stages=2)},
    }
    targets = ("sm_90", "sm_100", "sm_120")

    def launch_config(self, target, a, config: GemmConfig, store: torch.dtype) -> GemmConfig:
        """:meth:`TritonBackend.launch_config`: sm_90's W4A16 decode tile held at
        :data:`HELD_DECODE`'s register cap where it was measured and compiles clean (its
        tile, bf16 tokens and output, a resolved split up to its ``max_split_k``, its
        Triton); a config with options of its own (a tuned one) is left as it is."""
        held = (target is not None and target.name == "sm_90" and a.format is torch.bfloat16
                and store is torch.bfloat16 and not config.extra
                and 1 <= config.split_k <= HELD_DECODE["max_split_k"]
                and (config.block_m, config.block_n, config.block_k, config.num_warps, config.num_stages)
                == HELD_DECODE["tile"] and holds_registers())
        return dataclasses.replace(config, extra=(("maxnreg", HELD_DECODE["maxnreg"]),)) if held else config


HELD_DECODE = {"tile": (16, 128, 128, 4, 4), "max_split_k": 4, "maxnreg": 128, "triton": ((3, 6),)}
"""Where the dense W4A16 decode launches held at ``maxnreg`` registers on sm_90: the tile
(block_m, block_n, block_k, num_warps, num_stages) of "w4a16-small", a 16-bit left operand
of bf16 (W4A16, or tokens the kernel quantizes: A4W4's one-launch decode), a bf16 output,
a resolved split-K of 1 .. ``max_split_k``, and a Triton release of ``triton``. Measured on
an H200 (benchmarks/results/nvidia-h200-2026-11-27b/): 15.4 us against 16.8-16.9 unheld at
1 x 8192^2 (split 4; -8.5%, two calls), 1-2% at M = 16. The bounds are the compile matrix's
(triton 3.6's ptxas, NOTES-gemm "decode tile held"): no spill at splits 1, 2, 4 with a bf16
output, 4 bytes at split 8 and 16, 12 with an fp32 output, and 28-36 bytes under 3.9's
ptxas at split 4; the grouped GEMM's decode tile is not held (not timed held)."""


@functools.lru_cache(maxsize=1)
def holds_registers() -> bool:
    """Whether the installed Triton is one of ``HELD_DECODE["triton"]``."""
    from .triton import triton_version

    return triton_version() in HELD_DECODE["triton"]

