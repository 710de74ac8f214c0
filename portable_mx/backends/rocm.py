"""AMD: the Triton kernels on gfx942 (MI300X) and gfx950 (MI350X/MI355X), with the gfx
arch probed from the device. Everything AMD-specific (which architectures, wave64 tile
sizes and occupancy) is here."""

from __future__ import annotations

from .triton.backend import CompiledTritonBackend
from .triton.launch import TileConfig

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


class RocmBackend(CompiledTritonBackend):
    name = "rocm"
    priority = 100
    tiles = TILES
    targets = ("gfx942", "gfx950")
