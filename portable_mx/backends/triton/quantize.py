"""The quantize kernel: x [R, K] (fp32 / bf16 / fp16) -> packed codes, E8M0 scales and,
per the recipe, macro factors and outliers. Bit-exact with ``reference.encode``.

One program owns ``BLOCK_R`` rows by one span: ``BLOCK_K`` columns, or a whole macro
block with macro-block scaling. A span of one chunk is read once; a macro block longer
than ``BLOCK_K`` is read twice (once for its amax, once to encode), from L2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...recipe import QuantRecipe
from .encode import chunk, encode_blocks, load_blocks, macro_amax, span_start
from .launch import POINTER_TYPES, KernelLaunch, TileConfig
from .numerics import RULE_IDS, macro_factor


@triton.jit
def quantize_kernel(
    x_ptr, q_ptr, s_ptr, m_ptr, ov_ptr, oi_ptr,
    R, K, KP, KP2, NM, stride_r, seed,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPAN: tl.constexpr, NUM_CHUNKS: tl.constexpr,
    RULE: tl.constexpr, STOCHASTIC: tl.constexpr, HAS_MACRO: tl.constexpr, N_OUT: tl.constexpr,
):
    """q: uint8 [R, KP2 = KP/2]; s: uint8 [R, KP/32]; m: fp32 [R, NM] (HAS_MACRO);
    ov: int16 (bf16 bits) and oi: uint8 [R, KP/32, N_OUT] (N_OUT > 0)."""
    pid_k = tl.program_id(1)
    rows, col_base, m = span_start(x_ptr, R, K, KP, stride_r, BLOCK_R, BLOCK_K, SPAN, NUM_CHUNKS, HAS_MACRO, N_OUT)
    NB = KP // 32
    for c in range(NUM_CHUNKS):
        r2, c2, load_mask, store_mask, bidx, bmask = chunk(rows, col_base, c, R, K, KP, BLOCK_K, SPAN)
        _, rest, special, idx1, bits1, idx2, bits2 = load_blocks(x_ptr, r2, c2, load_mask, stride_r, BLOCK_R,
                                                                 BLOCK_K, N_OUT)
        if HAS_MACRO and NUM_CHUNKS == 1:
            m = macro_factor(macro_amax(rest))
        _, code, e = encode_blocks(rest, special, m, r2, c2, KP, seed, RULE, STOCHASTIC, HAS_MACRO, BLOCK_R, BLOCK_K)

        lo, hi = tl.split(tl.reshape(code, (BLOCK_R, BLOCK_K // 2, 2)))
        packed = (lo | (hi << 4)).to(tl.uint8)
        half = c * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)[None, :]  # byte within the span
        pcol = pid_k * (SPAN // 2) + half
        tl.store(q_ptr + r2 * KP2 + pcol, packed, mask=(r2 < R) & (half < SPAN // 2) & (pcol < KP2))

        sbyte = tl.where(special, 255, e + 127).to(tl.uint8)
        tl.store(s_ptr + rows[:, None] * NB + bidx, sbyte, mask=bmask)
        if N_OUT >= 1:
            o = (rows[:, None] * NB + bidx) * N_OUT
            tl.store(ov_ptr + o, bits1.to(tl.int16), mask=bmask)
            tl.store(oi_ptr + o, idx1.to(tl.uint8), mask=bmask)
            if N_OUT == 2:
                tl.store(ov_ptr + o + 1, bits2.to(tl.int16), mask=bmask)
                tl.store(oi_ptr + o + 1, idx2.to(tl.uint8), mask=bmask)
    if HAS_MACRO:
        tl.store(m_ptr + rows * NM + pid_k, m, mask=rows < R)


@dataclass(frozen=True)
class Plan:
    """How a recipe maps onto the kernel for one tile config: the span a program covers,
    its chunking, and the constexprs."""

    block_r: int
    block_k: int
    span: int
    num_chunks: int
    constexprs: dict

    @staticmethod
    def make(recipe: QuantRecipe, config: TileConfig) -> "Plan":
        mb = recipe.macro_block
        block_r, block_k = config.block_r, config.block_k
        if mb is None:
            span, chunks = block_k, 1
        elif mb <= block_k:
            # one macro block per program: a chunk just covering it, more rows to keep
            # the tile's element count
            chunk_k = triton.next_power_of_2(mb)
            block_r, block_k = block_r * (block_k // chunk_k), chunk_k
            span, chunks = mb, 1
        else:
            span, chunks = mb, -(-mb // block_k)
        constexprs = {
            "BLOCK_R": block_r, "BLOCK_K": block_k, "SPAN": span, "NUM_CHUNKS": chunks,
            "RULE": RULE_IDS[recipe.scale_rule], "STOCHASTIC": recipe.rounding == "stochastic",
            "HAS_MACRO": mb is not None, "N_OUT": recipe.outliers_per_block,
        }
        return Plan(block_r, block_k, span, chunks, constexprs)


_INT_ARGS = ("R", "K", "KP", "KP2", "NM", "stride_r")


def launch_spec(dtype: torch.dtype, recipe: QuantRecipe, config: TileConfig, options: dict) -> KernelLaunch:
    """The launch :func:`quantize` makes for inputs of ``dtype``, as data (for AOT)."""
    plan = Plan.make(recipe, config)
    # unused outputs are passed the scales tensor (see quantize), hence "*u8"
    signature = {"x_ptr": POINTER_TYPES[dtype], "q_ptr": "*u8", "s_ptr": "*u8",
                 "m_ptr": "*fp32" if recipe.macro_block else "*u8",
                 "ov_ptr": "*i16" if recipe.outliers_per_block else "*u8", "oi_ptr": "*u8",
                 **{a: "i32" for a in _INT_ARGS}, "seed": "i64"}
    signature.update({name: "constexpr" for name in plan.constexprs})
    return KernelLaunch("quantize", quantize_kernel, signature, dict(plan.constexprs), dict(options),
                        f"{str(dtype).removeprefix('torch.')} {recipe.describe()} {config.label()}",
                        divisible_by_16=("K", "KP", "KP2", "stride_r"))


def quantize(x: torch.Tensor, recipe: QuantRecipe, config: TileConfig, options: dict):
    """x: float [R, K] on the kernel's device (last dim contiguous) -> (qdata uint8
    [R, Kp/2], scales uint8 [R, Kp/32], macro fp32 [R, ceil(Kp/mb)] or None, outlier
    values bf16 [R, Kp/32, k] or None, outlier indices uint8 [R, Kp/32, k] or None)."""
    r, k = x.shape
    kp = -(-k // 32) * 32
    nb = kp // 32
    plan = Plan.make(recipe, config)
    dev = x.device
    qdata = torch.empty(r, kp // 2, dtype=torch.uint8, device=dev)
    scales = torch.empty(r, nb, dtype=torch.uint8, device=dev)
    mb = recipe.macro_block
    nm = -(-kp // mb) if mb else 1
    macro = torch.empty(r, nm, dtype=torch.float32, device=dev) if mb else None
    n_out = recipe.outliers_per_block
    ov = torch.empty(r, nb, n_out, dtype=torch.bfloat16, device=dev) if n_out else None
    oi = torch.empty(r, nb, n_out, dtype=torch.uint8, device=dev) if n_out else None
    grid = (triton.cdiv(r, plan.block_r), triton.cdiv(kp, plan.span))
    quantize_kernel[grid](
        x, qdata, scales,
        macro if macro is not None else scales,
        ov.view(torch.int16) if ov is not None else scales,
        oi if oi is not None else scales,
        r, k, kp, kp // 2, nm, x.stride(0), recipe.seed,
        **plan.constexprs, **options,
    )
    return qdata, scales, macro, ov, oi
