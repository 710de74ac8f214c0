"""The routing metadata of a mixture-of-experts layer in one Triton launch (decode sizes).

:func:`portable_mx.route` builds, from a router's top-k choice, the (token, slot) pairs
stably sorted by expert and the grouped GEMM's tile schedule (moe/routing.py: its torch
form, ~40 small device ops, is the exact twin of this kernel). At decode (a few tokens)
those ops are all the routing costs: one kernel launch each, host-bound. Here one program
computes everything for up to :data:`MAX_ROWS` rows and :data:`MAX_EXPERTS` experts:

- the pairs' order: ``tl.sort`` of the distinct keys expert * BLOCK_R + pair index, a
  stable sort by expert as ``torch.argsort(stable=True)`` (row r holds the pair its sorted
  key names; the scatter index is its inverse). An earlier form counted, for every pair,
  the pairs ordered before it over chunks of 8 pairs: 64 dependent steps of a global load
  and two layout conversions at 512 pairs, 100 us of a 334 us Qwen3-30B-A3B MoE layer at
  64 tokens on an H200 (benchmarks/NOTES-overhead.md);
- per-expert counts, a ``tl.histogram`` of the valid ids; their running sum, the offsets;
- slot s of the schedule: its expert is the number of experts whose tile ends lie at or
  before s (``searchsorted(right=True)``), its first row that expert's start plus the
  tiles before s inside it; both as sums over the experts that end at or before s.

Integer arithmetic only: the outputs equal the torch twin's exactly (tests). Ids outside
[0, E) set the ``ok`` flag to 0 and sort last, so that no write leaves the outputs whatever
the ids. Who stops the device on such ids: on NVIDIA targets the kernel itself, compiled
with its device assertion (``debug=True``, :func:`asserts_in_kernel`), which prints the
message as ``torch._assert_async`` would and saves that op's launch (~10 us of host time a
routing on an H200's host); elsewhere the caller asserts the flag with
``torch._assert_async`` (on AMD the kernel's assertion is a bare ``s_trap`` without the
message).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

MAX_ROWS = 1024
"""Most (token, slot) pairs the kernel takes (T * k); beyond, the torch form runs."""
MAX_EXPERTS = 256
"""Most experts the kernel takes."""
_LANES = 4096  # int32 comparisons per step of the schedule: 32 a thread on 4 warps
_OPTIONS = {"num_warps": 4, "enable_fp_fusion": False}
_ASSERTING = {"debug": True, "sanitize_overflow": False}  # the device assertion compiled in, nothing else
ASSERTING_TRITON = ((3, 6), (3, 9))
"""The Triton releases (first, last) whose compile of the route kernel with ``debug=True``
is checked to carry its device assertion on every NVIDIA target (the compile matrix:
``KernelLaunch.device_asserts``); outside them the caller's ``torch._assert_async`` stays."""


@triton.jit
def route_kernel(ids_ptr, counts_ptr, offsets_ptr, gather_ptr, scatter_ptr, sched_ptr, ok_ptr,
                 R, K, E, SLOTS, TILE_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
                 SCHUNK: tl.constexpr):
    """One program: ids int32/int64 [R] (pair p = t * K + j) -> counts and offsets int32
    [E], gather and scatter int32 [R], schedule int32 [SLOTS, 2], ok int32 [1] (1: every id
    in [0, E)). R <= BLOCK_R,
    E <= BLOCK_E, both powers of two; SCHUNK slots compared per step."""
    p = tl.arange(0, BLOCK_R)
    p_in = p < R
    raw = tl.load(ids_ptr + p, mask=p_in, other=0)
    valid = p_in & (raw >= 0) & (raw < E)  # in the ids' own width: no wrap to a valid id
    n_bad = tl.sum((p_in & ~valid).to(tl.int32), 0)
    tl.store(ok_ptr, (n_bad == 0).to(tl.int32))
    # padding and out-of-range ids sort after every expert: every row and offset stays in
    # [0, R] whatever the ids (a bad id then stops the device: the assertion at this
    # kernel's end, or the caller's after it)
    e_p = tl.where(valid, raw.to(tl.int32), BLOCK_E)

    # the experts' counts: a histogram of the valid ids
    x = tl.arange(0, BLOCK_E)
    counts = tl.histogram(e_p, BLOCK_E, mask=valid)
    ends = tl.cumsum(counts, 0)
    x_in = x < E
    tl.store(counts_ptr + x, counts, mask=x_in)
    tl.store(offsets_ptr + x, ends, mask=x_in)

    # the stable sort by expert: the keys expert * BLOCK_R + pair are distinct, so sorting
    # them orders the pairs by expert, then by pair index; the sorted key at row r names the
    # pair placed there (padding and bad ids, expert BLOCK_E, land last: rows >= the valid)
    order = tl.sort(e_p * BLOCK_R + p)
    pair = order % BLOCK_R
    tl.store(gather_ptr + p, pair // K, mask=p_in)
    tl.store(scatter_ptr + pair, p, mask=p_in)

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
    # compiled in only with debug=True (asserts_in_kernel; the flag serves the rest). Last,
    # where little else is live: its call (NVIDIA's __assertfail) then saves no registers
    # (at the top, sm_100 under triton 3.9 spilled 4 bytes around it)
    tl.device_assert(n_bad == 0, "route: topk_ids must lie in [0, num_experts)")


def asserts_in_kernel(target) -> bool:
    """Whether the route kernel stops the device itself on an id outside [0, E) on
    ``target`` (backends.targets.Target; None: the interpreter, which compiles no
    assertion): NVIDIA targets under a Triton release of :data:`ASSERTING_TRITON`."""
    from . import triton_version

    version = triton_version()
    return (target is not None and target.triton_backend == "cuda" and version is not None
            and ASSERTING_TRITON[0] <= version <= ASSERTING_TRITON[1])


def fits(rows: int, num_experts: int) -> bool:
    """Whether :func:`route_tensors` takes a routing of ``rows`` pairs over ``num_experts``."""
    return 0 < rows <= MAX_ROWS and num_experts <= MAX_EXPERTS


def _block(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())  # the next power of two (triton's costs ~1.4 us on the host)


def _chunk(block: int) -> int:
    """Slots of the schedule compared per step against ``block`` experts: _LANES in all."""
    return max(4, min(32, _LANES // block))


def route_tensors(topk_ids: torch.Tensor, num_experts: int, tile_m: int, slots: int, launch=None) -> tuple:
    """(counts, offsets, gather_index, scatter_index, tile_schedule, ok) of the routing
    (moe/routing.Routing's fields; ok: int32 [1], 1 when every id lies in [0, E)), in one
    launch on the ids' device. ``topk_ids`` int32/int64 [T, k] contiguous, ``slots`` =
    moe.routing.max_tiles(T k, E, tile_m); :func:`fits` must hold. ``launch(None, args)``
    runs the kernel (the backend's planned launch of :func:`make_plan`; default: the JIT's
    ``kernel[grid]``)."""
    t, k = topk_ids.shape
    rows = t * k
    device = topk_ids.device
    total, sizes, picks = _int_parts(num_experts, rows, slots)
    ints = torch.empty(total, dtype=torch.int32, device=device)
    parts = ints.split_with_sizes(sizes)
    counts, offsets, gather, scatter, sched, ok = (parts[i] for i in picks)
    args = (topk_ids, counts, offsets, gather, scatter, sched, ok, rows, k, num_experts, slots)
    if launch is None:
        plan = make_plan(rows, num_experts, tile_m)
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            plan.fn[plan.grid](*args, **plan.constexprs, **plan.options)
    else:
        launch(None, args)
    return counts, offsets, gather, scatter, sched.view(slots, 2), ok


def options(asserts: bool) -> dict:
    """The route kernel's launch options, with its device assertion compiled in or not."""
    return {**_OPTIONS, **_ASSERTING} if asserts else dict(_OPTIONS)


@functools.lru_cache(maxsize=256)
def _int_parts(num_experts: int, rows: int, slots: int) -> tuple[int, tuple, tuple]:
    """One int32 buffer for the integer outputs (counts, offsets, gather, scatter, the
    schedule, ok), each part at a multiple of 16 bytes: (its length, the sizes that
    ``split_with_sizes`` cuts it into, the positions of the six parts among them). The
    parts and their non-empty pads split off in one op (six slices cost twice as much, and
    every empty pad a view more: 12 parts 3.9 us, 6 parts 2.1 us on a CPU); the last part
    (ok) needs no pad after it (one view fewer: 0.35 us on a CPU, ~0.6 on an H200's host)."""
    sizes, picks = [], []
    for n in (num_experts, num_experts, rows, rows, 2 * slots):
        picks.append(len(sizes))
        sizes.append(n)
        if n % 4:
            sizes.append(-n % 4)
    picks.append(len(sizes))
    sizes.append(1)  # ok
    return sum(sizes), tuple(sizes), tuple(picks)


def make_plan(rows: int, num_experts: int, tile_m: int, asserts: bool = False):
    """The launch of :func:`route_tensors` for ``rows`` pairs over ``num_experts`` experts
    (launch.Launch: one program); ``asserts``: with the device assertion compiled in
    (:func:`asserts_in_kernel`)."""
    from .launch import Launch

    return Launch("route", route_kernel, (1,), _constexprs(rows, num_experts, tile_m), options(asserts))


def _constexprs(rows: int, num_experts: int, tile_m: int) -> dict:
    block_r, block_e = _block(rows), _block(num_experts)
    return {"TILE_M": tile_m, "BLOCK_R": block_r, "BLOCK_E": block_e, "SCHUNK": _chunk(block_e)}


def launch_specs(target=None) -> list:
    """The launches :func:`route_tensors` makes on ``target`` (None: without the device
    assertion), as data for the compile matrix: decode (64 tokens x top-8 over 128 experts)
    and the largest it takes. With the assertion, the matrix checks that it was compiled in."""
    from .launch import KernelLaunch

    asserts = asserts_in_kernel(target)

    signature = {"ids_ptr": "*i64", "counts_ptr": "*i32", "offsets_ptr": "*i32", "gather_ptr": "*i32",
                 "scatter_ptr": "*i32", "sched_ptr": "*i32", "ok_ptr": "*i32",
                 "R": "i32", "K": "i32", "E": "i32", "SLOTS": "i32",
                 "TILE_M": "constexpr", "BLOCK_R": "constexpr", "BLOCK_E": "constexpr",
                 "SCHUNK": "constexpr"}
    out = []
    for rows, experts in ((4, 32), (512, 128), (MAX_ROWS, MAX_EXPERTS)):
        consts = _constexprs(rows, experts, 16)
        out.append(KernelLaunch("route", route_kernel, signature, consts, options(asserts),
                                f"route r{rows} e{experts} tile16" + (" assert" if asserts else ""),
                                device_asserts=asserts))
    return out
