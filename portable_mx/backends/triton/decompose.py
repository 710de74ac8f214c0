"""The decompose kernel: quantize, dequantize and the per-block statistics of the exact
error decomposition (numerics.md section 3) in one pass over x; the three component
tensors and Q only on request.

The encoding is the quantize kernel's (bit-exact); the statistics are fp32 sums over each
32-block, equal to ``decompose.decompose_blocks`` up to fp32 summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...decompose import DEFINITIONS, Decomposition
from ...recipe import QuantRecipe
from .dequantize import decode_blocks
from .encode import chunk, encode_blocks, flat, load_blocks, macro_amax, span_start
from .launch import POINTER_TYPES, KernelLaunch, TileConfig
from .numerics import e2m1_round_nearest, e2m1_value, macro_factor
from .quantize import Plan

STATS = ("beta", "dead_count", "clip_count", "energy_scale", "energy_dead", "energy_grid",
         "energy_error", "energy_signal")
"""The rows of the kernel's statistics output, in order."""
COMPONENTS = ("dequantized", "scale_bias", "deadzone", "grid_noise")
"""The rows of the kernel's full-tensor output, in order."""


@triton.jit
def _sumsq(t):
    return tl.sum(t * t, axis=2)


@triton.jit
def components(x, q, rest, lane, idx1, idx2, COUNTERFACTUAL: tl.constexpr, N_OUT: tl.constexpr):
    """(beta, dead mask, e_scale, e_dead, e_grid) of one chunk: decompose.gain_components,
    or decompose.counterfactual_components (beta is still the gain) when COUNTERFACTUAL."""
    dead = (q == 0.0) & (x != 0.0)
    num = tl.sum(tl.where(dead, 0.0, q * x), axis=2)
    den = tl.sum(tl.where(dead, 0.0, x * x), axis=2)
    beta = tl.where(den > 0, tl.math.div_rn(num, tl.where(den > 0, den, 1.0)), 1.0)
    b = beta[:, :, None]
    if COUNTERFACTUAL:
        s = tl.math.div_rn(tl.max(tl.abs(rest), axis=2), tl.full(beta.shape, 6.0, tl.float32))[:, :, None]
        y = tl.math.div_rn(x, tl.broadcast_to(tl.where(s > 0, s, 1.0), x.shape))
        g = e2m1_value(e2m1_round_nearest(tl.abs(y)))
        q_star = tl.where(s > 0, s * tl.where(y < 0, -g, g), 0.0)
        if N_OUT >= 1:
            q_star = tl.where(lane == idx1[:, :, None], q, q_star)
            if N_OUT == 2:
                q_star = tl.where(lane == idx2[:, :, None], q, q_star)
        dead = (q_star == 0.0) & (x != 0.0)
        e_scale = q - q_star
        e_dead = tl.where(dead, -x, 0.0)
        e_grid = tl.where(dead, 0.0, q_star - x)
    else:
        e_dead = tl.where(dead, -x, 0.0)
        e_scale = tl.where(dead, 0.0, (b - 1.0) * x)
        e_grid = tl.where(dead, 0.0, q - b * x)
    return beta, dead, e_scale, e_dead, e_grid


@triton.jit
def decompose_kernel(
    x_ptr, stats_ptr, full_ptr,
    R, K, KP, stride_r, FULL_PLANE, seed,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPAN: tl.constexpr, NUM_CHUNKS: tl.constexpr,
    RULE: tl.constexpr, STOCHASTIC: tl.constexpr, HAS_MACRO: tl.constexpr, N_OUT: tl.constexpr,
    COUNTERFACTUAL: tl.constexpr, FULL: tl.constexpr,
):
    """x: float [R, K] (finite); stats: fp32 [8, R, KP/32] in the order of STATS;
    full: fp32 [4, R, KP] in the order of COMPONENTS (written when FULL), FULL_PLANE = R * KP."""
    NBK: tl.constexpr = BLOCK_K // 32
    rows, col_base, m = span_start(x_ptr, R, K, KP, stride_r, BLOCK_R, BLOCK_K, SPAN, NUM_CHUNKS, HAS_MACRO, N_OUT)
    NB = KP // 32
    lane = tl.arange(0, 32)[None, None, :]
    for c in range(NUM_CHUNKS):
        r2, c2, load_mask, store_mask, bidx, bmask = chunk(rows, col_base, c, R, K, KP, BLOCK_K, SPAN)
        x, rest, special, idx1, bits1, idx2, bits2 = load_blocks(x_ptr, r2, c2, load_mask, stride_r, BLOCK_R,
                                                                 BLOCK_K, N_OUT)
        if HAS_MACRO and NUM_CHUNKS == 1:
            m = macro_factor(macro_amax(rest))
        y, code, e = encode_blocks(rest, special, m, r2, c2, KP, seed, RULE, STOCHASTIC, HAS_MACRO, BLOCK_R, BLOCK_K)
        mb = tl.broadcast_to(m[:, None], (BLOCK_R, NBK))
        q = decode_blocks(code, tl.where(special, 255, e + 127), mb, idx1, bits1, idx2, bits2, N_OUT)
        beta, dead, e_scale, e_dead, e_grid = components(x, q, rest, lane, idx1, idx2, COUNTERFACTUAL, N_OUT)

        plane = R * NB
        sp = stats_ptr + rows[:, None] * NB + bidx
        tl.store(sp, beta, mask=bmask)
        tl.store(sp + plane, tl.sum(dead.to(tl.float32), axis=2), mask=bmask)
        tl.store(sp + 2 * plane, tl.sum((tl.abs(y) > 6.0).to(tl.float32), axis=2), mask=bmask)
        tl.store(sp + 3 * plane, _sumsq(e_scale), mask=bmask)
        tl.store(sp + 4 * plane, _sumsq(e_dead), mask=bmask)
        tl.store(sp + 5 * plane, _sumsq(e_grid), mask=bmask)
        tl.store(sp + 6 * plane, _sumsq(q - x), mask=bmask)
        tl.store(sp + 7 * plane, _sumsq(x), mask=bmask)
        if FULL:
            fp = full_ptr + r2 * KP + c2
            tl.store(fp, flat(q, BLOCK_R, BLOCK_K), mask=store_mask)
            tl.store(fp + FULL_PLANE, flat(e_scale, BLOCK_R, BLOCK_K), mask=store_mask)
            tl.store(fp + 2 * FULL_PLANE, flat(e_dead, BLOCK_R, BLOCK_K), mask=store_mask)
            tl.store(fp + 3 * FULL_PLANE, flat(e_grid, BLOCK_R, BLOCK_K), mask=store_mask)


def _constexprs(recipe: QuantRecipe, config: TileConfig, definition: str, full: bool) -> tuple[Plan, dict]:
    plan = Plan.make(recipe, config)
    return plan, {**plan.constexprs, "COUNTERFACTUAL": definition == "counterfactual", "FULL": full}


def launch_spec(dtype: torch.dtype, recipe: QuantRecipe, definition: str, full: bool, config: TileConfig,
                options: dict) -> KernelLaunch:
    """The launch :func:`decompose` makes, as data (for AOT)."""
    _, constexprs = _constexprs(recipe, config, definition, full)
    signature = {"x_ptr": POINTER_TYPES[dtype], "stats_ptr": "*fp32", "full_ptr": "*fp32",
                 "R": "i32", "K": "i32", "KP": "i32", "stride_r": "i32", "FULL_PLANE": "i32", "seed": "i64"}
    signature.update({name: "constexpr" for name in constexprs})
    label = f"{str(dtype).removeprefix('torch.')} {recipe.describe()} {definition}{' full' if full else ''} {config.label()}"
    return KernelLaunch("decompose", decompose_kernel, signature, constexprs, dict(options), label,
                        divisible_by_16=("K", "KP", "stride_r", "FULL_PLANE"))


def decompose(x: torch.Tensor, recipe: QuantRecipe, definition: str, full: bool, config: TileConfig,
              options: dict) -> Decomposition:
    """x: finite float [R, K] on the kernel's device (last dim contiguous) -> a
    Decomposition in the rows layout (per-block [R, Kp/32], element tensors [R, Kp])."""
    if definition not in DEFINITIONS:
        raise ValueError(f"definition must be one of {DEFINITIONS}; got {definition!r}")
    r, k = x.shape
    kp = -(-k // 32) * 32
    plan, constexprs = _constexprs(recipe, config, definition, full)
    stats = torch.empty(len(STATS), r, kp // 32, dtype=torch.float32, device=x.device)
    full_out = torch.empty(len(COMPONENTS), r, kp, dtype=torch.float32, device=x.device) if full else stats
    grid = (triton.cdiv(r, plan.block_r), triton.cdiv(kp, plan.span))
    decompose_kernel[grid](x, stats, full_out, r, k, kp, x.stride(0), r * kp, recipe.seed, **constexprs, **options)
    per_block = dict(zip(STATS, stats.unbind(0)))
    for name in ("dead_count", "clip_count"):
        per_block[name] = per_block[name].to(torch.int32)
    elements = dict(zip(COMPONENTS, full_out.unbind(0))) if full else {}
    return Decomposition(definition=definition, recipe=recipe, axis=1, **per_block, **elements)
