"""The dequantize kernel: an MXTensor in the rows layout -> [R, Kp] in fp32, bf16 or
fp16 in one pass, bit-identical to the reference backend's dequantize,
``format.cast_canonical_nan(reference.decode_rows(mx), dtype)``: code * (2**(b-127) * m)
in fp32 (exact), outliers written over their positions, the dtype's canonical NaN where
the scale byte is 0xFF, then one rounding to the output dtype.

Word layout (as the quantize kernel's, encode.py): packed byte j of a row becomes output
word j, the two elements 2j and 2j+1 (an int64 of two fp32, or an int32 of two 16-bit
values). A thread loads ``VEC`` consecutive bytes (4 bytes for 16-bit output, 2 for fp32)
and writes their ``VEC`` words with one 16-byte store, beside its neighbours' (a warp's
stores are contiguous); the vector's block's scale, macro factor and outliers are loaded
once per thread and broadcast over its bytes. (One whole block a thread, 16-byte stores
64 or 128 bytes apart across a warp, ran at 0.47 / 0.13 of a device copy for bf16 / fp32
output on an H200 against 0.73 / 0.64 this way: benchmarks/NOTES-elementwise.md.)

Each value is built from bits: the magnitude code placed in an fp32's exponent and
mantissa is the E2M1 value times 2**-126, multiplied by 2**126 and by the block factor
(both exact products), and the code's sign bit is OR-ed into bit 31, so code 8 is -0.0 on
every target. bf16 output rounds to nearest even in integers (the interpreter's casts
truncate); without macro factors every value is exact in bf16 and the rounding is a
shift. fp16 output uses the hardware conversion (round to nearest even).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ...tensor import MXTensor
from .encode import exact_grid, program_tile, tile_grid
from .launch import KernelLaunch, TileConfig
from .numerics import F32_QNAN, bf16_round_bits, decode_bits, exp2i, f16_bits

OUT_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""Constexpr id of each output dtype the kernel writes."""
OUT_WORDS = {torch.float32: (torch.int64, "*i64"), torch.bfloat16: (torch.int32, "*i32"),
             torch.float16: (torch.int32, "*i32")}
F16_QNAN = tl.constexpr(0x7E00)  # format.CANONICAL_NAN_BITS
BF16_QNAN = tl.constexpr(0x7FC0)


def vec_bytes(dtype: torch.dtype) -> int:
    """Packed bytes per thread and load: their words make one 16-byte store."""
    return 2 if dtype == torch.float32 else 4


@triton.jit
def _per_vector(ptr, rows, blk, stride, mask, other, EVEN: tl.constexpr):
    """Load ptr[rows * stride + blk] for the tile's two outer dimensions (rows and blk
    broadcast to them: one value per thread vector, the vector's block's)."""
    if EVEN:
        return tl.load(ptr + rows * stride + blk)
    else:
        return tl.load(ptr + rows * stride + blk, mask=mask, other=other)


@triton.jit
def dequantize_kernel(
    q_ptr, s_ptr, m_ptr, ov_ptr, oi_ptr, out_ptr,
    R, KW, NM, MACRO,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr, HAS_MACRO: tl.constexpr,
    N_OUT: tl.constexpr, OUT_KIND: tl.constexpr, EVEN: tl.constexpr, K_FIRST: tl.constexpr,
    NV_FIRST: tl.constexpr,
):
    """q: uint8 [R, KW = Kp/2]; s: uint8 [R, Kp/32]; m: fp32 [R, NM]; ov: int16 (bf16
    bits) and oi: uint8 [R, Kp/32, N_OUT] (N_OUT = 2: read a block's pair as one int32
    and one int16, :func:`outlier_words`); out: the output's words [R, KW] (int64 for
    fp32, int32 for bf16/fp16). MACRO is the macro block length. EVEN: whole tiles, one
    program each. The program's tile from encode.program_tile (K_FIRST: their order).

    A thread owns VEC consecutive code bytes and stores their VEC words with one 16-byte
    store; neighbouring threads own neighbouring vectors of a row, so a warp's stores are
    contiguous. Loads, the per-vector scale and outliers, and the stores share the tile's
    one layout: no conversion. The tile is [NV, BR, VEC] (NV_FIRST) or [BR, NV, VEC]:
    Triton gives its threads to the two dimensions that are not contiguous in an order it
    breaks by their index, ascending under triton 3.6 and descending under 3.9
    (:func:`nv_first`), and the vectors' dimension must come first (the other way a warp's
    lanes sit on 16 rows, 32-byte runs)."""
    BW: tl.constexpr = BLOCK_K // 2
    NV: tl.constexpr = BW // VEC
    NB = KW // 16
    pid_r, pid_k = program_tile(K_FIRST)
    r1 = (pid_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    v1 = pid_k * BW + tl.arange(0, NV) * VEC  # first byte of each vector
    if NV_FIRST:  # [NV, BR] outer dimensions
        rows = r1[None, :]
        vcol = v1[:, None]
    else:  # [BR, NV]
        rows = r1[:, None]
        vcol = v1[None, :]
    byte = vcol[:, :, None] + tl.arange(0, VEC)[None, None, :]
    vmask = (rows < R) & (vcol < KW)  # unused (dead) when EVEN
    at = rows[:, :, None] * KW + byte  # a byte's offset, and its word's
    if EVEN:
        packed = tl.load(q_ptr + at)
    else:
        packed = tl.load(q_ptr + at, mask=vmask[:, :, None], other=0)
    packed = packed.to(tl.int32)

    blk = vcol // 16
    sbyte = _per_vector(s_ptr, rows, blk, NB, vmask, 0, EVEN).to(tl.int32)
    factor = exp2i(sbyte - 127)
    if HAS_MACRO:
        factor = factor * _per_vector(m_ptr, rows, blk * 32 // MACRO, NM, vmask, 1.0, EVEN)
    factor = factor[:, :, None]
    lo = decode_bits(packed & 15, factor)
    hi = decode_bits(packed >> 4, factor)
    if N_OUT >= 1:
        lane = (byte % 16) * 2
        if N_OUT == 1:
            idx = _per_vector(oi_ptr, rows, blk, NB, vmask, 0, EVEN).to(tl.int32)[:, :, None]
            val = (_per_vector(ov_ptr, rows, blk, NB, vmask, 0, EVEN).to(tl.int32) << 16)[:, :, None]
            lo = tl.where(lane == idx, val, lo)
            hi = tl.where(lane + 1 == idx, val, hi)
        else:  # a block's two values as one word, its two indices as one half-word
            idx2 = _per_vector(oi_ptr.to(tl.pointer_type(tl.int16)), rows, blk, NB, vmask, 0, EVEN).to(tl.int32)
            val2 = _per_vector(ov_ptr.to(tl.pointer_type(tl.int32)), rows, blk, NB, vmask, 0, EVEN)
            i0 = (idx2 & 0xFF)[:, :, None]
            i1 = ((idx2 >> 8) & 0xFF)[:, :, None]
            v0 = (val2 << 16)[:, :, None]
            v1 = (val2 & -65536)[:, :, None]
            lo = tl.where(lane == i0, v0, tl.where(lane == i1, v1, lo))
            hi = tl.where(lane + 1 == i0, v0, tl.where(lane + 1 == i1, v1, hi))
    special = (sbyte == 255)[:, :, None]

    if OUT_KIND == 0:
        lo = tl.where(special, F32_QNAN, lo)
        hi = tl.where(special, F32_QNAN, hi)
        word = lo.to(tl.uint32).to(tl.int64) | (hi.to(tl.int64) << 32)
    else:
        if OUT_KIND == 1:
            if HAS_MACRO:
                lo = bf16_round_bits(lo)
                hi = bf16_round_bits(hi)
            else:  # code * 2**k (and bf16 outliers) are bf16 values: the top half is exact
                lo = (lo >> 16) & 0xFFFF
                hi = hi >> 16
            nan = BF16_QNAN
        else:
            lo = f16_bits(lo)
            hi = f16_bits(hi)
            nan = F16_QNAN
        word = tl.where(special, nan | (nan << 16), lo | (hi << 16))
    if EVEN:
        tl.store(out_ptr + at, word)
    else:
        tl.store(out_ptr + at, word, mask=vmask[:, :, None])


@functools.lru_cache(maxsize=None)
def nv_first() -> bool:
    """Whether the kernel's tile puts its vectors' dimension first ([NV, BR, VEC]) for the
    importable triton: its coalescing orders a tile's non-contiguous dimensions by index,
    ascending under triton <= 3.6 and descending under 3.9 (both checked: the sm_90 TTGIR
    in tests/test_compile_matrix.py); the releases between are taken as 3.9."""
    from . import triton_version

    version = triton_version()
    return version is not None and version <= (3, 6)


def _constexprs(has_macro: bool, n_out: int, dtype: torch.dtype, config: TileConfig, even: bool) -> dict:
    return {"BLOCK_R": config.block_r, "BLOCK_K": config.block_k, "VEC": vec_bytes(dtype), "HAS_MACRO": has_macro,
            "N_OUT": n_out, "OUT_KIND": OUT_KINDS[dtype], "EVEN": even, "K_FIRST": config.order == "k",
            "NV_FIRST": nv_first()}


def launch_spec(has_macro: bool, n_out: int, dtype: torch.dtype, config: TileConfig, options: dict,
                even: bool = True) -> KernelLaunch:
    """The launch :func:`dequantize` makes for MXTensors with/without macro factors and
    ``n_out`` outliers per block, writing ``dtype``, as data (for AOT)."""
    constexprs = _constexprs(has_macro, n_out, dtype, config, even)
    signature = {"q_ptr": "*u8", "s_ptr": "*u8", "m_ptr": "*fp32" if has_macro else "*u8",
                 "ov_ptr": "*i16" if n_out else "*u8", "oi_ptr": "*u8", "out_ptr": OUT_WORDS[dtype][1],
                 "R": "i32", "KW": "i32", "NM": "i32", "MACRO": "i32"}
    signature.update({name: "constexpr" for name in constexprs})
    signature = {name: signature[name] for name in dequantize_kernel.arg_names}
    label = (f"{str(dtype).removeprefix('torch.')} {'MBS ' if has_macro else ''}{f'OF-{n_out} ' if n_out else ''}"
             f"{config.label()}{'' if even else ' masked'}")
    return KernelLaunch("dequantize", dequantize_kernel, signature, constexprs, dict(options), label,
                        divisible_by_16=("KW",))


def plan(r: int, kp: int, has_macro: bool, n_out: int, dtype: torch.dtype,
         config: TileConfig) -> tuple[tuple[int, int, int], dict]:
    """The grid and constexprs of the launch that dequantizes r rows of kp (padded)
    columns, with/without macro factors and ``n_out`` outliers a block, to ``dtype``."""
    k_first = config.order == "k"
    even = (r % config.block_r == 0 and kp % config.block_k == 0
            and exact_grid(r, kp, config.block_r, config.block_k, k_first))
    grid = tile_grid(r, kp, config.block_r, config.block_k, k_first)
    return grid, _constexprs(has_macro, n_out, dtype, config, even)


def outlier_words(ov: torch.Tensor, oi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The outliers' values (bf16 bits, int16) and indices (uint8) as the kernel reads
    them, contiguous; with two a block it reads a block's pair as one int32 and one int16,
    so views that start off those alignments are copied (a fresh tensor is aligned)."""
    ov = ov.contiguous().view(torch.int16)
    oi = oi.contiguous()
    if ov.shape[-1] == 2 and (ov.data_ptr() % 4 or oi.data_ptr() % 2):
        ov, oi = ov.clone(), oi.clone()
    return ov, oi


def int_args(mx: MXTensor) -> tuple[int, int, int, int]:
    """The kernel's integer arguments R, KW, NM, MACRO for ``mx``."""
    has_macro = mx.macro_scales is not None
    return (mx.qdata.shape[0], mx.k_padded // 2, mx.macro_scales.shape[-1] if has_macro else 1,
            mx.recipe.macro_block if has_macro else 32)


def dequantize(mx: MXTensor, dtype: torch.dtype, config: TileConfig, options: dict) -> torch.Tensor:
    """MXTensor (R, K), axis 1, on the kernel's device -> [R, Kp] in ``dtype`` (fp32,
    bf16 or fp16). (The Triton backend makes the same launch as a kept plan.)"""
    r = mx.qdata.shape[0]
    kp = mx.k_padded
    out = torch.empty(r, kp, dtype=dtype, device=mx.device)
    has_macro = mx.macro_scales is not None
    n_out = 0 if mx.outlier_values is None else mx.outlier_values.shape[-1]
    grid, constexprs = plan(r, kp, has_macro, n_out, dtype, config)
    ov, oi = outlier_words(mx.outlier_values, mx.outlier_indices) if n_out else (mx.scales, mx.scales)
    dequantize_kernel[grid](
        mx.qdata.contiguous(), mx.scales.contiguous(),
        mx.macro_scales.contiguous() if has_macro else mx.scales, ov, oi,
        out.view(OUT_WORDS[dtype][0]), *int_args(mx), **constexprs, **options,
    )
    return out
