"""The routing metadata of a mixture-of-experts layer in one Triton launch (decode sizes).

:func:`portable_mx.route` builds, from a router's top-k choice, the (token, slot) pairs
stably sorted by expert and the grouped GEMM's tile schedule (moe/routing.py: its torch
form, ~40 small device ops, is the exact twin of this kernel). At decode (a few tokens)
those ops are all the routing costs: one kernel launch each, host-bound. Here one program
computes everything for up to :data:`MAX_ROWS` rows and :data:`MAX_EXPERTS` experts:

- pair p's sorted row: the number of pairs (e_j, j) ordered before (e_p, p), i.e. with a
  smaller expert, or the same expert and a smaller pair index (a stable sort, as
  ``torch.argsort(stable=True)``), counted over chunks of pairs;
- per-expert counts by comparison with every expert id; their running sum, the offsets;
- slot s of the schedule: its expert is the number of experts whose tile ends lie at or
  before s (``searchsorted(right=True)``), its first row that expert's start plus the
  tiles before s inside it; both as sums over the experts that end at or before s.

Integer arithmetic only: the outputs equal the torch twin's exactly (tests). Ids outside
[0, E) set the ``ok`` flag to 0 (the caller asserts it on the device) and sort last, so that
no write leaves the outputs whatever the ids.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

MAX_ROWS = 1024
"""Most (token, slot) pairs the kernel takes (T * k); beyond, the torch form runs."""
MAX_EXPERTS = 256
"""Most experts the kernel takes."""
_LANES = 4096  # int32 comparisons per step: 32 a thread on 4 warps
_OPTIONS = {"num_warps": 4, "enable_fp_fusion": False}


@triton.jit
def route_kernel(ids_ptr, w_ptr, counts_ptr, offsets_ptr, gather_ptr, scatter_ptr, sw_ptr, sched_ptr, ok_ptr,
                 R, K, E, SLOTS, TILE_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
                 CHUNK: tl.constexpr, SCHUNK: tl.constexpr):
    """One program: ids int32/int64 [R] (pair p = t * K + j), weights [R] -> counts and
    offsets int32 [E], gather and scatter int32 [R], sorted weights [R] (w's dtype),
    schedule int32 [SLOTS, 2], ok int32 [1] (1: every id in [0, E)). R <= BLOCK_R,
    E <= BLOCK_E, both powers of two; CHUNK pairs and SCHUNK slots compared per step."""
    p = tl.arange(0, BLOCK_R)
    p_in = p < R
    raw = tl.load(ids_ptr + p, mask=p_in, other=0)
    valid = p_in & (raw >= 0) & (raw < E)  # in the ids' own width: no wrap to a valid id
    tl.store(ok_ptr, (tl.sum((p_in & ~valid).to(tl.int32), 0) == 0).to(tl.int32))
    # padding and out-of-range ids sort after every expert: every row and offset stays in
    # [0, R] whatever the ids (a bad id is asserted by the caller, after this kernel)
    e_p = tl.where(valid, raw.to(tl.int32), BLOCK_E)

    # sorted row of each pair, and the experts' counts, over chunks of pairs j
    x = tl.arange(0, BLOCK_E)
    before = tl.zeros([BLOCK_R], tl.int32)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for j0 in range(0, R, CHUNK):
        j = j0 + tl.arange(0, CHUNK)
        raw_j = tl.load(ids_ptr + j, mask=j < R, other=0)
        e_j = tl.where((j < R) & (raw_j >= 0) & (raw_j < E), raw_j.to(tl.int32), BLOCK_E)
        earlier = (e_j[None, :] < e_p[:, None]) | ((e_j[None, :] == e_p[:, None]) & (j[None, :] < p[:, None]))
        before += tl.sum(earlier.to(tl.int32), 1)
        counts += tl.sum((e_j[None, :] == x[:, None]).to(tl.int32), 1)
    ends = tl.cumsum(counts, 0)
    x_in = x < E
    tl.store(counts_ptr + x, counts, mask=x_in)
    tl.store(offsets_ptr + x, ends, mask=x_in)

    tl.store(scatter_ptr + p, before, mask=p_in)
    tl.store(gather_ptr + before, p // K, mask=p_in)
    tl.store(sw_ptr + before, tl.load(w_ptr + p, mask=p_in), mask=p_in)

    # the tile schedule: slot s -> (expert, first row), or (-1, 0) past the last tile
    tiles = (counts + (TILE_M - 1)) // TILE_M
    tile_ends = tl.cumsum(tiles, 0)
    for s0 in range(0, SLOTS, SCHUNK):
        s = s0 + tl.arange(0, SCHUNK)
        done = (tile_ends[None, :] <= s[:, None]) & x_in[None, :]  # experts whose tiles end at or before s
        expert = tl.sum(done.to(tl.int32), 1)
        start = tl.sum(tl.where(done, counts[None, :], 0), 1)
        tiles_before = tl.sum(tl.where(done, tiles[None, :], 0), 1)
        used = expert < E
        first = start + (s - tiles_before) * TILE_M
        s_in = s < SLOTS
        tl.store(sched_ptr + 2 * s, tl.where(used, expert, -1), mask=s_in)
        tl.store(sched_ptr + 2 * s + 1, tl.where(used, first, 0), mask=s_in)


def fits(rows: int, num_experts: int) -> bool:
    """Whether :func:`route_tensors` takes a routing of ``rows`` pairs over ``num_experts``."""
    return 0 < rows <= MAX_ROWS and num_experts <= MAX_EXPERTS


def _block(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())  # the next power of two (triton's costs ~1.4 us on the host)


def _chunk(block: int) -> int:
    """Pairs (or slots) compared per step against ``block`` others: _LANES in all."""
    return max(4, min(32, _LANES // block))


def route_tensors(topk_ids: torch.Tensor, weights: torch.Tensor, num_experts: int, tile_m: int, slots: int,
                  launch=None) -> tuple:
    """(counts, offsets, gather_index, scatter_index, sorted_weights, tile_schedule, ok) of
    the routing (moe/routing.Routing's fields; ok: int32 [1], 1 when every id lies in
    [0, E)), in one launch on the ids' device. ``topk_ids`` int32/int64 [T, k] and
    ``weights`` float [T, k] contiguous, ``slots`` = moe.routing.max_tiles(T k, E,
    tile_m); :func:`fits` must hold. ``launch(None, args)`` runs the kernel (the backend's
    planned launch of :func:`make_plan`; default: the JIT's ``kernel[grid]``)."""
    t, k = topk_ids.shape
    rows = t * k
    device = topk_ids.device
    # one int32 buffer for the integer outputs, each part at a multiple of 16 bytes: the
    # parts and the pads after them split off in one op (six slices cost twice as much)
    sizes = []
    for n in (num_experts, num_experts, rows, rows, 2 * slots, 1):
        sizes += (n, -n % 4)
    ints = torch.empty(sum(sizes), dtype=torch.int32, device=device)
    counts, offsets, gather, scatter, sched, ok = ints.split_with_sizes(sizes)[0::2]
    sorted_weights = torch.empty(rows, dtype=weights.dtype, device=device)
    args = (topk_ids, weights, counts, offsets, gather, scatter, sorted_weights, sched, ok, rows, k, num_experts, slots)
    if launch is None:
        plan = make_plan(rows, num_experts, tile_m)
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            plan.fn[plan.grid](*args, **plan.constexprs, **plan.options)
    else:
        launch(None, args)
    return counts, offsets, gather, scatter, sorted_weights, sched.view(slots, 2), ok


def make_plan(rows: int, num_experts: int, tile_m: int):
    """The launch of :func:`route_tensors` for ``rows`` pairs over ``num_experts`` experts
    (launch.Launch: one program)."""
    from .launch import Launch

    return Launch("route", route_kernel, (1,), _constexprs(rows, num_experts, tile_m), dict(_OPTIONS))


def _constexprs(rows: int, num_experts: int, tile_m: int) -> dict:
    block_r, block_e = _block(rows), _block(num_experts)
    return {"TILE_M": tile_m, "BLOCK_R": block_r, "BLOCK_E": block_e, "CHUNK": _chunk(block_r),
            "SCHUNK": _chunk(block_e)}


def launch_specs() -> list:
    """The launches :func:`route_tensors` makes, as data for the compile matrix: decode
    (64 tokens x top-8 over 128 experts) and the largest it takes."""
    from .launch import KernelLaunch

    signature = {"ids_ptr": "*i64", "w_ptr": "*bf16", "counts_ptr": "*i32", "offsets_ptr": "*i32",
                 "gather_ptr": "*i32", "scatter_ptr": "*i32", "sw_ptr": "*bf16", "sched_ptr": "*i32", "ok_ptr": "*i32",
                 "R": "i32", "K": "i32", "E": "i32", "SLOTS": "i32",
                 "TILE_M": "constexpr", "BLOCK_R": "constexpr", "BLOCK_E": "constexpr", "CHUNK": "constexpr",
                 "SCHUNK": "constexpr"}
    out = []
    for rows, experts in ((4, 32), (512, 128), (MAX_ROWS, MAX_EXPERTS)):
        consts = _constexprs(rows, experts, 16)
        out.append(KernelLaunch("route", route_kernel, signature, consts, dict(_OPTIONS),
                                f"route r{rows} e{experts} tile16"))
    return out
