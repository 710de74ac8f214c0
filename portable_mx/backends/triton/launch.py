"""What one kernel launch is, as data: the kernel, its argument types, its compile-time
constants and launch options. The backends build these for the launches they make, and
the same objects drive the ahead-of-time compile matrix, so what CI compiles is exactly
what a GPU would run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

# torch dtype -> the Triton type string of a pointer to it
POINTER_TYPES = {
    torch.float32: "*fp32",
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.uint8: "*u8",
    torch.int16: "*i16",
    torch.int32: "*i32",
}


class _LaunchOptions:
    """The launch options every config carries: ``num_warps``, ``num_stages`` and the
    vendor ``extra`` options."""

    num_warps: int
    num_stages: int
    extra: tuple[tuple[str, Any], ...]

    def options(self) -> dict[str, Any]:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages, **dict(self.extra)}

    def _extra_label(self) -> str:
        return "".join(f" {k}={v}" for k, v in self.extra)


@dataclass(frozen=True)
class TileConfig(_LaunchOptions):
    """Tile sizes and launch options of one element-wise MX kernel (quantize, dequantize,
    decompose): ``block_r`` rows by ``block_k`` columns per program (``block_k`` a power of
    two and a multiple of 32), ``num_warps`` warps, and vendor options (``waves_per_eu``
    on AMD ...) passed through to the launch."""

    block_r: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 1
    extra: tuple[tuple[str, Any], ...] = ()

    def label(self) -> str:
        return f"r{self.block_r}xk{self.block_k} w{self.num_warps}{self._extra_label()}"


@dataclass(frozen=True)
class KernelLaunch:
    """One (kernel, specialization, config) as launched.

    ``signature`` maps every argument name of ``fn`` to a Triton type string ("*fp32",
    "i32", "i64", ... or "constexpr"); ``constexprs`` gives the constexpr values;
    ``options`` the compile/launch options (num_warps, num_stages, enable_fp_fusion and
    vendor options). ``multiplies_mx`` marks kernels that multiply MX operands, whose
    native block-scaled instruction the compile matrix checks on native targets.
    """

    kernel: str
    fn: Any
    signature: dict[str, str]
    constexprs: dict[str, Any]
    options: dict[str, Any]
    label: str
    multiplies_mx: bool = False
    meta: dict[str, Any] = field(default_factory=dict)
    divisible_by_16: tuple[str, ...] = ()
    """Arguments the launch specializes as multiples of 16, as Triton's JIT does for the
    usual case: every pointer (torch allocations are aligned) and the listed ints."""

    def attrs(self) -> dict:
        """``triton.compiler.ASTSource`` attrs: the divisibility the JIT would see."""
        names = list(self.signature)
        hinted = {n for n, t in self.signature.items() if t.startswith("*")} | set(self.divisible_by_16)
        return {(names.index(n),): [["tt.divisibility", 16]] for n in hinted}


@dataclass(frozen=True)
class GemmConfig(_LaunchOptions):
    """Tiles and launch options of the GEMM: a ``block_m`` x ``block_n`` output tile per
    program, ``block_k`` (a power of two >= 32) columns of K per step, programs grouped
    ``group_m`` row tiles at a time for L2 reuse, K split ``split_k`` ways (fp32 partial
    sums combined on the device; 1: no split), and vendor options (``kpack``,
    ``matrix_instr_nonkdim``, ``waves_per_eu`` on AMD) passed through to the launch."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2
    group_m: int = 8
    split_k: int = 1
    extra: tuple[tuple[str, Any], ...] = ()

    def label(self) -> str:
        split = f" sk{self.split_k}" if self.split_k != 1 else ""
        return (f"m{self.block_m}xn{self.block_n}xk{self.block_k} g{self.group_m} w{self.num_warps} "
                f"s{self.num_stages}{split}{self._extra_label()}")
