"""AMD: the Triton kernels on gfx942 (MI300X) and gfx950 (MI350X/MI355X), with the gfx
arch probed from the device. Everything AMD-specific (which architectures, wave64 tile
sizes and occupancy) is here."""

from __future__ import annotations

from .triton.backend import CompiledTritonBackend
from .triton.launch import GemmConfig, TileConfig

# wave64: 4 warps are 256 lanes. 8 x 256 tiles give 8 elements a lane in 41-56 VGPRs on
# gfx942 (compile matrix), for an occupancy of 8 waves per SIMD. No waves_per_eu hint:
# waves_per_eu=2 capped the occupancy at 2 without lowering VGPRs, which a streaming
# kernel cannot afford (issue 5 tunes it per shape).
TILES = {
    "quantize": TileConfig(8, 256, num_warps=4),
    "quantize-heavy": TileConfig(8, 256, num_warps=4),
    "dequantize": TileConfig(16, 256, num_warps=4),
    "decompose": TileConfig(8, 256, num_warps=8),
}

# GEMM defaults per target until a tuned config is found (issue 5); block_m counts tokens,
# block_n weight rows. gfx950's native v_mfma_scale_f32_{16x16x128,32x32x64}_f8f6f4 needs
# kpack=1 and matrix_instr_nonkdim 16 or 32. gfx942 has no tl.dot_scaled lowering with
# Triton 3.6 ("Unsupported DotScaleOp"): every launch there is the upcast kernel
# (gemm_upcast.py, canonical layout, decode in registers, tl.dot in bf16 or fp16, the
# tokens on the MFMA's N). split_k=0 (small M): as many programs per output tile as fill
# the GPU.
_AMD = (("kpack", 1), ("matrix_instr_nonkdim", 16))
GEMM_TILES = {
    "gfx950": {
        "a4w4": GemmConfig(128, 128, 256, num_warps=8, num_stages=2, extra=_AMD),
        "a4w4-heavy": GemmConfig(64, 64, 128, num_warps=4, num_stages=2, extra=_AMD),
        "a4w4-small": GemmConfig(16, 64, 256, num_warps=4, num_stages=2, extra=_AMD, split_k=0),
        "w4a16": GemmConfig(128, 128, 128, num_warps=8, num_stages=2, extra=_AMD),
        "w4a16-small": GemmConfig(16, 64, 256, num_warps=4, num_stages=2, extra=_AMD, split_k=0),
    },
    "gfx942": {
        "a4w4": GemmConfig(128, 128, 128, num_warps=8, num_stages=2, extra=_AMD),
        "a4w4-heavy": GemmConfig(64, 64, 128, num_warps=4, num_stages=2, extra=_AMD),
        "a4w4-small": GemmConfig(16, 64, 256, num_warps=4, num_stages=2, extra=_AMD, split_k=0),
        "w4a16": GemmConfig(128, 128, 128, num_warps=8, num_stages=2, extra=_AMD),
        "w4a16-heavy": GemmConfig(64, 128, 128, num_warps=8, num_stages=2, extra=_AMD),
        "w4a16-small": GemmConfig(16, 64, 256, num_warps=4, num_stages=2, extra=_AMD, split_k=0),
    },
}


class RocmBackend(CompiledTritonBackend):
    name = "rocm"
    priority = 100
    tiles = TILES
    gemm_tiles = GEMM_TILES
    scale_layouts = {"gfx950": "cdna4"}
    gemm_sms = {"gfx942": 304, "gfx950": 256}
    targets = ("gfx942", "gfx950")
