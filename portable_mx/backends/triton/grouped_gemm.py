"""The grouped MXFP4 GEMM over ragged experts, and the deterministic k-way combine of a
scattering one.

``C[i] = act(A[src(i)] @ W[e(i)]^T + bias[e(i)])`` for the R expert-sorted rows i, each
in the segment of its expert e(i) (the cumulative ends ``offsets``), reading A's row
``src(i) = gather[i]`` (or i) in the A load. One launch; the programs walk a fixed-size
tile schedule (moe/routing.py: (expert, first row) per tile of BLOCK_M rows, -1 past the
last), so the grid depends on R, E and BLOCK_M only and nothing is read on the host.

The two kernels take the dense GEMM's routes and reuse its tile code: :func:`grouped_kernel`
is gemm.py's ``tl.dot_scaled`` K loop (native block-scaled MMA on sm_100, sm_120 and
gfx950; the interpreter), :func:`grouped_upcast_kernel` gemm_upcast.py's (the MXFP4 tiles
decoded in registers, the tokens on the MMA's N: sm_90, gfx942). A tile's rows and the
weight rows become index vectors into the whole operands: the left operand's rows are
the gathered sources (rows outside the tile's expert point past A, so the dense code's
row masks drop them), the weight rows are ``e * N + n`` of the (E*N, K) rows view (columns
past N point past it). MBS, OF and split-K work as in the dense kernels. The weight of
the sm_90 upcast route is read in the hopper layout when N is a multiple of 64 (every
expert's rows start a 64-row block), from a copy padded by 256 rows (a tile may run past
its expert's last row).

Epilogue (fp32, in the last program of a split-K tile): plus ``bias[e]`` (any float
dtype, widened exactly), then the gated activation of moe/activations.py on the
(gate, up) column pairs: "swiglu_oai" reads them interleaved (gpt-oss), "swiglu"
concatenated, which the kernel turns into the interleaved order by reading weight rows
(n/2 for even tile columns n, N/2 + n/2 for odd ones), so that both fuse alike and a
tile of BLOCK_N columns writes BLOCK_N/2. The store writes C's dtype.

:func:`combine_kernel`: ``out[t] = sum over j = 0..k-1 in order of w[t, j] * rows[index[t * k + j]]``,
fp32 products and sums without FMA: bit for bit the reference's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from . import splitk
from .gemm import FORMATS, Operand, Plan, macro_factors, scaled_k_loop
from .gemm_upcast import after_k_loop, block_k_of, constexprs as upcast_constexprs, folded_decode, upcast_k_loop
from .launch import POINTER_TYPES, GemmConfig, KernelLaunch, Launch, TileConfig

ACTIVATION_IDS = {None: "", "swiglu_oai": "swiglu_oai", "swiglu": "swiglu"}


@triton.jit
def _activate(gate, up, ACT: tl.constexpr):
    """moe/activations.py in fp32; NaN propagates through the clamps (tl.where, not min)."""
    if ACT == "swiglu_oai":
        g = tl.where(gate > 7.0, 7.0, gate)
        u = tl.where(up > 7.0, 7.0, tl.where(up < -7.0, -7.0, up))
        out = (g * (1.0 / (1.0 + tl.exp(-(1.702 * g))))) * (u + 1.0)
    else:
        out = (gate * (1.0 / (1.0 + tl.exp(-gate)))) * up
    return out


@triton.jit
def _tile(sched_ptr, off_ptr, gather_ptr, slot, XR, NE, N, pid_n, GATHER: tl.constexpr, GLU_CONCAT: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The rows and columns of one program: (expert (-1: an unused slot), sorted rows
    [BLOCK_M] (int64), which are valid, A's row of each (XR where invalid), the tile's
    logical columns [BLOCK_N], the weight rows of each (E*N where past N))."""
    expert = tl.load(sched_ptr + 2 * slot)
    row0 = tl.load(sched_ptr + 2 * slot + 1)
    end = tl.where(expert < 0, 0, tl.load(off_ptr + tl.maximum(expert, 0)))  # unused slots: row0 = 0, no rows
    rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = rows < end
    if GATHER:
        src = tl.load(gather_ptr + rows, mask=valid, other=0).to(tl.int64)
    else:
        src = rows
    rm = tl.where(valid, src, XR)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if GLU_CONCAT:
        wrow = tl.where(cols % 2 == 0, cols // 2, N // 2 + cols // 2)
    else:
        wrow = cols
    rn = tl.where(cols < N, expert.to(tl.int64) * N + wrow, NE * N)
    return expert, rows, valid, rm, cols, wrow, rn


@triton.jit
def _epilogue_rows(acc, bias_ptr, expert, wrow, cols, N, BIAS: tl.constexpr, ACT: tl.constexpr,
                   BLOCK_N: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Bias and activation of a finished fp32 tile: acc [BLOCK_M, BLOCK_N] (or
    [BLOCK_N, BLOCK_M] when TRANSPOSED) -> (tile, its output columns' count BLOCK_N or
    BLOCK_N / 2)."""
    if BIAS:
        b = tl.load(bias_ptr + expert.to(tl.int64) * N + wrow, mask=cols < N, other=0.0).to(tl.float32)
        if TRANSPOSED:
            acc = acc + b[:, None]
        else:
            acc = acc + b[None, :]
    if ACT != "":
        if TRANSPOSED:
            pairs = tl.reshape(acc, (BLOCK_N // 2, 2, acc.shape[1]))
            gate, up = tl.split(tl.permute(pairs, (0, 2, 1)))
        else:
            gate, up = tl.split(tl.reshape(acc, (acc.shape[0], BLOCK_N // 2, 2)))
        acc = _activate(gate, up, ACT)
    return acc


@triton.jit
def grouped_kernel(
    a_ptr, as_ptr, am_ptr, aov_ptr, aoi_ptr,
    b_ptr, bs_ptr, bm_ptr, bov_ptr, boi_ptr,
    c_ptr, part_ptr, count_ptr, sched_ptr, off_ptr, gather_ptr, bias_ptr,
    XR, N, K, KP, stride_am, stride_cm, NMA, NMB, MACRO_A, MACRO_B, SLOTS, NE,
    A_FORMAT: tl.constexpr, A_MACRO: tl.constexpr, B_MACRO: tl.constexpr,
    A_OUT: tl.constexpr, B_OUT: tl.constexpr, EVEN_K: tl.constexpr, EPILOGUE: tl.constexpr,
    B_LAYOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr,
    GATHER: tl.constexpr, BIAS: tl.constexpr, ACT: tl.constexpr, GLU_CONCAT: tl.constexpr,
):
    """The grouped GEMM with ``tl.dot_scaled`` (gemm.py's K loop). A: as gemm_kernel's,
    XR rows; B: the (NE*N, K) rows view of the expert weights (scales in B_LAYOUT); C
    [R, N or N/2] (row stride stride_cm), sorted rows; sched_ptr: int32 [SLOTS, 2]
    (expert, first row); off_ptr: int32 [NE] row ends; gather_ptr: int32 [R] (GATHER);
    bias_ptr: [NE, N] (BIAS); ACT: "", "swiglu_oai" or "swiglu" (GLU_CONCAT: "swiglu"'s
    concatenated halves)."""
    slot, pid_n, pid_k, grid_n = splitk.program_tile(SLOTS * BLOCK_M, N, BLOCK_M, BLOCK_N, GROUP_M, SPLIT_K)
    expert, rows, valid, rm, cols, wrow, rn = _tile(sched_ptr, off_ptr, gather_ptr, slot, XR, NE, N, pid_n, GATHER,
                                                   GLU_CONCAT, BLOCK_M, BLOCK_N)
    NT = NE * N
    NB = KP // 32
    first, last = splitk.tile_k_range(pid_k, KP, BLOCK_K, SPLIT_K)
    last = tl.where(expert < 0, first, last)  # an unused slot: no K tiles, nothing stored
    acc = scaled_k_loop(
        a_ptr, as_ptr, am_ptr, aov_ptr, aoi_ptr, b_ptr, bs_ptr, bm_ptr, bov_ptr, boi_ptr,
        rm, rn, first, last, XR, NT, K, KP, NB, stride_am, NMA, NMB, MACRO_A, MACRO_B,
        A_FORMAT, A_MACRO, B_MACRO, A_OUT, B_OUT, EVEN_K, EPILOGUE, B_LAYOUT, BLOCK_M, BLOCK_N, BLOCK_K)

    if expert >= 0:
        mask = valid[:, None] & (cols[None, :] < N)
        if SPLIT_K > 1:
            offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            acc, is_last = splitk.combine(acc, offs, mask, part_ptr, count_ptr, slot * grid_n + pid_n, pid_k,
                                          SPLIT_K, BLOCK_M * BLOCK_N)
        else:
            is_last = True
        if is_last:
            if EPILOGUE:
                ma, mb = macro_factors(am_ptr, bm_ptr, rm, rn, XR, NT, NMA, NMB, 0, 0, A_MACRO, B_MACRO,
                                       BLOCK_M, BLOCK_N)
                acc = acc * (ma[:, None] * mb[None, :])
            res = _epilogue_rows(acc, bias_ptr, expert, wrow, cols, N, BIAS, ACT, BLOCK_N, False)
            if ACT != "":
                oc = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
                omask = valid[:, None] & (oc[None, :] < N // 2)
            else:
                oc = cols
                omask = mask
            tl.store(c_ptr + rows[:, None] * stride_cm + oc[None, :], res.to(c_ptr.dtype.element_ty), mask=omask)


@triton.jit
def grouped_upcast_kernel(
    a_ptr, as_ptr, am_ptr, aov_ptr, aoi_ptr,
    b_ptr, bs_ptr, bm_ptr, bov_ptr, boi_ptr, bsmax_ptr,
    c_ptr, part_ptr, count_ptr, sched_ptr, off_ptr, gather_ptr, bias_ptr,
    XR, N, K, KP, stride_am, stride_cm, stride_bv, stride_bs, NMA, NMB, MACRO_A, MACRO_B, SLOTS, NE,
    A_FORMAT: tl.constexpr, A_MACRO: tl.constexpr, B_MACRO: tl.constexpr,
    A_OUT: tl.constexpr, B_OUT: tl.constexpr, EVEN_K: tl.constexpr, EPILOGUE: tl.constexpr,
    VALUES: tl.constexpr, ASM: tl.constexpr, DOT: tl.constexpr, SCALE_WORDS: tl.constexpr, FOLD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    GATHER: tl.constexpr, BIAS: tl.constexpr, ACT: tl.constexpr, GLU_CONCAT: tl.constexpr,
):
    """The grouped GEMM with the weight decoded in registers (gemm_upcast.py's K loop,
    the tokens on the MMA's N: ``acc[BLOCK_N, BLOCK_M]``). Operands and epilogue as
    :func:`grouped_kernel`'s; B's codes and scales in layout VALUES (plain: the rows view's
    own, strides stride_bv / stride_bs a row; hopper: a padded swizzled copy, 64-row block
    strides, N a multiple of 64). FOLD: the folded decode where every scale byte of the
    experts is at most 128 (bsmax_ptr: uint8 [1], their largest), as upcast_gemm_kernel."""
    slot, pid_n, pid_k, grid_n = splitk.program_tile(SLOTS * BLOCK_M, N, BLOCK_M, BLOCK_N, GROUP_M, SPLIT_K)
    expert, rows, valid, rm, cols, wrow, rn = _tile(sched_ptr, off_ptr, gather_ptr, slot, XR, NE, N, pid_n, GATHER,
                                                   GLU_CONCAT, BLOCK_M, BLOCK_N)
    NT = NE * N
    NB = KP // 32
    if VALUES == 1:  # the hopper layout: this expert's first 64-row block
        base = tl.maximum(expert, 0).to(tl.int64) * (N // 64)
        b_ptr += base * stride_bv
        bs_ptr += base * stride_bs

    first, last = splitk.tile_k_range(pid_k, KP, BLOCK_K, SPLIT_K)
    last = tl.where(expert < 0, first, last)
    # the dense outlier tile (the tokens of a tile are gathered rows: no sparse correction);
    # each branch finishes its own tile (gemm_upcast.upcast_gemm_kernel)
    if folded_decode(bsmax_ptr, FOLD):
        acc = upcast_k_loop(
            a_ptr, as_ptr, am_ptr, aov_ptr, aoi_ptr, b_ptr, bs_ptr, bm_ptr, bov_ptr, boi_ptr,
            rm, rn, pid_n, first, last, XR, NT, K, KP, NB, stride_am, stride_bv, stride_bs, NMA, NMB, MACRO_A,
            MACRO_B, A_FORMAT, A_MACRO, B_MACRO, A_OUT, B_OUT, EVEN_K, EPILOGUE, VALUES, ASM, DOT, SCALE_WORDS,
            False, 0, -1, BLOCK_M, BLOCK_N, BLOCK_K)
        _finish_upcast(acc, am_ptr, bm_ptr, c_ptr, part_ptr, count_ptr, bias_ptr, expert, rows, valid, rm, rn,
                       cols, wrow, slot, pid_n, pid_k, grid_n, XR, N, NT, NMA, NMB, stride_cm, A_MACRO, B_MACRO,
                       EPILOGUE, BIAS, ACT, BLOCK_M, BLOCK_N, SPLIT_K)
    else:
        acc = upcast_k_loop(
            a_ptr, as_ptr, am_ptr, aov_ptr, aoi_ptr, b_ptr, bs_ptr, bm_ptr, bov_ptr, boi_ptr,
            rm, rn, pid_n, first, last, XR, NT, K, KP, NB, stride_am, stride_bv, stride_bs, NMA, NMB, MACRO_A,
            MACRO_B, A_FORMAT, A_MACRO, B_MACRO, A_OUT, B_OUT, EVEN_K, EPILOGUE, VALUES, ASM, DOT, SCALE_WORDS,
            True, 0, -1, BLOCK_M, BLOCK_N, BLOCK_K)
        _finish_upcast(acc, am_ptr, bm_ptr, c_ptr, part_ptr, count_ptr, bias_ptr, expert, rows, valid, rm, rn,
                       cols, wrow, slot, pid_n, pid_k, grid_n, XR, N, NT, NMA, NMB, stride_cm, A_MACRO, B_MACRO,
                       EPILOGUE, BIAS, ACT, BLOCK_M, BLOCK_N, SPLIT_K)


@triton.jit
def _finish_upcast(acc, am_ptr, bm_ptr, c_ptr, part_ptr, count_ptr, bias_ptr, expert, rows, valid, rm, rn, cols,
                   wrow, slot, pid_n, pid_k, grid_n, XR, N, NT, NMA, NMB, stride_cm, A_MACRO: tl.constexpr,
                   B_MACRO: tl.constexpr, EPILOGUE: tl.constexpr, BIAS: tl.constexpr, ACT: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr):
    """The end of :func:`grouped_upcast_kernel` (acc [BLOCK_N, BLOCK_M]): split-K
    partials combined, macro factors, bias, activation, the transposed tile stored."""
    after_k_loop()
    if expert >= 0:
        mask = (cols[:, None] < N) & valid[None, :]
        if SPLIT_K > 1:
            offs = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
            acc, is_last = splitk.combine(acc, offs, mask, part_ptr, count_ptr, slot * grid_n + pid_n, pid_k,
                                          SPLIT_K, BLOCK_N * BLOCK_M)
        else:
            is_last = True
        if is_last:
            if EPILOGUE:
                ma, mb = macro_factors(am_ptr, bm_ptr, rm, rn, XR, NT, NMA, NMB, 0, 0, A_MACRO, B_MACRO,
                                       BLOCK_M, BLOCK_N)
                acc = acc * (mb[:, None] * ma[None, :])
            res = _epilogue_rows(acc, bias_ptr, expert, wrow, cols, N, BIAS, ACT, BLOCK_N, True)
            if ACT != "":
                oc = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
                omask = (oc[:, None] < N // 2) & valid[None, :]
            else:
                oc = cols
                omask = mask
            tl.store(c_ptr + rows[None, :] * stride_cm + oc[:, None], res.to(c_ptr.dtype.element_ty), mask=omask)


@triton.jit
def combine_kernel(rows_ptr, index_ptr, w_ptr, out_ptr, T, N, stride_r, stride_o,
                   K_SLOTS: tl.constexpr, WEIGHTS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
    """out [T, N] (row stride stride_o, out's dtype) = sum over j = 0..K_SLOTS-1, in order,
    of w[t, j] (float [T, K_SLOTS]; 1 without WEIGHTS) times rows[index[t * K_SLOTS + j]]
    (fp32 [R, N], row stride stride_r), each product and sum an fp32 operation."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    t_in = t < T
    mask = t_in[:, None] & (n[None, :] < N)
    acc = tl.zeros((BLOCK_T, BLOCK_N), tl.float32)
    for j in tl.static_range(K_SLOTS):
        r = tl.load(index_ptr + t * K_SLOTS + j, mask=t_in, other=0).to(tl.int64)
        v = tl.load(rows_ptr + r[:, None] * stride_r + n[None, :], mask=mask, other=0.0)
        if WEIGHTS:
            v = v * tl.load(w_ptr + t * K_SLOTS + j, mask=t_in, other=0.0).to(tl.float32)[:, None]
        if j == 0:
            acc = v
        else:
            acc = acc + v
    tl.store(out_ptr + t[:, None] * stride_o + n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- host side


@dataclass(frozen=True)
class Epilogue:
    """What the grouped kernel does besides the product: gather the left rows, add a bias
    of dtype ``bias`` (None: none), apply ``activation`` (None, "swiglu_oai", "swiglu")."""

    gather: bool = False
    bias: Optional[torch.dtype] = None
    activation: Optional[str] = None

    def constexprs(self) -> dict:
        return {"GATHER": self.gather, "BIAS": self.bias is not None, "ACT": ACTIVATION_IDS[self.activation],
                "GLU_CONCAT": self.activation == "swiglu"}

    def label(self) -> str:
        parts = (["gather"] if self.gather else []) + (["bias"] if self.bias is not None else [])
        return "+".join(parts + ([self.activation] if self.activation else [])) or "plain"


def scaled_constexprs(a: Operand, b: Operand, kp: int, config: GemmConfig, layout, epi: Epilogue) -> dict:
    """The :func:`grouped_kernel` constexprs (gemm.Plan's plus the epilogue's, whose
    ``BIAS`` takes the place of the dense kernel's)."""
    consts = Plan.make(a, b, kp, config, layout).constexprs
    consts.pop("BIAS")
    return {**consts, **epi.constexprs()}


def upcast_kernel_constexprs(a: Operand, b: Operand, k: int, kp: int, config: GemmConfig, route, interpreted: bool,
                             epi: Epilogue, n: int, dot: Optional[str] = None) -> dict:
    """The :func:`grouped_upcast_kernel` constexprs: gemm_upcast's, the hopper value layout
    only where N is a multiple of 64 and the activation is not the concatenated "swiglu"
    (its weight rows are read out of order)."""
    consts = upcast_constexprs(a, b, k, kp, config, route, interpreted, dot)
    if consts["VALUES"] == 1 and (n % 64 or epi.activation == "swiglu"):
        from .gemm_upcast import UpcastRoute
        from .layouts import PLAIN_VALUES

        consts = upcast_constexprs(a, b, k, kp, config, UpcastRoute(PLAIN_VALUES, route.asm), interpreted, dot)
    consts.pop("SPARSE_M")  # the tokens of a tile are gathered rows: the dense outlier tile
    consts.pop("BIAS")  # (the epilogue's, below)
    if consts.pop("A_QUANT") != -1:  # (the grouped kernel reads its tokens' values from a values pass)
        raise ValueError(f"the grouped GEMM does not quantize its tokens in the kernel; got {a}")
    return {**consts, **epi.constexprs()}


_INT_SCALED = ("XR", "N", "K", "KP", "stride_am", "stride_cm", "NMA", "NMB", "MACRO_A", "MACRO_B", "SLOTS", "NE")
_INT_UPCAST = ("XR", "N", "K", "KP", "stride_am", "stride_cm", "stride_bv", "stride_bs", "NMA", "NMB", "MACRO_A",
               "MACRO_B", "SLOTS", "NE")


def _signature(a: Operand, b: Operand, out_dtype: torch.dtype, epi: Epilogue, ints, consts,
               upcast: bool = False) -> dict:
    sig = {
        "a_ptr": "*u8" if a.format is None else POINTER_TYPES[a.format], "as_ptr": "*u8",
        "am_ptr": "*fp32" if a.macro_block else "*u8", "aov_ptr": "*i16" if a.outliers else "*u8", "aoi_ptr": "*u8",
        "b_ptr": "*u8", "bs_ptr": "*u8", "bm_ptr": "*fp32" if b.macro_block else "*u8",
        "bov_ptr": "*i16" if b.outliers else "*u8", "boi_ptr": "*u8", **({"bsmax_ptr": "*u8"} if upcast else {}),
        "c_ptr": POINTER_TYPES[out_dtype], "part_ptr": "*fp32", "count_ptr": "*i32", "sched_ptr": "*i32",
        "off_ptr": "*i32", "gather_ptr": "*i32", "bias_ptr": POINTER_TYPES[epi.bias] if epi.bias is not None else "*i32",
        **{name: "i32" for name in ints},
    }
    sig.update({name: "constexpr" for name in consts})
    return sig


def launch_spec(kind: str, a: Operand, b: Operand, config: GemmConfig, options: dict, epi: Epilogue, layout=None,
                route=None, n: int = 2880, kp: int = 2880, out_dtype: torch.dtype = torch.bfloat16) -> KernelLaunch:
    """The launch the backend makes for a grouped GEMM of operands like ``a``, ``b``,
    N = ``n``, K = Kp = ``kp``, with ``config`` and ``epi`` (``kind``: "scaled", with the
    weight scales in ``layout``; "upcast", with ``route``), as data for the compile
    matrix. A4W4 "scaled" launches are ``multiplies_mx``."""
    fmt = "A4W4" if a.format is None else f"W4A16-{FORMATS[a.format]}"
    extras = [f"MBS-{m}" for m in sorted({a.macro_block, b.macro_block} - {None})]
    extras += [f"{side}OF-{c}" for side, c in (("a:", a.outliers), ("b:", b.outliers)) if c]
    if kind == "scaled":
        consts = scaled_constexprs(a, b, kp, config, layout, epi)
        sig = _signature(a, b, out_dtype, epi, _INT_SCALED, consts)
        if layout is not None and layout.layout_id:
            extras.append(f"scales:{layout.name}")
        fn, name, mx = grouped_kernel, "grouped-gemm", a.format is None
        divisible = ("K", "KP", "stride_am", "stride_cm")
    else:
        consts = upcast_kernel_constexprs(a, b, kp, kp, config, route, False, epi, n)
        sig = _signature(a, b, out_dtype, epi, _INT_UPCAST, consts, upcast=True)
        extras.append(f"upcast:{'hopper' if consts['VALUES'] == 1 else 'plain'}{'+asm' if consts['ASM'] else ''}"
                      f"{'+fold' if consts['FOLD'] else ''}")
        fn, name, mx = grouped_upcast_kernel, "grouped-gemm-upcast", False
        divisible = ("K", "KP", "stride_am", "stride_cm", "stride_bv", "stride_bs")
    extras.append(epi.label())
    if out_dtype != torch.float32:
        extras.append(f"out:{FORMATS.get(out_dtype, str(out_dtype))}")
    label = " ".join([fmt, *extras, config.label()])
    return KernelLaunch(name, fn, sig, consts, dict(options), label, multiplies_mx=mx, divisible_by_16=divisible)


def combine_launch_spec(k: int, weights: Optional[torch.dtype], out_dtype: torch.dtype, options: dict,
                        block_t: int = 16, block_n: int = 256) -> KernelLaunch:
    """The combine launch as data (compile matrix)."""
    consts = {"K_SLOTS": k, "WEIGHTS": weights is not None, "BLOCK_T": block_t, "BLOCK_N": block_n}
    sig = {"rows_ptr": "*fp32", "index_ptr": "*i32", "w_ptr": POINTER_TYPES[weights] if weights else "*fp32",
           "out_ptr": POINTER_TYPES[out_dtype], "T": "i32", "N": "i32", "stride_r": "i32", "stride_o": "i32",
           **{name: "constexpr" for name in consts}}
    label = f"k{k} {'weights' if weights else 'sum'} out:{FORMATS.get(out_dtype, str(out_dtype))} t{block_t}xn{block_n}"
    return KernelLaunch("grouped-combine", combine_kernel, sig, consts, dict(options), label,
                        divisible_by_16=("N", "stride_r", "stride_o"))



# ----------------------------------------------------------------------------- planned launches


class GroupedPlan:
    """One grouped launch, decided once per (operand kinds, shapes, epilogue, alignment):
    the kernel launch, the store dtype, the integer arguments, the tile height of the
    schedule, the weight's storage (None: the rows view's parts, else its key among the
    weight operand's kept layouts, ``_Operand.storage``, its value and scale layouts and,
    for the upcast kernel, whether its largest scale byte is read: :func:`_weight_storage`)
    and the split-K buffers (None without split-K, else :func:`splitk.buffers` and its
    sizes, as the dense plan's: the buffers are the launch stream's)."""

    __slots__ = ("launch", "store", "ints", "tile_m", "weight", "split")

    def __init__(self, launch, store, ints, tile_m, weight, split) -> None:
        self.launch, self.store, self.ints, self.tile_m = launch, store, ints, tile_m
        self.weight, self.split = weight, split


def _weight_storage(parts, values, scales, bsmax: Optional[bool] = None) -> tuple:
    """The rows view's GEMM ``parts`` with codes in ``values`` and scales in ``scales``
    (layouts.py), the hopper copies padded by 256 rows (a tile of the last expert may run
    past its rows); ``bsmax`` (the upcast kernel's last weight part): True, the experts'
    largest scale byte (read by its folded decode); False, a stand-in never read."""
    from .layouts import largest_scale, swizzled

    extra = () if bsmax is None else ((largest_scale(parts[1]) if bsmax else parts[1]),)
    codes, sc = parts[0], parts[1]
    if values.layout_id:
        codes = swizzled(torch.cat([codes, codes.new_zeros(256, codes.shape[1])]), values)
        sc = swizzled(torch.cat([sc, sc.new_zeros(256, sc.shape[1])]), scales)
    elif scales.layout_id:
        from .layouts import prepared

        sc = prepared(sc, scales)
    return (codes, sc, *parts[2:], *extra)


def plan(backend, st, key, a, wop, num_experts: int, rows: int, xr: int, stride_am: int, epi: Epilogue,
         out_dtype: torch.dtype, store_dtypes) -> GroupedPlan:
    """The launch of :func:`run` for its key (the config of
    ``backend.grouped_config``, the kernel of ``backend.gemm_route``)."""
    from .layouts import HOPPER, HOPPER_VALUES, PLAIN, PLAIN_VALUES

    oa = Operand(a.dtype, None, 0) if isinstance(a, torch.Tensor) else Operand.of(a)
    ob = Operand(*wop.kind)
    _, k, kp, nt, _ = wop.key
    n = nt // num_experts
    config = backend.grouped_config(st.target, rows, num_experts, oa.format, oa.heavy or ob.heavy,
                                    pair=oa.pairs_with(ob))
    from ...moe.routing import max_tiles

    slots = max_tiles(rows, num_experts, config.block_m)
    config = backend.resolve_split_k(config, slots * config.block_m, n, kp, backend.sm_count(st.device, st.target))
    route = backend.gemm_route(st.target, oa, ob)
    nma = -(-kp // oa.macro_block) if oa.macro_block else 1
    nmb = -(-kp // ob.macro_block) if ob.macro_block else 1
    macros = (oa.macro_block or 32, ob.macro_block or 32)
    n_out = n // 2 if epi.activation else n
    if route.kernel == "upcast":
        consts = upcast_kernel_constexprs(oa, ob, k, kp, config, route.upcast, st.target is None, epi, n)
        values, scales = (HOPPER_VALUES, HOPPER) if consts["VALUES"] == 1 else (PLAIN_VALUES, PLAIN)
        strides = ((values.row_stride(kp), scales.padded(1, kp // 32)[1] * 64) if values is HOPPER_VALUES
                   else (kp // 2, kp // 32))
        ints = (xr, n, k, kp, stride_am, n_out, *strides, nma, nmb, *macros, slots, num_experts)
        fn, name = grouped_upcast_kernel, "grouped-gemm-upcast"
    else:
        consts = scaled_constexprs(oa, ob, kp, config, route.scales, epi)
        values, scales = PLAIN_VALUES, route.scales
        ints = (xr, n, k, kp, stride_am, n_out, nma, nmb, *macros, slots, num_experts)
        fn, name = grouped_kernel, "grouped-gemm"
    weight = None
    if fn is grouped_upcast_kernel:  # its weight parts end with bsmax
        fold = bool(consts["FOLD"])
        weight = (f"grouped-weight:{values.name}:{scales.name}" + (":largest" if fold else ":bsmax-unread"),
                  values, scales, fold)
    elif values.layout_id or scales.layout_id:
        weight = (f"grouped-weight:{values.name}:{scales.name}", values, scales, None)
    split = consts["SPLIT_K"]
    tiles = slots * -(-n // config.block_n)
    store = out_dtype if not st.cast_output and out_dtype in store_dtypes else torch.float32
    launch = Launch(name, fn, (tiles * split,), dict(consts), backend.options(config), config)
    out = GroupedPlan(launch, store, ints, config.block_m, weight,
                      (splitk.buffers, tiles * split * config.block_m * config.block_n, tiles) if split > 1
                      else None)
    if len(st.grouped_plans) >= 4096:
        st.grouped_plans.clear()
    st.grouped_plans[key] = out
    return out


def _aligned(t: Optional[torch.Tensor]) -> bool:
    return t is None or t.data_ptr() % 16 == 0


def run(backend, st, a, a_parts: tuple, a_key: tuple, xr: int, stride_am: int, w, wop, num_experts: int,
        offsets: torch.Tensor, gather: Optional[torch.Tensor], bias: Optional[torch.Tensor],
        activation: Optional[str], out_dtype: torch.dtype, schedule, store_dtypes) -> torch.Tensor:
    """:meth:`Backend.grouped_matmul` with the kernels of this module: one launch (plus
    the schedule's few device ops when the routing has none for the tile height). The
    backend gives the left operand's kernel parts and plan key (``xr`` rows, row stride
    ``stride_am``), the weight's prepared operand ``wop`` (backend._Operand) and the
    dtypes the kernel stores."""
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    if not offsets.is_contiguous():
        offsets = offsets.contiguous()
    rows = xr if gather is None else gather.shape[0]
    # the epilogue's fields as a plain tuple in the key (an Epilogue per call costs ~1 us)
    key = (a_key, wop.key, num_experts, rows, xr, out_dtype, gather is not None,
           None if bias is None else bias.dtype, activation, _aligned(offsets), _aligned(gather), _aligned(bias))
    found = st.grouped_plans.get(key)
    if found is None:
        epi = Epilogue(gather is not None, None if bias is None else bias.dtype, activation)
        found = plan(backend, st, key, a, wop, num_experts, rows, xr, stride_am, epi, out_dtype, store_dtypes)
    n = wop.key[3] // num_experts
    c = torch.empty(rows, n // 2 if activation else n, dtype=found.store, device=w.device)
    if found.weight is None:
        b_parts = wop.parts
    else:
        name, values, scales, bsmax = found.weight
        b_parts = wop.storage(w, name, lambda _: _weight_storage(wop.parts, values, scales, bsmax))
    sched = schedule(found.tile_m)
    split = found.split
    part, counts = (c, c) if split is None else split[0](w.device, split[1], split[2])
    backend._launch(st, found.launch, (*a_parts, *b_parts, c, part, counts, sched, offsets,
                                       offsets if gather is None else gather,
                                       offsets if bias is None else bias, *found.ints))
    return c if c.dtype == out_dtype else c.to(out_dtype)


def run_combine(backend, st, rows: torch.Tensor, index: torch.Tensor, weights: Optional[torch.Tensor], k: int,
                out_dtype: torch.dtype, store_dtypes) -> torch.Tensor:
    """:meth:`Backend.combine` with :func:`combine_kernel` (one launch)."""
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if weights is not None and not weights.is_contiguous():
        weights = weights.contiguous()
    t, n = index.shape[0] // k, rows.shape[1]
    store = out_dtype if not st.cast_output and out_dtype in store_dtypes else torch.float32
    key = ("combine", t, n, k, rows.stride(0), None if weights is None else weights.dtype, store,
           _aligned(rows), _aligned(index), _aligned(weights))
    found = st.grouped_plans.get(key)
    if found is None:
        config = backend.tiles.get("combine", TileConfig(16, 256, num_warps=4))
        consts = {"K_SLOTS": k, "WEIGHTS": weights is not None, "BLOCK_T": config.block_r, "BLOCK_N": config.block_k}
        grid = (-(-t // config.block_r), -(-n // config.block_k))
        found = st.grouped_plans[key] = Launch("grouped-combine", combine_kernel, grid, consts,
                                               backend.options(config), config)
    out = torch.empty(t, n, dtype=store, device=rows.device)
    w = index if weights is None else weights
    backend._launch(st, found, (rows, index, w, out, t, n, rows.stride(0), out.stride(0)))
    return out if out.dtype == out_dtype else out.to(out_dtype)


__all__ = ["Epilogue", "block_k_of", "combine_kernel", "grouped_kernel", "grouped_upcast_kernel", "launch_spec",
           "run", "run_combine"]
