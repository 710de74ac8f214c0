"""The MXFP4 GEMM: ``C = A @ B^T`` with ``tl.dot_scaled``, fp32 accumulation.

Operands, in the registry's rows layout:

- A, the left operand, [M, K]: MXFP4 (A4W4: codes uint8 [M, Kp/2], E8M0 scales
  [M, Kp/32]) or a bf16/fp16 tensor (W4A16);
- B, the weight, [N, K] (B transposed): MXFP4.

Either MXFP4 operand may carry macro factors (MBS) and outliers (OF):

- **MBS.** Every K tile lies inside one macro block of each operand (``block_k`` divides
  both macro blocks). Its block-scaled product ``part`` is promoted as it is made:
  ``acc += mA * mB * part``. When one macro block spans K (and there are no outliers) the
  K loop accumulates unscaled and the factors move to the epilogue. Promoting per tile
  rather than per macro block keeps one accumulator live across the loop: a second one
  spilled registers on sm_90 and sm_100 in the compile matrix.
- **OF.** The dequantized operand is ``D + S``: the dense MXFP4 part D (the outlier
  positions hold code 0) plus the sparse bf16 outliers S, exactly k per 32. The product
  adds the correction ``S_A D_B + D_A S_B + S_A S_B`` in the same K loop. The sparse
  tiles are expanded to dense bf16 registers, and the corrections are block-scaled dots
  with one bf16 side. The outliers are not multiplied by their own operand's macro
  factor, only by the other one's.

The result equals the product of the dequantized operands up to fp32 accumulation order
(numerics.md section 4). Vendor-specific choices (tiles, warps, stages, ``kpack``,
``matrix_instr_nonkdim``) come in through :class:`~.launch.GemmConfig`. With
``split_k`` > 1 several programs share an output tile, each summing a contiguous range of
its K tiles, and the last one to finish adds the partial sums in a fixed order (splitk.py):
the decode path on targets with a native block-scaled MMA (targets without one use
gemm_upcast.py). The epilogue adds an optional bias (fp32, bf16 or fp16 [N], widened to
fp32) to the fp32 sum, and the kernel's store writes the output dtype: one rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch
import triton
import triton.language as tl

from ...tensor import MXTensor
from . import splitk
from .launch import POINTER_TYPES, GemmConfig, KernelLaunch
from .layouts import PLAIN, ScaleLayout, prepared, scale_offset
from .numerics import bf16_pair

FORMATS = {None: "e2m1", torch.bfloat16: "bf16", torch.float16: "fp16"}
"""The ``tl.dot_scaled`` format of the left operand: MXFP4 (None), bf16 or fp16."""


@triton.jit
def outlier_tile(ov_ptr, oi_ptr, rows, R, k0, NB, N_OUT: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """The outliers of rows ``rows`` [BLOCK_R], columns [k0, k0 + BLOCK_K), as a dense bf16
    tile [BLOCK_R, BLOCK_K]: zero except at the stored in-block indices, which hold the
    stored bf16 values. ov: int16 (bf16 bits) and oi: uint8, both [R, NB, N_OUT]."""
    NBK: tl.constexpr = BLOCK_K // 32
    blk = k0 // 32 + tl.arange(0, NBK)
    mask = (rows[:, None] < R) & (blk[None, :] < NB)
    off = (rows[:, None] * NB + blk[None, :]) * N_OUT
    lane = tl.arange(0, 32)[None, None, :]
    idx = tl.load(oi_ptr + off, mask=mask, other=0).to(tl.int32)
    bits = tl.load(ov_ptr + off, mask=mask, other=0)
    s = tl.where(lane == idx[:, :, None], bits[:, :, None], tl.zeros((BLOCK_R, NBK, 32), tl.int16))
    if N_OUT == 2:
        idx = tl.load(oi_ptr + off + 1, mask=mask, other=0).to(tl.int32)
        bits = tl.load(ov_ptr + off + 1, mask=mask, other=0)
        s = tl.where(lane == idx[:, :, None], bits[:, :, None], s)
    return tl.reshape(s, (BLOCK_R, BLOCK_K)).to(tl.bfloat16, bitcast=True)


@triton.jit
def _tile_product(
    a_ptr, as_ptr, aov_ptr, aoi_ptr, b_ptr, bs_ptr, bov_ptr, boi_ptr,
    rm, rn, k0, M, N, K, KP, NB, stride_am, ma, mb, part, acc,
    A_FORMAT: tl.constexpr, A_MACRO: tl.constexpr, B_MACRO: tl.constexpr,
    A_OUT: tl.constexpr, B_OUT: tl.constexpr, EVEN_K: tl.constexpr, B_LAYOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One K tile [k0, k0 + BLOCK_K): the block-scaled product accumulates into ``part``;
    the outlier corrections into ``part`` too without macro factors, else into ``acc``,
    scaled by the other operand's macro factor."""
    PROMOTE: tl.constexpr = A_MACRO or B_MACRO
    kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    m_in = rm[:, None] < M
    n_in = rn[None, :] < N
    if EVEN_K:
        b = tl.load(b_ptr + rn[None, :] * (KP // 2) + kb[:, None], mask=n_in, other=0)
        b_s = tl.load(bs_ptr + scale_offset(rn[:, None], ks[None, :], NB, B_LAYOUT), mask=rn[:, None] < N, other=0)
    else:
        b = tl.load(b_ptr + rn[None, :] * (KP // 2) + kb[:, None], mask=n_in & (kb[:, None] < KP // 2), other=0)
        b_s = tl.load(bs_ptr + scale_offset(rn[:, None], ks[None, :], NB, B_LAYOUT),
                      mask=(rn[:, None] < N) & (ks[None, :] < NB), other=0)
    if A_FORMAT == "e2m1":
        if EVEN_K:
            a = tl.load(a_ptr + rm[:, None] * stride_am + kb[None, :], mask=m_in, other=0)
            a_s = tl.load(as_ptr + rm[:, None] * NB + ks[None, :], mask=m_in, other=0)
        else:
            a = tl.load(a_ptr + rm[:, None] * stride_am + kb[None, :], mask=m_in & (kb[None, :] < KP // 2), other=0)
            a_s = tl.load(as_ptr + rm[:, None] * NB + ks[None, :], mask=m_in & (ks[None, :] < NB), other=0)
        part = tl.dot_scaled(a, a_s, "e2m1", b, b_s, "e2m1", part)
    else:
        kk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rm[:, None] * stride_am + kk[None, :], mask=m_in & (kk[None, :] < K), other=0.0)
        a_s = None
        part = tl.dot_scaled(a, None, A_FORMAT, b, b_s, "e2m1", part)
    # the outlier corrections: into part when no operand has macro factors (all factors
    # are 1), else into acc, scaled by the other operand's factor
    if A_OUT > 0:
        sa = outlier_tile(aov_ptr, aoi_ptr, rm, M, k0, NB, A_OUT, BLOCK_M, BLOCK_K)
        if PROMOTE:
            corr = tl.dot_scaled(sa, None, "bf16", b, b_s, "e2m1")
            if B_MACRO:
                corr = corr * mb[None, :]
            acc += corr
        else:
            part = tl.dot_scaled(sa, None, "bf16", b, b_s, "e2m1", part)
    if B_OUT > 0:
        sbt = tl.trans(outlier_tile(bov_ptr, boi_ptr, rn, N, k0, NB, B_OUT, BLOCK_N, BLOCK_K))
        if A_FORMAT == "fp16":  # (no macro factor, no outliers: A is not MXFP4)
            # no fp16 x bf16 MMA: a as two bf16 parts (exact), two bf16 MMAs into the sum
            # (a tile of their own spilled at prefill; tl.dot_scaled, whose bf16 form the
            # interpreter multiplies right: its tl.dot of bf16 does not, numerics.md s. 5)
            a_hi, a_lo = bf16_pair(a)
            if PROMOTE:
                acc = tl.dot_scaled(a_hi, None, "bf16", sbt, None, "bf16", acc)
                acc = tl.dot_scaled(a_lo, None, "bf16", sbt, None, "bf16", acc)
            else:
                part = tl.dot_scaled(a_hi, None, "bf16", sbt, None, "bf16", part)
                part = tl.dot_scaled(a_lo, None, "bf16", sbt, None, "bf16", part)
        else:
            corr = tl.dot_scaled(a, a_s, A_FORMAT, sbt, None, "bf16")
            if A_MACRO:
                corr = corr * ma[:, None]
            if A_OUT > 0:  # S_A S_B: exact bf16 values, no macro factor
                corr = corr + tl.dot_scaled(sa, None, "bf16", sbt, None, "bf16")
            if PROMOTE:
                acc += corr
            else:
                part += corr
    return part, acc


@triton.jit
def macro_factors(am_ptr, bm_ptr, rm, rn, M, N, NMA, NMB, ka, kb, A_MACRO: tl.constexpr, B_MACRO: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(ma fp32 [BLOCK_M], mb fp32 [BLOCK_N]): the macro factors in column ka of A's rows rm
    and column kb of B's rows rn (fp32 [M, NMA] / [N, NMB]); 1 for an operand without
    macro blocks and for rows out of range."""
    ma = tl.full((BLOCK_M,), 1.0, tl.float32)
    mb = tl.full((BLOCK_N,), 1.0, tl.float32)
    if A_MACRO:
        ma = tl.load(am_ptr + rm * NMA + ka, mask=rm < M, other=1.0)
    if B_MACRO:
        mb = tl.load(bm_ptr + rn * NMB + kb, mask=rn < N, other=1.0)
    return ma, mb


@triton.jit
def bias_row(bias_ptr, rn, N):
    """The bias of output columns ``rn`` (float [N] at bias_ptr) in fp32; 0 past N."""
    return tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)


@triton.jit
def scaled_k_loop(
    a_ptr, as_ptr, am_ptr, aov_ptr, aoi_ptr, b_ptr, bs_ptr, bm_ptr, bov_ptr, boi_ptr,
    rm, rn, first, last, M, N, K, KP, NB, stride_am, NMA, NMB, MACRO_A, MACRO_B,
    A_FORMAT: tl.constexpr, A_MACRO: tl.constexpr, B_MACRO: tl.constexpr,
    A_OUT: tl.constexpr, B_OUT: tl.constexpr, EVEN_K: tl.constexpr, EPILOGUE: tl.constexpr,
    B_LAYOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """acc [BLOCK_M, BLOCK_N] fp32 = the sum over K tiles first..last-1 of A's rows rm times
    B's rows rn (M, N: their row counts), with the macro factors applied per tile unless
    EPILOGUE (then the caller scales the finished sum). The K loop of gemm_kernel and of
    the grouped GEMM's ``tl.dot_scaled`` kernel."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    ma = tl.full((BLOCK_M,), 1.0, tl.float32)
    mb = tl.full((BLOCK_N,), 1.0, tl.float32)
    if (A_MACRO or B_MACRO) and not EPILOGUE:
        # promote each K tile (it lies inside one macro block of each operand)
        for t in range(first, last):
            k0 = t * BLOCK_K
            if A_MACRO:
                ma = tl.load(am_ptr + rm * NMA + k0 // MACRO_A, mask=rm < M, other=1.0)
            if B_MACRO:
                mb = tl.load(bm_ptr + rn * NMB + k0 // MACRO_B, mask=rn < N, other=1.0)
            part = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            # one trip: the tile's product accumulates into a loop-carried part (Triton 3.6
            # cannot lower a fresh per-tile tcgen05 accumulator on sm_100: tmem_alloc)
            for t_in in range(t, t + 1):
                part, acc = _tile_product(
                    a_ptr, as_ptr, aov_ptr, aoi_ptr, b_ptr, bs_ptr, bov_ptr, boi_ptr,
                    rm, rn, t_in * BLOCK_K, M, N, K, KP, NB, stride_am, ma, mb, part, acc,
                    A_FORMAT, A_MACRO, B_MACRO, A_OUT, B_OUT, EVEN_K, B_LAYOUT, BLOCK_M, BLOCK_N, BLOCK_K)
            acc += part * (ma[:, None] * mb[None, :])
    else:
        for t in range(first, last):
            acc, _ = _tile_product(
                a_ptr, as_ptr, aov_ptr, aoi_ptr, b_ptr, bs_ptr, bov_ptr, boi_ptr,
                rm, rn, t * BLOCK_K, M, N, K, KP, NB, stride_am, ma, mb, acc, acc,
                A_FORMAT, False, False, A_OUT, B_OUT, EVEN_K, B_LAYOUT, BLOCK_M, BLOCK_N, BLOCK_K)
    return acc


@triton.jit
def gemm_kernel(
    a_ptr, as_ptr, am_ptr, aov_ptr, aoi_ptr,
    b_ptr, bs_ptr, bm_ptr, bov_ptr, boi_ptr,
    c_ptr, part_ptr, count_ptr, bias_ptr,
    M, N, K, KP, stride_am, stride_cm, NMA, NMB, MACRO_A, MACRO_B,
    A_FORMAT: tl.constexpr, A_MACRO: tl.constexpr, B_MACRO: tl.constexpr,
    A_OUT: tl.constexpr, B_OUT: tl.constexpr, EVEN_K: tl.constexpr, EPILOGUE: tl.constexpr,
    B_LAYOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr, BIAS: tl.constexpr,
):
    """c [M, N] (row stride stride_cm) = A [M, K] @ B [N, K]^T (+ bias [N] with BIAS),
    accumulated in fp32 and stored in c's dtype (fp32, bf16 or fp16: one rounding).

    A: codes uint8 [M, KP/2] (row stride stride_am) and scales uint8 [M, KP/32] when
    A_FORMAT is "e2m1", else bf16/fp16 [M, K] (row stride stride_am); B: codes uint8
    [N, KP/2], scales uint8 [N, KP/32] stored in scale layout B_LAYOUT (layouts.py). Macro factors fp32 [M, NMA] / [N, NMB] of
    macro blocks MACRO_A / MACRO_B; outliers int16 (bf16 bits) and uint8 indices
    [rows, KP/32, k]. With macro factors each K tile lies inside one macro block of each
    operand; EPILOGUE: one macro block spans K and there are no outliers, so the factors
    scale the finished sum. With SPLIT_K > 1, part_ptr (fp32) and count_ptr (int32, zero)
    are splitk.buffers. BIAS: bias_ptr is a float [N] (fp32, bf16 or fp16), added in fp32
    after the macro factors."""
    pid_m, pid_n, pid_k, grid_n = splitk.program_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M, SPLIT_K)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    NB = KP // 32

    first, last = splitk.tile_k_range(pid_k, KP, BLOCK_K, SPLIT_K)
    acc = scaled_k_loop(
        a_ptr, as_ptr, am_ptr, aov_ptr, aoi_ptr, b_ptr, bs_ptr, bm_ptr, bov_ptr, boi_ptr,
        rm, rn, first, last, M, N, K, KP, NB, stride_am, NMA, NMB, MACRO_A, MACRO_B,
        A_FORMAT, A_MACRO, B_MACRO, A_OUT, B_OUT, EVEN_K, EPILOGUE, B_LAYOUT, BLOCK_M, BLOCK_N, BLOCK_K)

    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT_K > 1:
        offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        acc, is_last = splitk.combine(acc, offs, mask, part_ptr, count_ptr, pid_m * grid_n + pid_n, pid_k,
                                      SPLIT_K, BLOCK_M * BLOCK_N)
    else:
        is_last = True
    if is_last:
        if EPILOGUE:  # one macro block spans K: its factors scale the whole sum
            ma, mb = macro_factors(am_ptr, bm_ptr, rm, rn, M, N, NMA, NMB, 0, 0, A_MACRO, B_MACRO,
                                   BLOCK_M, BLOCK_N)
            acc = acc * (ma[:, None] * mb[None, :])
        if BIAS:
            acc += bias_row(bias_ptr, rn, N)[None, :]
        tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :], acc.to(c_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- host side


@dataclass(frozen=True)
class Operand:
    """What the kernel needs to know of one operand: its format (None for MXFP4), macro
    block length (None without MBS) and outliers per block; ``quant``: for 16-bit tokens
    the upcast kernel quantizes itself (A4W4 at decode in one launch), the scale rule's
    id (numerics.RULE_IDS; nearest rounding, no macro blocks or outliers), else None."""

    format: Optional[torch.dtype]
    macro_block: Optional[int]
    outliers: int
    quant: Optional[int] = None

    @property
    def heavy(self) -> bool:
        """Whether the operand has macro factors or outliers (the backends' "-heavy" tiles)."""
        return bool(self.macro_block or self.outliers)

    def pairs_with(self, b: "Operand") -> bool:
        """Whether these are fp16 tokens that the kernels multiply by ``b``'s outliers as two
        bf16 parts (numerics.bf16_pair: two more MMAs a K step; the backends' "-pair" tiles)."""
        return self.format is torch.float16 and self.quant is None and b.outliers > 0

    def tag(self) -> str:
        """The operand's part of a config-cache key (``tuning.cache.operand_tag``)."""
        from ...tuning.cache import operand_tag

        return operand_tag(FORMATS[self.format], self.macro_block, self.outliers, self.quant is not None)

    @staticmethod
    def of(t: Union[MXTensor, torch.Tensor]) -> "Operand":
        if isinstance(t, torch.Tensor):
            return Operand(t.dtype, None, 0)
        n_out = 0 if t.outlier_values is None else t.outlier_values.shape[-1]
        return Operand(None, t.recipe.macro_block if t.macro_scales is not None else None, n_out)


@dataclass(frozen=True)
class Plan:
    """The K stepping of one launch: ``block_k`` is the config's, lowered with macro factors
    to the largest power of two that divides both macro blocks (unless they move to the
    epilogue), and the kernel's constexprs."""

    block_k: int
    constexprs: dict

    @staticmethod
    def make(a: Operand, b: Operand, kp: int, config: GemmConfig, b_layout: ScaleLayout = PLAIN,
             bias: bool = False) -> "Plan":
        if a.format not in FORMATS:
            raise TypeError(f"the GEMM's left operand must be MXFP4, bf16 or fp16; got {a.format}")
        macros = [m for m in (a.macro_block, b.macro_block) if m is not None]
        epilogue = bool(macros) and min(macros) >= kp and not (a.outliers or b.outliers)
        block_k = config.block_k
        if macros and not epilogue:
            period = math.gcd(*macros)
            block_k = min(block_k, period & -period)
        constexprs = {
            "A_FORMAT": FORMATS[a.format], "A_MACRO": a.macro_block is not None,
            "B_MACRO": b.macro_block is not None, "A_OUT": a.outliers, "B_OUT": b.outliers,
            "EVEN_K": kp % block_k == 0, "EPILOGUE": epilogue, "B_LAYOUT": b_layout.layout_id,
            "BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "BLOCK_K": block_k, "GROUP_M": config.group_m,
            "SPLIT_K": max(1, config.split_k), "BIAS": bool(bias),
        }
        return Plan(block_k, constexprs)


_INT_ARGS = ("M", "N", "K", "KP", "stride_am", "stride_cm", "NMA", "NMB", "MACRO_A", "MACRO_B")


def launch_spec(a: Operand, b: Operand, config: GemmConfig, options: dict, b_layout: ScaleLayout = PLAIN,
                kp: int = 8192, out_dtype: torch.dtype = torch.float32,
                bias: Optional[torch.dtype] = None) -> KernelLaunch:
    """The launch :func:`matmul` makes for operands like ``a`` and ``b`` (K padded to
    ``kp``, b's scales in ``b_layout``, output ``out_dtype``, a bias of dtype ``bias``
    or none), as data (for AOT). A4W4 launches are marked ``multiplies_mx``: on a target
    with a native block-scaled instruction the compile matrix requires it."""
    plan = Plan.make(a, b, kp, config, b_layout, bias is not None)
    a_ptr = "*u8" if a.format is None else POINTER_TYPES[a.format]
    signature = {
        "a_ptr": a_ptr, "as_ptr": "*u8", "am_ptr": "*fp32" if a.macro_block else "*u8",
        "aov_ptr": "*i16" if a.outliers else "*u8", "aoi_ptr": "*u8",
        "b_ptr": "*u8", "bs_ptr": "*u8", "bm_ptr": "*fp32" if b.macro_block else "*u8",
        "bov_ptr": "*i16" if b.outliers else "*u8", "boi_ptr": "*u8", "c_ptr": POINTER_TYPES[out_dtype],
        "part_ptr": "*fp32", "count_ptr": "*i32", "bias_ptr": POINTER_TYPES[out_dtype if bias is None else bias],
        **{name: "i32" for name in _INT_ARGS},
    }
    signature.update({name: "constexpr" for name in plan.constexprs})
    kind = "A4W4" if a.format is None else f"W4A16-{FORMATS[a.format]}"
    extras = [f"MBS-{m}" for m in {a.macro_block, b.macro_block} if m]
    extras += [f"{side}OF-{n}" for side, n in (("a:", a.outliers), ("b:", b.outliers)) if n]
    if b_layout is not PLAIN:
        extras.append(f"scales:{b_layout.name}")
    if bias is not None:
        extras.append(f"bias:{FORMATS.get(bias, str(bias))}")
    if out_dtype != torch.float32:
        extras.append(f"out:{FORMATS.get(out_dtype, str(out_dtype))}")
    label = " ".join([kind, *extras, config.label()])
    return KernelLaunch("gemm", gemm_kernel, signature, dict(plan.constexprs), dict(options), label,
                        multiplies_mx=a.format is None, divisible_by_16=("K", "KP", "stride_am", "stride_cm"))


def _parts(t: MXTensor) -> tuple[torch.Tensor, ...]:
    """(codes, scales, macro factors, outlier bits, outlier indices) of an MXTensor in the
    rows layout, contiguous; absent parts are stood in for by the scales (never read)."""
    s = t.scales.contiguous()
    macro = s if t.macro_scales is None else t.macro_scales.contiguous()
    ov = s if t.outlier_values is None else t.outlier_values.contiguous().view(torch.int16)
    oi = s if t.outlier_indices is None else t.outlier_indices.contiguous()
    return t.qdata.contiguous(), s, macro, ov, oi


def launch_args(a: Union[MXTensor, torch.Tensor], b: MXTensor, config: GemmConfig, b_layout: ScaleLayout = PLAIN,
                out_dtype: torch.dtype = torch.float32, out: Optional[torch.Tensor] = None,
                bias: Optional[torch.Tensor] = None):
    """(kernel, grid, arguments, constexprs, output) of the launch :func:`matmul` makes:
    ``kernel[grid](*arguments, **constexprs, **options)`` computes it (or
    ``kernel.warmup(*arguments, grid=grid, **constexprs, **options)`` compiles it)."""
    n, kp = b.qdata.shape[0], b.k_padded
    oa, ob = Operand.of(a), Operand.of(b)
    if isinstance(a, MXTensor):
        if a.k_padded != kp:
            raise ValueError(f"a and b have different padded K: {a.k_padded} and {kp}")
        m = a.qdata.shape[0]
        a_parts = _parts(a)
        stride_am = kp // 2
        nma = 1 if a.macro_scales is None else a.macro_scales.shape[-1]
    else:
        m = a.shape[0]
        a = a if a.stride(-1) == 1 else a.contiguous()
        a_parts = (a, b.scales, b.scales, b.scales, b.scales)
        stride_am = a.stride(0)
        nma = 1
    b_parts = _parts(b)
    b_parts = (b_parts[0], prepared(b_parts[1], b_layout), *b_parts[2:])
    nmb = 1 if b.macro_scales is None else b.macro_scales.shape[-1]
    plan = Plan.make(oa, ob, kp, config, b_layout, bias is not None)
    c = out if out is not None else torch.empty(m, n, dtype=out_dtype, device=b.device)
    split = plan.constexprs["SPLIT_K"]
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    if split > 1:
        part, counts = splitk.buffers(b.device, tiles * split * config.block_m * config.block_n, tiles)
    else:
        part, counts = c, c
    args = (*a_parts, *b_parts, c, part, counts, c if bias is None else bias,
            m, n, b.k, kp, stride_am, c.stride(0), nma, nmb, oa.macro_block or 32, ob.macro_block or 32)
    return gemm_kernel, (tiles * split,), args, dict(plan.constexprs), c


def matmul(a: Union[MXTensor, torch.Tensor], b: MXTensor, config: GemmConfig, options: dict,
           b_layout: ScaleLayout = PLAIN, out_dtype: torch.dtype = torch.float32,
           out: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[M, N] in ``out_dtype`` = a @ b^T (+ ``bias``) for a: MXTensor (M, K) axis 1 or
    bf16/fp16 [M, K], and b: MXTensor (N, K) axis 1, all on the kernel's device. b's
    scales are read in ``b_layout``, swizzled once per scales tensor
    (:func:`layouts.prepared`). ``out``: an [M, N] tensor of ``out_dtype`` to write (unit
    column stride). ``bias``: fp32, bf16 or fp16 [N] (unit stride), added to the fp32
    sum before the store's one rounding."""
    kernel, grid, args, consts, c = launch_args(a, b, config, b_layout, out_dtype, out, bias)
    kernel[grid](*args, **consts, **options)
    return c
