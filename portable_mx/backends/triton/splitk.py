"""Split-K for the GEMM kernels: several programs share one output tile, each summing a
contiguous range of its K tiles, and the partial sums are combined on the device in the
same launch.

Each program stores its fp32 partial tile to a workspace, then bumps the tile's arrival
counter (an atomic with release/acquire semantics at GPU scope, after a CTA barrier); the
program that arrives last reads every partial in split order 0, 1, ..., SPLIT_K - 1 (so
the sum does not depend on which program finished last: the result is deterministic),
resets the counter to 0 and runs the epilogue. No second kernel, no zero-fill, no output
atomics. The workspace and the counters are kept per device and stream and reused
(:func:`buffers`; the counters are zero between launches); a launch captured in a CUDA
graph gets buffers of its own.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import triton
import triton.language as tl

from ... import _graphs


@triton.jit
def program_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
                 SPLIT_K: tl.constexpr):
    """(pid_m, pid_n, pid_k, grid_n) of this program: its output tile, its K split and the
    number of tiles along N. The SPLIT_K programs of one tile are adjacent; tiles go
    GROUP_M row tiles at a time (programs in flight share B's column tiles in L2)."""
    pid = tl.program_id(0)
    if SPLIT_K > 1:
        pid_k = pid % SPLIT_K
        pid = pid // SPLIT_K
    else:
        pid_k = 0
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * grid_n
    first_m = (pid // group) * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m
    return pid_m, pid_n, pid_k, grid_n


@triton.jit
def tile_k_range(pid_k, KP, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """[first, last) K tile of split ``pid_k``: the K tiles split in contiguous ranges, the
    first ones one tile longer."""
    n_tiles = tl.cdiv(KP, BLOCK_K)
    if SPLIT_K == 1:
        first = 0
        last = n_tiles
    else:
        per = n_tiles // SPLIT_K
        extra = n_tiles % SPLIT_K
        first = pid_k * per + tl.minimum(pid_k, extra)
        last = first + per + (pid_k < extra).to(tl.int32)
    return first, last


@triton.jit
def combine(acc, offs, mask, part_ptr, count_ptr, tile, pid_k, SPLIT_K: tl.constexpr, TILE: tl.constexpr):
    """Split ``pid_k``'s fp32 partial ``acc`` of output tile ``tile``: store it, and
    return (sum of every split's partial in split order, whether this program is the last
    of the tile, which then writes the output; the sum is meaningless in the others).
    ``offs`` are the elements' offsets inside a TILE-element workspace tile (any layout,
    the same in every split), ``mask`` the elements that are written (those inside the
    output). The sum is built in ``acc``'s registers: no second tile stays live."""
    base = part_ptr + tile.to(tl.int64) * (SPLIT_K * TILE)
    tl.store(base + pid_k * TILE + offs, acc, mask=mask)
    tl.debug_barrier()  # every thread's partial is written before the release below
    arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
    last = arrived == SPLIT_K - 1
    if last:
        # .cg: from L2, never a stale L1 line of a previous launch
        acc = tl.load(base + offs, mask=mask, other=0.0, cache_modifier=".cg")
        for s in range(1, SPLIT_K):  # a loop, not unrolled: one partial in registers at a time
            acc += tl.load(base + s * TILE + offs, mask=mask, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")
    return acc, last


# ----------------------------------------------------------------------------- host side
#
# The workspace and the counters are kept per (device, stream). Launches on one stream run
# in order and share them; launches on two streams may run at the same time, and with one
# workspace their partial sums and arrival counts would mix (a wrong result, silently), so
# each stream has its own. A buffer that grows is replaced: the old one goes back to torch's
# caching allocator, which hands it out again only in its stream's order (after the
# launches already queued on that stream that use it).
#
# While a CUDA graph is captured, each launch gets buffers of its own from the graph's
# memory pool, the counters zeroed by a memset captured in the graph (so they are zero at
# every replay): a graph never refers to the kept buffers, which a later eager launch may
# grow and free, and two graphs replayed on two streams at the same time share nothing.

_LOCK = threading.Lock()
_BUFFERS: dict[Any, tuple[tuple[torch.Tensor, torch.Tensor], int, int]] = {}  # key -> (pair, its sizes)
_MAX_KEPT = 64
"""Streams whose buffers are kept at most (torch's stream pools hold 32 per priority and
device; an application making streams of its own may have more): the oldest entry goes
first, which is safe (its memory is reused in its stream's order, as a grown one's)."""
_STREAMED: dict[torch.device, bool] = {}
"""Whether launches on a device are keyed by stream (CUDA and ROCm devices; elsewhere one
pair per device): ``device.type`` costs ~0.15 us a call, a dict lookup ~0.03."""


def _stream(device: torch.device) -> tuple[tuple, bool]:
    """((``device`` with its index, the raw id of its current stream), whether that stream
    is being captured into a CUDA graph) of a CUDA device. The launches under one key run
    in order. Asked of ``device`` itself where it is not the current device (the callers
    run before the backend's device guard)."""
    current, index = torch._C._cuda_getDevice(), device.index
    if index is None:
        index, device = current, torch.device("cuda", current)
    return (device, torch._C._cuda_getCurrentRawStream(index)), _graphs.stream_capturing(index, current)


def buffers(device: torch.device, part_elems: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 workspace of at least ``part_elems`` elements, int32 counters, zero, at least
    ``tiles`` of them) for a launch on ``device``'s current stream: the stream's own,
    grown when a launch needs more, else reused; while that stream is captured into a CUDA
    graph, new ones (see above). The decode GEMM's hot path."""
    streamed = _STREAMED.get(device)
    if streamed is None:
        streamed = _STREAMED[device] = device.type == "cuda"
    if streamed:
        key, capturing = _stream(device)
        if capturing:
            return (torch.empty(max(part_elems, 1), dtype=torch.float32, device=key[0]),
                    torch.zeros(max(tiles, 1), dtype=torch.int32, device=key[0]))
    else:
        key = device
    have = _BUFFERS.get(key)
    if have is not None and have[1] >= part_elems and have[2] >= tiles:
        return have[0]
    return _grown(key, key[0] if streamed else device, part_elems, tiles)


def _grown(key, device: torch.device, part_elems: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`buffers`' pair under ``key``, made or grown to hold the launch's needs."""
    with _LOCK:
        have = _BUFFERS.get(key)
        pair = None if have is None else have[0]
        part_n = max(part_elems, 0 if have is None else have[1], 1 << 16)
        count_n = max(tiles, 0 if have is None else have[2], 1024)
        part = pair[0] if pair is not None and have[1] >= part_n else torch.empty(
            part_n, dtype=torch.float32, device=device)
        counts = pair[1] if pair is not None and have[2] >= count_n else torch.zeros(
            count_n, dtype=torch.int32, device=device)
        if have is None and len(_BUFFERS) >= _MAX_KEPT:
            del _BUFFERS[next(iter(_BUFFERS))]
        _BUFFERS[key] = ((part, counts), part_n, count_n)
        return part, counts


def counters(device: torch.device) -> torch.Tensor:
    """The counters of ``device``'s current stream (for tests: they must be all zero
    between launches)."""
    device = torch.device(device)
    return _BUFFERS[_stream(device)[0] if device.type == "cuda" else device][0][1]
