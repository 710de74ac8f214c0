"""AMD: the Triton kernels on gfx942 (MI300X) and gfx950 (MI350X/MI355X), with the gfx
arch probed from the device. Everything AMD-specific (which architectures, wave64 tile
sizes, waves_per_eu occupancy hints) is here."""

from __future__ import annotations

from .triton.backend import CompiledTritonBackend
from .triton.launch import TileConfig

# wave64: 4 warps are 256 lanes, so 16 x 256 tiles give 16 elements a lane in about 50
# VGPRs on gfx942 (compile matrix); waves_per_eu asks the compiler to budget registers
# for that many waves per SIMD (latency hiding for a streaming kernel).
_WAVES = (("waves_per_eu", 2),)
TILES = {
    "quantize": TileConfig(16, 256, num_warps=4, extra=_WAVES),
    "quantize-heavy": TileConfig(8, 256, num_warps=4, extra=_WAVES),
    "dequantize": TileConfig(16, 256, num_warps=4, extra=_WAVES),
    "decompose": TileConfig(8, 256, num_warps=8, extra=_WAVES),
}


class RocmBackend(CompiledTritonBackend):
    name = "rocm"
    priority = 100
    tiles = TILES
    targets = ("gfx942", "gfx950")
