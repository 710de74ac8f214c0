"""Which GEMM configs the kernels can launch: the checks a :class:`~.launch.GemmConfig`
read from outside the code (a config cache file, shipped, user-written, hand-edited or
written by another portable_mx version) must pass before it reaches a launch.

A config that breaks one of these does not fail cleanly in the kernel: a negative tile
launches no program and the output is never written (uninitialised memory), a tile of 0
divides by zero on the host, a ``group_m`` of 0 divides by zero in the program order
(wrong tiles; -1 crashes the interpreter), a tile that is not a power of two stops
``tl.arange``, a string stops the host code with a TypeError. The rules, and where each
comes from:

- **fields.** Exactly this version's GemmConfig fields (``block_m``, ``block_n`` and
  ``block_k`` required, the others default). A field this version lacks was written by a
  newer portable_mx: what it asks of the kernel is unknown here.
- **types.** Every field an ``int`` (not a bool, not a float such as 64.0); ``extra`` a list
  of ``[name, int]`` pairs.
- **block_m, block_n:** powers of two (``tl.arange(0, BLOCK_M)`` in gemm.py and
  gemm_upcast.py needs one; positive, or no program covers the output).
- **block_k:** a power of two >= 32 (``tl.arange(0, BLOCK_K // 32)``: one scale per 32
  elements).
- **block_m:** at least :data:`MIN_BLOCK_M` (16, the smallest the tuning space offers on
  any target). The upcast kernel's W4A16 launch for a weight with outliers at M <= 4
  tokens (``gemm_upcast.sparse_rows``) adds token j's outlier sums into column j of its
  row tile, so it needs all M tokens in one tile: with ``block_m`` 1 or 2 the second tile's
  rows took the first's corrections (rows off by 0.7 of the output's largest value,
  audit of 2026-11-28, sm_90 and gfx942; no error, no warning).
- **tile size:** ``block_m`` and ``block_n`` at most :data:`MAX_BLOCK_MN` (256),
  ``block_k`` at most :data:`MAX_BLOCK_K` (512): the largest tiles the tuning space
  offers on any target (``tuning/space.py``), so the largest any tuned or default config
  has. Triton's own bound (2**20 elements a block tensor) let through tiles that compile
  for minutes or longer (1024 x 1024 x 1024 had not finished after 8 minutes) and
  overflow every GPU's shared memory.
- **num_warps:** a power of two (Triton's CUDA and HIP options assert it) and at most
  1024 threads per program (``num_warps`` x the target's warp size: 32 on NVIDIA and in
  the interpreter, 64 on AMD).
- **num_stages:** 1 .. :data:`MAX_NUM_STAGES` (8; pipeline stages, 1 is no
  pipelining). The tuning space offers at most 5; each stage beyond the first holds
  another copy of the A and B tiles in shared memory, so a deep pipeline only overflows it
  (64 stages of a 64 x 64 x 128 A4W4 tile need 564736 B on sm_90, whose limit is 232448 B).
- **shared memory:** for a GPU target (``targets.TARGETS``: not the interpreter), a lower
  bound of the shared memory the pipelined operand tiles take, :func:`shared_memory_floor`:
  ``(num_stages - 1) x (block_m + block_n) x block_k / 2`` bytes (``num_stages - 1``
  buffers of the A and B tiles, at 4 bits an element, the narrowest operand the GEMMs
  take; scales, upcast buffers, the epilogue and the compiler's static shared memory are
  not counted), at most the target's ``shared_memory``. It is a floor, not an estimate:
  every GEMM launch of the compile matrix (``benchmarks/results/compile-matrix*.json``,
  Triton 3.6 and 3.9, all five targets, the plain and grouped GEMMs, A4W4 and W4A16) uses
  at least this much (1.01x at the closest, A4W4 128 x 64 x 256 in 4 stages on sm_100),
  and the tuning-space candidates it refuses were compiled and overflowed. One caveat: with
  macro-block operands the GEMM lowers ``block_k`` to the macro period
  (``gemm.launch_spec``); the floor takes ``block_k`` as written (the rules do not know the
  operands), so such a config must give the ``block_k`` the GEMM launches, as the tuner
  writes it.
- **group_m:** 1 .. :data:`MAX_GROUP_M` (``splitk.program_tile`` divides by ``GROUP_M`` x
  the tiles along N, an int32 product: a huge group_m wraps it, and some output tiles are
  then never written, silently; the tuner's own choices are 1 .. 16).
- **split_k:** >= 0 (0: chosen per shape, ``TritonBackend.resolve_split_k``) and, for a
  shape with padded K ``kp``, at most ``max(1, kp // block_k)``: every split has a K
  tile, the tuner's own rule (``GemmSpace.violation``); a larger split only adds programs
  with nothing to sum and grows the split-K workspace (tiles x split_k x block_m x
  block_n fp32) without bound.
- **extra:** the launch options the vendor's Triton takes, on AMD targets only: ``kpack``
  (1 or 2), ``matrix_instr_nonkdim`` and ``waves_per_eu`` (ints >= 0). Triton's CUDA
  launcher refuses keyword arguments it does not know.

Not checked here: what depends on the compiled code (registers, the shared memory beyond
the floor above, whether the native block-scaled instruction survives). The tuner's
static stage compiles every candidate for its target before timing it
(``tuning/static.py``); a hand-written config that does not compile on its GPU stops at
its first launch with Triton's compile error.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

from .launch import GemmConfig

MIN_BLOCK_M = 16
"""The smallest ``block_m``: the tuning space's smallest on any target, and at least the
W4A16 sparse outlier path's token count (``gemm_upcast.SPARSE_MAX_M``)."""
MAX_BLOCK_MN = 256
"""The largest ``block_m`` and ``block_n``: the tuning space's largest on any target."""
MAX_BLOCK_K = 512
"""The largest ``block_k``: the tuning space's largest on any target."""
MAX_NUM_STAGES = 8
"""The most pipeline stages (the tuning space offers 1 .. 5)."""
MAX_THREADS = 1024
"""Threads per program (CUDA block, HIP workgroup) at most."""
MAX_GROUP_M = 64
"""The largest ``group_m``: GROUP_M x (tiles along N) stays far inside int32 for any N a
GEMM has (64 x 2**24 tiles), and a larger group orders no program differently in
practice (it exceeds the row tiles of any but the largest M)."""
AMD_OPTIONS = ("kpack", "matrix_instr_nonkdim", "waves_per_eu")
"""The vendor launch options a GemmConfig's ``extra`` may carry on AMD targets."""
NVIDIA_OPTIONS = ("maxnreg",)
"""... and on NVIDIA targets: ptxas' register cap per thread, an int in MAXNREG_RANGE (a
tuned config may carry it: sm_90's decode tile ran 8.5% faster held at 128 on an H200,
benchmarks/NOTES-gemm.md)."""
MAXNREG_RANGE = (16, 255)
"""The register caps ``maxnreg`` may ask ptxas for (its per-thread range)."""

_FIELDS = tuple(f.name for f in dataclasses.fields(GemmConfig))
_DEFAULT_STAGES = next(f.default for f in dataclasses.fields(GemmConfig) if f.name == "num_stages")
_REQUIRED = tuple(f.name for f in dataclasses.fields(GemmConfig)
                  if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _pow2(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def _target(arch: Optional[str]):
    from ..targets import TARGETS

    return TARGETS.get(arch) if arch else None


def problems(fields: Mapping[str, Any], arch: Optional[str] = None, kp: Optional[int] = None) -> list[str]:
    """Why the GemmConfig fields ``fields`` (a mapping as a cache file holds it: ``extra``
    a list of [name, value] pairs) cannot be launched for target ``arch`` (a name of
    ``targets.TARGETS``; anything else, e.g. "interpret": warp size 32, no vendor options)
    at padded K ``kp`` (None: no shape); empty when they can. One line per broken rule."""
    if not isinstance(fields, Mapping):
        return [f"the config is a {type(fields).__name__}, not a mapping of GemmConfig fields"]
    out = []
    unknown = sorted(set(fields) - set(_FIELDS), key=str)
    if unknown:
        out.append(f"GemmConfig has no field {', '.join(map(str, unknown))} in this version "
                   "(written by a newer portable_mx?)")
    missing = [name for name in _REQUIRED if name not in fields]
    if missing:
        out.append(f"missing {', '.join(missing)}")
    ints = {}
    for name in _FIELDS:
        if name == "extra" or name not in fields:
            continue
        value = fields[name]
        if not _is_int(value):
            out.append(f"{name} must be an int, got {value!r} ({type(value).__name__})")
        else:
            ints[name] = value
    for name in ("block_m", "block_n"):
        if name in ints and not _pow2(ints[name]):
            out.append(f"{name} {ints[name]} is not a positive power of two")
    if _pow2(ints.get("block_m", 0)) and ints["block_m"] < MIN_BLOCK_M:
        out.append(f"block_m {ints['block_m']} is less than {MIN_BLOCK_M}, the smallest tile the tuner offers "
                   "(the W4A16 outlier correction at M <= 4 needs every token in one row tile)")
    if "block_k" in ints and not (_pow2(ints["block_k"]) and ints["block_k"] >= 32):
        out.append(f"block_k {ints['block_k']} is not a power of two >= 32")
    tiles = (("block_m", MAX_BLOCK_MN), ("block_n", MAX_BLOCK_MN), ("block_k", MAX_BLOCK_K))
    for name, top in tiles:
        if ints.get(name, 0) > top:
            out.append(f"{name} {ints[name]} is more than {top}, the largest tile the tuner offers")
    tiles_ok = all(name in ints and _pow2(ints[name]) and ints[name] <= top for name, top in tiles)
    bm, bn, bk = (ints.get(n) for n in ("block_m", "block_n", "block_k"))
    target = _target(arch)
    warp = target.warp_size if target is not None else 32
    if "num_warps" in ints:
        w = ints["num_warps"]
        if not _pow2(w):
            out.append(f"num_warps {w} is not a positive power of two")
        elif w * warp > MAX_THREADS:
            out.append(f"num_warps {w} x warp size {warp} is more than {MAX_THREADS} threads per program")
    stages = ints.get("num_stages")
    if stages is not None and not 1 <= stages <= MAX_NUM_STAGES:
        out.append(f"num_stages {stages} is not in 1 .. {MAX_NUM_STAGES}")
    elif target is not None and tiles_ok:
        stages = _DEFAULT_STAGES if stages is None else stages
        floor = shared_memory_floor(bm, bn, bk, stages)
        if floor > target.shared_memory:
            out.append(f"num_stages {stages} of m{bm}xn{bn}xk{bk} tiles need at least {floor} B of shared memory "
                       f"(their pipelined A and B tiles at 4 bits an element), more than {target.name}'s "
                       f"{target.shared_memory} B")
    if "group_m" in ints and not 1 <= ints["group_m"] <= MAX_GROUP_M:
        out.append(f"group_m {ints['group_m']} is not in 1 .. {MAX_GROUP_M}")
    if "split_k" in ints:
        split = ints["split_k"]
        if split < 0:
            out.append(f"split_k {split} is negative (0 chooses it per shape)")
        elif kp is not None and bk is not None and bk > 0 and split > max(1, kp // bk):
            out.append(f"split_k {split} is more than the {max(1, kp // bk)} K tiles of block_k {bk} "
                       f"in padded K {kp}")
    out += _extra_problems(fields.get("extra", []), target)
    return out


def shared_memory_floor(block_m: int, block_n: int, block_k: int, num_stages: int) -> int:
    """A lower bound, in bytes, of the shared memory a GEMM launch of these tiles takes on
    a GPU: ``num_stages - 1`` pipeline buffers of the A [block_m, block_k] and B [block_n,
    block_k] tiles at 4 bits an element (MXFP4, the narrowest operand; a bf16 operand takes
    4x that). Scales, upcast and epilogue buffers are left out, so the launch takes more
    (see the module doc for the evidence)."""
    return max(0, num_stages - 1) * (block_m + block_n) * block_k // 2


def _extra_problems(extra: Any, target) -> list[str]:
    if not isinstance(extra, (list, tuple)):
        return [f"extra must be a list of [name, value] pairs, got {extra!r}"]
    out, seen = [], set()
    amd = target is not None and target.vendor == "amd"
    for item in extra:
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str)):
            out.append(f"extra item {item!r} is not a [name, value] pair")
            continue
        name, value = item
        if name in seen:
            out.append(f"extra option {name} given twice")
        seen.add(name)
        if name in NVIDIA_OPTIONS:
            low, high = MAXNREG_RANGE
            if target is None or target.vendor != "nvidia":
                out.append(f"extra option {name} is NVIDIA's; this config is for "
                           f"{target.name if target else 'a non-NVIDIA target'}")
            elif not _is_int(value) or not low <= value <= high:
                out.append(f"extra option {name} = {value!r} is not an int in {low} .. {high}")
        elif name not in AMD_OPTIONS:
            out.append(f"extra option {name!r} is not a launch option of the GEMM "
                       f"({', '.join(AMD_OPTIONS + NVIDIA_OPTIONS)})")
        elif not amd:
            where = target.name if target else "a non-AMD target"
            out.append(f"extra option {name} is AMD's; this config is for {where}")
        elif not _is_int(value) or value < 0 or (name == "kpack" and value not in (1, 2)):
            out.append(f"extra option {name} = {value!r} is not " + ("1 or 2" if name == "kpack" else "an int >= 0"))
    return out


def config_from_fields(fields: Mapping[str, Any], arch: Optional[str] = None, kp: Optional[int] = None) -> GemmConfig:
    """The GemmConfig of ``fields`` (as :func:`problems` takes them); ValueError naming
    every broken rule when the kernels cannot launch it."""
    found = problems(fields, arch, kp)
    if found:
        raise ValueError("invalid GEMM config: " + "; ".join(found))
    return GemmConfig(**{**fields, "extra": tuple(tuple(kv) for kv in fields.get("extra", ()))})
