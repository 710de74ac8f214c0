"""AMD: the Triton kernels on gfx942 (MI300X) and gfx950 (MI350X/MI355X), with the gfx
arch probed from the device. Everything AMD-specific (which architectures, wave64 tile
sizes and occupancy) is here."""

from __future__ import annotations

from .triton.backend import CompiledTritonBackend
from .triton.launch import GemmConfig, TileConfig

# Element-wise kernels, from the gfx942 / gfx950 compile matrix
# (benchmarks/NOTES-elementwise.md): wave64, so 4 warps are 256 lanes, and an occupancy of
# 8 waves a SIMD needs 64 VGPRs or fewer. 8 x 256 tiles give a lane 4 words (8 elements,
# 16-byte loads) and share a 32-block among 4 lanes (cross-lane reductions): quantize in
# 30-58 VGPRs, occupancy 8 (one whole block a lane, the NVIDIA layout, would need over
# 100 VGPRs here). Stochastic rounding with outliers and macro blocks needs 76-79 VGPRs
# there under triton 3.6: "quantize-heavy" takes 4 x 256 (2 words a lane) with
# waves_per_eu=8, 64 VGPRs, no scratch, occupancy 8 with triton 3.6 and 3.9. dequantize 26-48 VGPRs, occupancy 8. decompose: 8 x
# 256 on 8 warps, 2 words a lane: 46-64 VGPRs on gfx950. gfx942 allocates more: its
# statistics-only decompose takes 4 x 256 on 4 warps (48-52 VGPRs, occupancy 8, no
# scratch; the waves_per_eu=8 it had gained nothing and spilled 48-92 bytes a thread where
# a row stride was not a multiple of 16 words, which decompose no longer launches); with
# the element tensors the hint spills under triton 3.6, so
# it keeps 8 x 256 / 8 warps without it (occupancy 8 but for macro blocks longer than a
# chunk: 7 with triton 3.9, 5 with 3.6; the notes say why and what would fix it).
# Elsewhere no waves_per_eu hint: waves_per_eu=2 capped the occupancy at 2 without
# lowering VGPRs.
TILES = {
    "quantize": TileConfig(8, 256, num_warps=4),
    "quantize-heavy": TileConfig(4, 256, num_warps=4, extra=(("waves_per_eu", 8),)),
    "dequantize": TileConfig(16, 256, num_warps=4),
    "decompose": TileConfig(8, 256, num_warps=8),
    "decompose-full": TileConfig(8, 256, num_warps=8),
}
TARGET_TILES = {"gfx942": {"decompose": TileConfig(4, 256, num_warps=4)}}

# GEMM defaults per target until a tuned config is found (issue 5); block_m counts tokens,
# block_n weight rows. gfx950's native v_mfma_scale_f32_{16x16x128,32x32x64}_f8f6f4 needs
# kpack=1 and matrix_instr_nonkdim 16 or 32. gfx942 has no tl.dot_scaled lowering with
# Triton 3.6 ("Unsupported DotScaleOp"): every launch there is the upcast kernel
# (gemm_upcast.py, canonical layout, decode in registers, tl.dot in bf16 or fp16, the
# tokens on the MFMA's N). split_k=0 (small M): as many programs per output tile as fill
# the GPU. "w4a16-pair" (fp16 tokens times the weight's outliers, as two bf16 parts: two
# more MFMAs a K step): the prefill tiles above spilled with them (compile matrix,
# triton 3.6: gfx942 128 bytes of scratch per lane at 64x128x128, gfx950 480 at
# 128x128x128); these compile with none (gfx942 256 VGPRs, gfx950 242).
_AMD = (("kpack", 1), ("matrix_instr_nonkdim", 16))
GEMM_TILES = {
    "gfx950": {
        "a4w4": GemmConfig(128, 128, 256, num_warps=8, num_stages=2, extra=_AMD),
        "a4w4-heavy": GemmConfig(64, 64, 128, num_warps=4, num_stages=2, extra=_AMD),
        "a4w4-small": GemmConfig(16, 64, 256, num_warps=4, num_stages=2, extra=_AMD, split_k=0),
        "w4a16": GemmConfig(128, 128, 128, num_warps=8, num_stages=2, extra=_AMD),
        "w4a16-pair": GemmConfig(64, 128, 128, num_warps=8, num_stages=2, extra=_AMD),
        "w4a16-small": GemmConfig(16, 64, 256, num_warps=4, num_stages=2, extra=_AMD, split_k=0),
    },
    "gfx942": {
        "a4w4": GemmConfig(128, 128, 128, num_warps=8, num_stages=2, extra=_AMD),
        "a4w4-heavy": GemmConfig(64, 64, 128, num_warps=4, num_stages=2, extra=_AMD),
        "a4w4-small": GemmConfig(16, 64, 256, num_warps=4, num_stages=2, extra=_AMD, split_k=0),
        "w4a16": GemmConfig(128, 128, 128, num_warps=8, num_stages=2, extra=_AMD),
        "w4a16-heavy": GemmConfig(64, 128, 128, num_warps=8, num_stages=2, extra=_AMD),
        "w4a16-pair": GemmConfig(64, 64, 128, num_warps=4, num_stages=2, extra=_AMD),
        "w4a16-small": GemmConfig(16, 64, 256, num_warps=4, num_stages=2, extra=_AMD, split_k=0),
    },
}


class RocmBackend(CompiledTritonBackend):
    name = "rocm"
    priority = 100
    tiles = TILES
    target_tiles = TARGET_TILES
    gemm_tiles = GEMM_TILES
    # the grouped GEMM's fp16 tokens times OF weights with MBS spilled 32 bytes a lane on
    # gfx950's dense pair tile (K 128) under triton 3.9; K 64 compiles clean under 3.6 and 3.9
    grouped_tiles = {"gfx950": {"w4a16-pair": GemmConfig(64, 128, 64, num_warps=8, num_stages=2, extra=_AMD)}}
    scale_layouts = {"gfx950": "cdna4"}
    gemm_sms = {"gfx942": 304, "gfx950": 256}
    targets = ("gfx942", "gfx950")
