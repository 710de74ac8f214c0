"""Routing metadata of a mixture-of-experts layer, built on the device with no host sync.

:func:`route` turns a router's top-k choice (expert ids and weights ``[T, k]``) into what
the grouped GEMM (:func:`portable_mx.grouped_matmul`) needs: the T*k (token, slot) pairs
stably sorted by expert, per-expert row counts and cumulative end offsets (the convention
of ``torch.nn.functional.grouped_mm``'s ``offs``), the gather index (the source token of
each expert-sorted row), the scatter index (the expert-sorted row of each (token, slot))
and a fixed-size tile schedule for the kernel. Every shape is a function of T, k, E and
the tile M, never of the ids' values, and nothing is read back to the host, so
:func:`route` can be captured in a CUDA graph and traced by
``torch.compile(fullgraph=True)``.

The tile schedule: the expert-sorted rows cut into tiles of ``tile_m`` rows that never
span two experts; an expert with n rows takes ceil(n / tile_m) tiles. Their number is at
most ``max_tiles(R, E, tile_m) = (R + min(E, R) * (tile_m - 1)) // tile_m`` for R rows
(each non-empty expert wastes at most tile_m - 1 rows of its last tile), which sizes the
kernel's grid without reading the counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .. import registry
from .._flags import exact_int
from .._transforms import refuse_func_transforms
from ..tensor import FLOAT_DTYPES

TILE_M_CHOICES = (16, 32, 64, 128)
"""Tile heights (rows per tile) a schedule is built for by default (:func:`default_tile_m`)."""


def max_tiles(rows: int, num_experts: int, tile_m: int) -> int:
    """The most tiles of ``tile_m`` rows that ``rows`` expert-sorted rows over
    ``num_experts`` experts can take (a tile never spans two experts)."""
    return (rows + min(num_experts, rows) * (tile_m - 1)) // tile_m


EXPORT_TILE_M = 64
"""The tile height of a routing built under ``torch.export``: the choice by row count
would guard an exported program with a dynamic token count to one band of counts (it
failed, "Guard failed", outside it), and under strict export a symbolic count cannot be
told from a static one. Any tile height gives the same results; 64 is the middle of the
choices."""


def default_tile_m(rows: int, num_experts: int) -> int:
    """The tile height for ``rows`` rows over ``num_experts`` experts: the mean rows per
    expert rounded up to a power of two, clamped to 16..128 (as triton_kernels'
    matmul_ogs chooses its block M); :data:`EXPORT_TILE_M` under ``torch.export`` and
    ``torch.compile``: the choice by count compiled a graph per band of token counts, and
    with the grad / no-grad calls of an RL loop (rollouts, then training) a compiled MoE
    layer reached torch's recompile limit (8 graphs) within 14 calls and ran eagerly from
    then on (audit of 2026-11-28). Only the routing's schedule follows this choice: the
    grouped GEMM, an opaque op, picks its own tile height from the real count and builds
    the schedule for it where the routing's is for another (a few device ops), and every
    tile height gives the same results."""
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():
        # (dynamo sees a symbolic count as an int, and strict export shows one as an int)
        return EXPORT_TILE_M
    mean = -(-rows // max(num_experts, 1))
    tile = 16
    while tile < mean and tile < 128:
        tile *= 2
    return tile


def tile_schedule(offsets: torch.Tensor, rows: int, tile_m: int) -> torch.Tensor:
    """The tile schedule of ``rows`` expert-sorted rows with cumulative end offsets
    ``offsets`` (int32 ``[E]``): int32 ``[max_tiles(rows, E, tile_m), 2]``, row s =
    (expert, first row) of tile s, tiles in expert order, the unused tail (-1, 0).
    Built with device ops only (no host sync)."""
    num_experts = offsets.shape[0]
    slots = max_tiles(rows, num_experts, tile_m)
    ends = offsets.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    tiles = (ends - starts + (tile_m - 1)) // tile_m
    tile_ends = torch.cumsum(tiles, 0)
    s = torch.arange(slots, device=offsets.device, dtype=torch.int64)
    expert = torch.searchsorted(tile_ends, s, right=True)  # the first expert whose tiles end after s
    used = expert < num_experts
    e = expert.clamp(max=num_experts - 1)
    first = starts[e] + (s - (tile_ends[e] - tiles[e])) * tile_m
    return torch.stack([torch.where(used, e, -1), torch.where(used, first, 0)], dim=1).to(torch.int32)


@dataclass(frozen=True, eq=False)
class Routing:
    """Where each token goes: the routing of T tokens to k of ``num_experts`` experts.

    With R = T * k rows, the (token t, slot j) pairs flattened as p = t * k + j and sorted
    stably by expert (ties keep p order):

    - ``num_experts`` (int E), ``k`` (int): experts, slots per token.
    - ``topk_ids``: int ``[T, k]`` as given (int32 or int64): the expert of each pair.
    - ``weights``: float ``[T, k]``: the router weights as given (the same tensor, so a
      gradient reaches the router), or float32 ones when none were given.
    - ``counts``: int32 ``[E]``: rows routed to each expert (empty experts hold 0).
    - ``offsets``: int32 ``[E]``: cumulative end offsets, ``offsets[e] = sum(counts[:e+1])``
      (``torch.nn.functional.grouped_mm``'s ``offs``); expert e owns sorted rows
      ``offsets[e] - counts[e] .. offsets[e] - 1``; ``offsets[-1] == R``.
    - ``gather_index``: int32 ``[R]``: the token t of each expert-sorted row (the row of
      x that a gathering GEMM reads).
    - ``scatter_index``: int32 ``[R]``: the expert-sorted row of each pair p = t * k + j
      (the inverse permutation: ``gather_index[scatter_index[t * k + j]] == t``).
    - ``sorted_weights``: ``[R]``, the dtype of ``weights``: the weight of each sorted row
      (a property: made from ``weights`` and ``scatter_index`` when read, differentiable in
      ``weights`` where grad mode is on then; nothing in the layer's path reads it).
    - ``tile_m`` (int) and ``tile_schedule``: int32 ``[max_tiles(R, E, tile_m), 2]``:
      (expert, first sorted row) of each tile of ``tile_m`` rows, -1 past the last tile
      (:func:`tile_schedule`); :meth:`schedule` gives the one of another tile height.

    Build one with :func:`route`. One built otherwise (``Routing(...)``,
    ``dataclasses.replace(routing, weights=...)``) is checked: its fields' types, dtypes,
    shapes and device here, and by :func:`~portable_mx.grouped_matmul` its index tensors
    against the routing of its ``topk_ids`` (:func:`check_routing`: the kernels index x,
    the rows and the output with them, so a wrong one would read or write out of bounds).
    """

    num_experts: int
    k: int
    topk_ids: torch.Tensor
    weights: torch.Tensor
    counts: torch.Tensor
    offsets: torch.Tensor
    gather_index: torch.Tensor
    scatter_index: torch.Tensor
    tile_m: int
    tile_schedule: torch.Tensor

    def __post_init__(self) -> None:
        if torch.compiler.is_compiling():  # (route() builds one through here while traced: its own fields)
            return
        _check_fields(self)

    @classmethod
    def _make(cls, num_experts: int, k: int, topk_ids: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor,
              offsets: torch.Tensor, gather_index: torch.Tensor, scatter_index: torch.Tensor, tile_m: int,
              tile_schedule: torch.Tensor) -> "Routing":
        """The constructor of :func:`route`'s hot path: the same object as ``Routing(...)``
        without the frozen dataclass's per-field ``object.__setattr__`` (0.35 us against
        1.1 on a CPU; as ``MXTensor._make``), for fields that route() made itself."""
        if torch.compiler.is_compiling():
            obj = cls(num_experts, k, topk_ids, weights, counts, offsets, gather_index, scatter_index, tile_m,
                      tile_schedule)
            object.__setattr__(obj, "_routed", True)
            return obj
        obj = object.__new__(cls)
        obj.__dict__.update(num_experts=num_experts, k=k, topk_ids=topk_ids, weights=weights, counts=counts,
                            offsets=offsets, gather_index=gather_index, scatter_index=scatter_index, tile_m=tile_m,
                            tile_schedule=tile_schedule, _routed=True)
        return obj

    @property
    def num_tokens(self) -> int:
        return self.topk_ids.shape[0]

    @property
    def rows(self) -> int:
        """R = T * k, the number of expert-sorted rows."""
        return self.gather_index.shape[0]

    @property
    def device(self) -> torch.device:
        return self.offsets.device

    @property
    def sorted_weights(self) -> torch.Tensor:
        """``[R]``, the dtype of ``weights``: the weight of each expert-sorted row,
        ``sorted_weights[scatter_index[p]] == weights.flatten()[p]`` (one scatter, made
        when read: the routing itself writes no copy)."""
        flat = self.weights.reshape(self.rows)
        return flat.scatter(0, self.scatter_index.to(torch.int64), flat)

    def schedule(self, tile_m: int) -> torch.Tensor:
        """The tile schedule for tiles of ``tile_m`` rows: ``tile_schedule`` when it is the
        one, else built once (device ops, no host sync) and kept with this Routing."""
        if tile_m == self.tile_m:
            return self.tile_schedule
        memo = self.__dict__.setdefault("_schedules", {})
        found = memo.get(tile_m)
        if found is None:
            found = memo[tile_m] = tile_schedule(self.offsets, self.rows, tile_m)
        return found

    def __repr__(self) -> str:
        return (f"Routing(tokens={self.num_tokens}, k={self.k}, experts={self.num_experts}, "
                f"tile_m={self.tile_m}, device={self.device})")


def _check_ids(topk_ids: torch.Tensor, num_experts: int) -> None:
    """Every id in [0, num_experts): raised here on the CPU, asserted on the device
    elsewhere (no host sync; a failure stops the device's work with this message)."""
    if topk_ids.device.type == "meta":
        return
    bad = ((topk_ids < 0) | (topk_ids >= num_experts)).any()
    if topk_ids.device.type == "cpu" and not torch.compiler.is_compiling():
        if bad:
            raise ValueError(f"topk_ids must lie in [0, num_experts={num_experts}); got values "
                             f"{topk_ids.min().item()} .. {topk_ids.max().item()}")
        return
    torch._assert_async(~bad, f"route: topk_ids must lie in [0, num_experts={num_experts})")


def _backend_route(topk_ids: torch.Tensor, num_experts: int, tile_m: int):
    """The routing tensors from the device's grouped-GEMM backend (Backend.route: one
    Triton launch at decode sizes), their ids asserted on a GPU by the kernel itself or
    here from its flag (on the CPU route() checked them before), or None: the torch form
    (while tracing, too)."""
    if torch.compiler.is_compiling() or topk_ids.device.type == "meta":
        return None
    try:
        backend = registry.select("grouped_matmul", topk_ids.device)
    except registry.BackendUnavailableError:
        return None
    if type(backend).route is registry.Backend.route:
        return None
    made = backend.route(topk_ids.contiguous(), num_experts, tile_m)
    if made is not None and made[-1] is not None and topk_ids.device.type != "cpu":
        torch._assert_async(made[-1], f"route: topk_ids must lie in [0, num_experts={num_experts})")
    return made


def route(topk_ids: torch.Tensor, topk_weights: Optional[torch.Tensor], num_experts: int, *,
          tile_m: Optional[int] = None) -> Routing:
    """The :class:`Routing` of T tokens to the k experts each of ``topk_ids``.

    topk_ids: int32 or int64 ``[T, k]``, each in [0, num_experts) (a token may name the
    same expert twice: two rows); topk_weights: float ``[T, k]`` on the same device, or
    None (weights 1, float32); num_experts: E >= 1. ``tile_m``: the tile height of the
    precomputed schedule (default :func:`default_tile_m` of T * k rows over E experts).
    Device ops only: no host sync, shapes from T, k, E alone. A backend may build the
    tensors in its own way (the Triton backends: one launch for up to 1024 pairs and 256
    experts), equal element for element to the torch form here.
    """
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be an int32 or int64 tensor [T, k]; got "
                        f"{getattr(topk_ids, 'dtype', type(topk_ids).__name__)}")
    if topk_ids.dim() != 2 or topk_ids.shape[1] < 1:
        raise ValueError(f"topk_ids must be [T, k] with k >= 1; got shape {tuple(topk_ids.shape)}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or not 1 <= num_experts < 2**31:
        # (2**36 failed in torch's allocator, 2**31 took the machine's memory: int32 offsets)
        raise ValueError(f"num_experts must be a positive int below 2**31; got {num_experts!r}")
    if topk_weights is None:
        topk_weights = torch.ones(topk_ids.shape, dtype=torch.float32, device=topk_ids.device)
    elif not isinstance(topk_weights, torch.Tensor) or topk_weights.dtype not in FLOAT_DTYPES:
        # (float8 passed is_floating_point, then sorted_weights failed in torch's scatter)
        raise TypeError(f"topk_weights must be a float tensor [T, k] ({', '.join(map(str, FLOAT_DTYPES))}) or None; got "
                        f"{getattr(topk_weights, 'dtype', type(topk_weights).__name__)}")
    elif topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights must have topk_ids' shape {tuple(topk_ids.shape)}; "
                         f"got {tuple(topk_weights.shape)}")
    elif topk_weights.device != topk_ids.device:
        raise ValueError(f"topk_weights and topk_ids must be on the same device; got "
                         f"{topk_weights.device} and {topk_ids.device}")
    if tile_m is not None:
        count = exact_int(tile_m)  # (16.0 compared equal to a choice, and the Triton kernel failed on it)
        if count is None or count not in TILE_M_CHOICES:
            raise ValueError(f"tile_m must be one of the ints {TILE_M_CHOICES}; got {tile_m!r}")
        tile_m = count
    refuse_func_transforms("route", topk_ids, topk_weights)  # (vmap reached the CPU id check: torch's error)

    t, k = topk_ids.shape
    rows = t * k
    tile_m = default_tile_m(rows, num_experts) if tile_m is None else tile_m
    on_cpu = topk_ids.device.type == "cpu"
    if on_cpu:
        _check_ids(topk_ids, num_experts)  # the clear error, before any kernel reads them
    made = _backend_route(topk_ids, num_experts, tile_m)
    if made is not None:
        counts, offsets, gather, scatter, schedule, ok = made
        return Routing._make(num_experts=num_experts, k=k, topk_ids=topk_ids, weights=topk_weights, counts=counts,
                             offsets=offsets, gather_index=gather, scatter_index=scatter, tile_m=tile_m,
                             tile_schedule=schedule)
    if not on_cpu:
        _check_ids(topk_ids, num_experts)
    device = topk_ids.device
    flat = topk_ids.reshape(rows)
    order = torch.argsort(flat, stable=True)  # the pair p of each sorted row
    sorted_ids = flat[order]
    experts = torch.arange(num_experts, device=device, dtype=flat.dtype)
    offsets = torch.searchsorted(sorted_ids, experts, right=True).to(torch.int32)
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
    scatter = torch.empty_like(order).scatter_(0, order, torch.arange(rows, device=device, dtype=order.dtype))
    return Routing._make(
        num_experts=num_experts, k=k, topk_ids=topk_ids, weights=topk_weights, counts=counts, offsets=offsets,
        gather_index=(order // k).to(torch.int32), scatter_index=scatter.to(torch.int32), tile_m=tile_m,
        tile_schedule=tile_schedule(offsets, rows, tile_m),
    )


_INDEX_FIELDS = ("counts", "offsets", "gather_index", "scatter_index", "tile_schedule")


def _check_fields(r: Routing) -> None:
    """The fields of a Routing built by hand: types, dtypes, shapes, one device (ValueError
    / TypeError naming the field). Their values are :func:`check_routing`'s."""
    for name in ("num_experts", "k", "tile_m"):
        value = getattr(r, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"Routing: {name} must be a positive int; got {value!r}")
    if r.tile_m not in TILE_M_CHOICES:
        raise ValueError(f"Routing: tile_m must be one of {TILE_M_CHOICES}; got {r.tile_m}")
    ids, weights = r.topk_ids, r.weights
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64) or ids.dim() != 2 \
            or ids.shape[1] != r.k:
        raise TypeError(f"Routing: topk_ids must be an int32 or int64 tensor [T, k={r.k}]; got "
                        f"{getattr(ids, 'dtype', type(ids).__name__)} {tuple(getattr(ids, 'shape', ()))}")
    if not isinstance(weights, torch.Tensor) or weights.dtype not in FLOAT_DTYPES or weights.shape != ids.shape:
        raise TypeError(f"Routing: weights must be a float tensor of topk_ids' shape {tuple(ids.shape)}; got "
                        f"{getattr(weights, 'dtype', type(weights).__name__)} {tuple(getattr(weights, 'shape', ()))}")
    rows = ids.shape[0] * r.k
    shapes = {"counts": (r.num_experts,), "offsets": (r.num_experts,), "gather_index": (rows,),
              "scatter_index": (rows,), "tile_schedule": (max_tiles(rows, r.num_experts, r.tile_m), 2)}
    for name, shape in shapes.items():
        t = getattr(r, name)
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or tuple(t.shape) != shape:
            raise TypeError(f"Routing: {name} must be an int32 tensor {list(shape)}; got "
                            f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    for name in ("weights",) + _INDEX_FIELDS:
        if getattr(r, name).device != ids.device:
            raise ValueError(f"Routing: every tensor must be on topk_ids' device {ids.device}; {name} is on "
                             f"{getattr(r, name).device}")


def check_routing(r: Routing) -> None:
    """That a Routing not made by :func:`route` holds the index tensors route() makes of
    its ``topk_ids`` (and ``tile_m``): raised on the CPU naming the first field that
    differs, asserted on the device elsewhere (no host sync). Only its ``weights`` may be
    its own (``dataclasses.replace(routing, weights=...)``). A Routing from route()
    passes without a look."""
    if getattr(r, "_routed", False) or r.device.type == "meta":
        return
    fresh = route(r.topk_ids, r.weights, r.num_experts, tile_m=r.tile_m)
    if r.device.type == "cpu" and not torch.compiler.is_compiling():
        for name in _INDEX_FIELDS:
            if not torch.equal(getattr(r, name), getattr(fresh, name)):
                raise ValueError(f"Routing: {name} is not the one route() makes of its topk_ids (built by hand? "
                                 "build routings with pmx.route; replace only their weights)")
        return
    same = torch.stack([(getattr(r, name) == getattr(fresh, name)).all() for name in _INDEX_FIELDS]).all()
    torch._assert_async(same, "Routing: its index tensors are not the ones route() makes of its topk_ids (build "
                              "routings with pmx.route; replace only their weights)")
