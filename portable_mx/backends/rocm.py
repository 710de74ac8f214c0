"""AMD: the Triton kernels on gfx942 (MI300X) and gfx950 (MI350X/MI355X), with the gfx
arch probed from the device. Everything AMD-specific (which architectures, wave64 tile
sizes, waves_per_eu occupancy hints) is here."""

from __future__ import annotations

from typing import Optional

import torch

from .targets import Target, probe
from .triton import mode_problem
from .triton.backend import TritonBackend
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


class RocmBackend(TritonBackend):
    name = "rocm"
    priority = 100
    tiles = TILES
    targets = ("gfx942", "gfx950")

    def unavailable_reason(self, device: torch.device) -> Optional[str]:
        target, why = probe(device)
        if target is None:
            return why
        if target.vendor != "amd":
            return f"{target.name} is an NVIDIA GPU (the cuda backend serves it)"
        return mode_problem(interpreted=False)

    def target(self, device: torch.device) -> Optional[Target]:
        return probe(device)[0]

    def path(self, device: torch.device, op: str) -> str:
        return "native"
