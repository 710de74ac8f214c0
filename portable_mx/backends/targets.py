"""The GPU targets portable_mx compiles for: architecture, warp size, shared-memory limit,
and whether ``tl.dot_scaled`` lowers to a native block-scaled instruction there
(numerics.md section 5).

A :class:`Target` is pure data: it can be built, compared and compiled for on a machine
with no GPU (see :mod:`portable_mx.aot`). :func:`probe` maps a live torch device to its
target, or says why there is none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch


@dataclass(frozen=True)
class Target:
    """One compilation target.

    ``arch`` is what ``triton.backends.compiler.GPUTarget`` takes: an int compute
    capability (90, 100, 120) for ``triton_backend == "cuda"``, a gfx name for "hip".
    ``shared_memory`` is the most shared memory (NVIDIA) or LDS (AMD) one program may
    use, in bytes. ``native_mx_pattern`` is a regex that matches the target's assembly
    when ``tl.dot_scaled`` was lowered to the native block-scaled instruction (None when
    the target has none and upcasts instead).
    """

    name: str
    vendor: str  # "nvidia" | "amd"
    triton_backend: str  # "cuda" | "hip"
    arch: Union[int, str]
    warp_size: int
    shared_memory: int
    native_mx_pattern: Optional[str]
    description: str
    tmem_columns: Optional[int] = None
    """Tensor-memory columns one program may allocate (sm_100: 512; None: no tensor
    memory). Triton refuses to load a kernel that needs more."""
    dot_scaled_since: tuple[int, int] = (3, 6)
    """The oldest Triton (major, minor) that lowers ``tl.dot_scaled`` for this target
    (gfx942: 3.8; triton 3.6 and 3.7 stop with "LLVM ERROR: Unsupported DotScaleOp").
    Backends launch only kernels without ``tl.dot_scaled`` here on older releases."""

    @property
    def native_mx(self) -> bool:
        return self.native_mx_pattern is not None

    def lowers_dot_scaled(self, triton_version: Optional[tuple[int, int]]) -> bool:
        """Whether ``tl.dot_scaled`` compiles for this target with that Triton (major,
        minor); an unknown version is taken to be new enough."""
        return triton_version is None or triton_version >= self.dot_scaled_since

    def gpu_target(self):
        """The ``triton.backends.compiler.GPUTarget`` of this target."""
        from triton.backends.compiler import GPUTarget

        return GPUTarget(self.triton_backend, self.arch, self.warp_size)


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("sm_90", "nvidia", "cuda", 90, 32, 232448, None,
               "H100/H200: tl.dot_scaled upcasts to bf16, then wgmma"),
        Target("sm_100", "nvidia", "cuda", 100, 32, 232448, r"tcgen05\.mma[\w.:]*block_scale",
               "B200/GB200: native tcgen05.mma ... block_scale", tmem_columns=512),
        Target("sm_120", "nvidia", "cuda", 120, 32, 101376, r"mma\.sync[\w.:]*block_scale",
               "RTX 50: native mma.sync ... block_scale"),
        Target("gfx942", "amd", "hip", "gfx942", 64, 65536, None,
               "MI300X: MXFP4 upcast to bf16/fp16, then MFMA", dot_scaled_since=(3, 8)),
        Target("gfx950", "amd", "hip", "gfx950", 64, 163840, r"v_mfma_scale_f32_\w+_f8f6f4",
               "MI350X/MI355X: native v_mfma_scale_f32_*_f8f6f4"),
    )
}
"""The compile matrix's targets, by name."""

# Newer parts of an existing family compile for the family's target.
_NVIDIA_FAMILY = {9: "sm_90", 10: "sm_100", 12: "sm_120"}


def probe(device: Union[torch.device, str]) -> tuple[Optional[Target], str]:
    """(target, "") for a CUDA/ROCm device portable_mx has a target for, else
    (None, a one-line reason). Never raises for a device type torch knows."""
    device = torch.device(device)
    if device.type != "cuda":
        return None, f"{device.type} is not a GPU device"
    if not torch.cuda.is_available():
        return None, "torch sees no GPU (torch.cuda.is_available() is False)"
    props = torch.cuda.get_device_properties(device)
    if torch.version.hip is not None:
        arch = getattr(props, "gcnArchName", "").split(":")[0]
        target = TARGETS.get(arch)
        if target is None:
            return None, f"AMD {arch or 'arch unknown'}: no portable_mx target (have gfx942, gfx950)"
        return target, ""
    name = _NVIDIA_FAMILY.get(props.major)
    if name is None:
        return None, f"NVIDIA sm_{props.major}{props.minor}: no portable_mx target (have sm_90, sm_100, sm_120)"
    return TARGETS[name], ""
