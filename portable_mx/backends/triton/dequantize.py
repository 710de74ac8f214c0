"""The dequantize kernel: an MXTensor in the rows layout -> fp32 [R, Kp], exact and
bit-identical to ``reference.decode_rows`` (code * (2**(b-127) * m), outliers written
over their positions, NaN where the scale byte is 0xFF)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...tensor import MXTensor
from .launch import KernelLaunch, TileConfig
from .numerics import bf16_bits_to_f32, e2m1_value, exp2i


@triton.jit
def decode_blocks(code, sbyte, m, idx1, bits1, idx2, bits2, N_OUT: tl.constexpr):
    """fp32 values [BR, NBK, 32] of codes (int32 0..15) with scale bytes [BR, NBK], macro
    factors [BR, NBK] (1 without macro blocks) and outliers (in-block index, bf16 bits)."""
    scale = exp2i(sbyte - 127) * m
    mag = e2m1_value(code & 7)
    q = tl.where((code & 8) != 0, -mag, mag) * scale[:, :, None]
    lane = tl.arange(0, 32)[None, None, :]
    if N_OUT >= 1:
        q = tl.where(lane == idx1[:, :, None], bf16_bits_to_f32(bits1)[:, :, None], q)
        if N_OUT == 2:
            q = tl.where(lane == idx2[:, :, None], bf16_bits_to_f32(bits2)[:, :, None], q)
    return tl.where((sbyte == 255)[:, :, None], float("nan"), q)


@triton.jit
def dequantize_kernel(
    q_ptr, s_ptr, m_ptr, ov_ptr, oi_ptr, out_ptr,
    R, KP, NM, MACRO,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, HAS_MACRO: tl.constexpr, N_OUT: tl.constexpr,
):
    """q: uint8 [R, KP/2]; s: uint8 [R, KP/32]; m: fp32 [R, NM]; ov: int16 (bf16 bits) and
    oi: uint8 [R, KP/32, N_OUT]; out: fp32 [R, KP]. MACRO is the macro block length."""
    NBK: tl.constexpr = BLOCK_K // 32
    NB = KP // 32
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    bidx = tl.program_id(1) * NBK + tl.arange(0, NBK)
    bmask = (rows[:, None] < R) & (bidx < NB)[None, :]
    boff = rows[:, None] * NB + bidx[None, :]

    pcol = tl.program_id(1) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    pmask = (rows[:, None] < R) & (pcol < KP // 2)[None, :]
    packed = tl.load(q_ptr + rows[:, None] * (KP // 2) + pcol[None, :], mask=pmask, other=0).to(tl.int32)
    code = tl.reshape(tl.join(packed & 15, packed >> 4), (BLOCK_R, NBK, 32))

    sbyte = tl.load(s_ptr + boff, mask=bmask, other=0).to(tl.int32)
    m = tl.full((BLOCK_R, NBK), 1.0, tl.float32)
    if HAS_MACRO:
        m = tl.load(m_ptr + rows[:, None] * NM + (bidx * 32 // MACRO)[None, :], mask=bmask, other=1.0)
    idx1 = tl.zeros((BLOCK_R, NBK), tl.int32)
    bits1 = idx1
    idx2 = idx1
    bits2 = idx1
    if N_OUT >= 1:
        idx1 = tl.load(oi_ptr + boff * N_OUT, mask=bmask, other=0).to(tl.int32)
        bits1 = tl.load(ov_ptr + boff * N_OUT, mask=bmask, other=0).to(tl.int32)
        if N_OUT == 2:
            idx2 = tl.load(oi_ptr + boff * N_OUT + 1, mask=bmask, other=0).to(tl.int32)
            bits2 = tl.load(ov_ptr + boff * N_OUT + 1, mask=bmask, other=0).to(tl.int32)
    q = decode_blocks(code, sbyte, m, idx1, bits1, idx2, bits2, N_OUT)

    col = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    omask = (rows[:, None] < R) & (col < KP)[None, :]
    tl.store(out_ptr + rows[:, None] * KP + col[None, :], tl.reshape(q, (BLOCK_R, BLOCK_K)), mask=omask)


def _constexprs(mx_macro: bool, n_out: int, config: TileConfig) -> dict:
    return {"BLOCK_R": config.block_r, "BLOCK_K": config.block_k, "HAS_MACRO": mx_macro, "N_OUT": n_out}


def launch_spec(has_macro: bool, n_out: int, config: TileConfig, options: dict) -> KernelLaunch:
    """The launch :func:`dequantize` makes for MXTensors with/without macro factors and
    ``n_out`` outliers per block, as data (for AOT)."""
    constexprs = _constexprs(has_macro, n_out, config)
    signature = {"q_ptr": "*u8", "s_ptr": "*u8", "m_ptr": "*fp32" if has_macro else "*u8",
                 "ov_ptr": "*i16" if n_out else "*u8", "oi_ptr": "*u8", "out_ptr": "*fp32",
                 "R": "i32", "KP": "i32", "NM": "i32", "MACRO": "i32"}
    signature.update({name: "constexpr" for name in constexprs})
    label = f"{'MBS ' if has_macro else ''}{f'OF-{n_out} ' if n_out else ''}{config.label()}"
    return KernelLaunch("dequantize", dequantize_kernel, signature, constexprs, dict(options), label,
                        divisible_by_16=("KP",))


def dequantize(mx: MXTensor, config: TileConfig, options: dict) -> torch.Tensor:
    """MXTensor (R, K), axis 1, on the kernel's device -> fp32 [R, Kp]."""
    r = mx.qdata.shape[0]
    kp = mx.k_padded
    out = torch.empty(r, kp, dtype=torch.float32, device=mx.device)
    has_macro = mx.macro_scales is not None
    n_out = 0 if mx.outlier_values is None else mx.outlier_values.shape[-1]
    grid = (triton.cdiv(r, config.block_r), triton.cdiv(kp, config.block_k))
    dequantize_kernel[grid](
        mx.qdata.contiguous(), mx.scales.contiguous(),
        mx.macro_scales.contiguous() if has_macro else mx.scales,
        mx.outlier_values.contiguous().view(torch.int16) if n_out else mx.scales,
        mx.outlier_indices.contiguous() if n_out else mx.scales,
        out, r, kp,
        mx.macro_scales.shape[-1] if has_macro else 1,
        mx.recipe.macro_block if has_macro else 32,
        **_constexprs(has_macro, n_out, config), **options,
    )
    return out
