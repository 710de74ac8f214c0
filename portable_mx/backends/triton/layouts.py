"""Storage layouts of a GEMM weight: its E8M0 scales (plain and the vendor swizzles) and
its E2M1 codes (plain and the sm_90 upcast layout).

A layout is a private storage detail of a backend (numerics.md section 1): the MXTensor
keeps its codes ``[R, Kp/2]`` and scales ``[R, S]`` plain (R rows of the weight, S =
Kp/32), and a backend whose target wants another order swizzles them once per weight
(:func:`prepared`) and reads the swizzled copy in the GEMM. Each layout has its torch
swizzle and unswizzle side by side with the in-kernel twin of its offsets
(:func:`scale_offset`; the upcast GEMM's tile loads, gemm_upcast.py); tests check the
round trip and that the kernel reading a swizzled copy multiplies exactly what it reads
from the plain one.

Scale layouts:

- ``plain``: row-major ``[R, S]``.
- ``blackwell``: 128 x 4 tiles of 512 contiguous bytes, tiles row-major over
  (R/128, S/4); inside a tile, (r, s) sits at ``(r % 32) * 16 + (r // 32) * 4 + s``: the
  order in which tcgen05's block-scaled MMA takes its scale factors (NVIDIA's documented
  scale-factor layout for sm_100 block scaling).
- ``cdna4``: for gfx950's scaled MFMA 16x16x128: rows in groups of 32 = 2 x 16, columns in
  groups of 8 = 2 x 4; (r, s) with r = 32 r1 + 16 rp + rt, s = 8 s1 + 4 sp + st sits at
  ``(((r1 * S8 + s1) * 4 + st) * 16 + rt) * 4 + 2 sp + rp`` (S8 = padded S / 8): the 4
  scales one lane feeds to 2 x 2 MFMAs are one 32-bit word, and a wave's 64 lanes read
  256 contiguous bytes.
- ``hopper``: for the upcast GEMM on sm_90 (gemm_upcast.py), 512-byte tiles of 64 rows x 8
  scales, tiles row-major over (R/64, S/8); inside a tile, (r, s) sits at
  ``(r % 8) * 16 + ((r // 16) % 4) * 128 + (s % 8) * 2 + (r // 8) % 2``: the scales of rows
  r and r + 8 (the two rows a thread holds in a wgmma register operand) interleaved, so a
  K tile of BK values gives each thread BK/16 contiguous bytes.

Value layouts (:class:`ValueLayout`):

- ``plain``: the MXTensor's codes as they are.
- ``hopper``: the wgmma register-operand order of sm_90 (see :class:`HopperValues`).

Padding (rows to the tile, columns to the tile) holds byte 0 and is never read for
in-range elements.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ... import _graphs
from ...tensor import version_of
from .upcast import hopper_code_bit


@dataclass(frozen=True)
class ScaleLayout:
    """One scale layout: its name, the id the kernel's ``scale_offset`` takes, and its
    tile (rows x columns) to which the storage is padded."""

    name: str
    layout_id: int
    row_tile: int
    col_tile: int

    def padded(self, rows: int, cols: int) -> tuple[int, int]:
        return -(-rows // self.row_tile) * self.row_tile, -(-cols // self.col_tile) * self.col_tile

    def offsets(self, r: torch.Tensor, s: torch.Tensor, cols: int) -> torch.Tensor:
        """Flat storage offsets of elements (r, s) of an [R, cols] scale matrix (the torch
        twin of :func:`scale_offset`)."""
        cols_p = self.padded(1, cols)[1]
        if self.layout_id == 0:
            return r * cols + s
        if self.layout_id == 1:
            tile = (r // 128) * (cols_p // 4) + s // 4
            return tile * 512 + (r % 32) * 16 + ((r // 32) % 4) * 4 + s % 4
        if self.layout_id == 3:
            tile = (r // 64) * (cols_p // 8) + s // 8
            return tile * 512 + (r % 8) * 16 + ((r // 16) % 4) * 128 + (s % 8) * 2 + (r // 8) % 2
        r1, rp, rt = r // 32, (r // 16) % 2, r % 16
        s1, sp, st = s // 8, (s // 4) % 2, s % 4
        return (((r1 * (cols_p // 8) + s1) * 4 + st) * 16 + rt) * 4 + sp * 2 + rp

    def _grid(self, rows: int, cols: int, device) -> torch.Tensor:
        r = torch.arange(rows, device=device, dtype=torch.int64)[:, None]
        s = torch.arange(cols, device=device, dtype=torch.int64)[None, :]
        return self.offsets(r, s, cols)

    def swizzle(self, scales: torch.Tensor) -> torch.Tensor:
        """uint8 [R, S] -> the flat uint8 storage of this layout (padded)."""
        rows, cols = scales.shape
        rows_p, cols_p = self.padded(rows, cols)
        out = torch.zeros(rows_p * cols_p, dtype=torch.uint8, device=scales.device)
        out[self._grid(rows, cols, scales.device).reshape(-1)] = scales.reshape(-1)
        return out

    def unswizzle(self, storage: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """The flat storage of this layout -> uint8 [rows, cols]."""
        return storage[self._grid(rows, cols, storage.device)]


PLAIN = ScaleLayout("plain", 0, 1, 1)
BLACKWELL = ScaleLayout("blackwell", 1, 128, 4)
CDNA4 = ScaleLayout("cdna4", 2, 32, 8)
HOPPER = ScaleLayout("hopper", 3, 256, 8)
"""Rows padded to 256 (the largest BLOCK_N of the upcast GEMM), so that its tiles need no
row mask; tiles of 64 rows."""
LAYOUTS = {layout.name: layout for layout in (PLAIN, BLACKWELL, CDNA4, HOPPER)}


@triton.jit
def scale_offset(r, s, NB, LAYOUT: tl.constexpr):
    """Offsets of scales (r, s) of an [R, NB] scale matrix stored in layout ``LAYOUT``
    (0 plain, 1 blackwell, 2 cdna4, 3 hopper): the twin of :meth:`ScaleLayout.offsets`."""
    if LAYOUT == 0:
        off = r * NB + s
    elif LAYOUT == 1:
        tile = (r // 128) * ((NB + 3) // 4) + s // 4
        off = tile * 512 + (r % 32) * 16 + ((r // 32) % 4) * 4 + s % 4
    elif LAYOUT == 3:
        tile = (r // 64) * ((NB + 7) // 8) + s // 8
        off = tile * 512 + (r % 8) * 16 + ((r // 16) % 4) * 128 + (s % 8) * 2 + (r // 8) % 2
    else:
        r1 = r // 32
        s1 = s // 8
        off = (((r1 * ((NB + 7) // 8) + s1) * 4 + s % 4) * 16 + r % 16) * 4 + ((s // 4) % 2) * 2 + (r // 16) % 2
    return off


# ----------------------------------------------------------------------------- values


@dataclass(frozen=True)
class ValueLayout:
    """One storage layout of a weight's E2M1 codes: its name, the id the upcast GEMM takes
    (``VALUES``), and the row and K (values) tiles its storage is padded to. The plain
    layout is the MXTensor's own ``[R, Kp/2]`` bytes (two codes per byte, low nibble first)."""

    name: str
    layout_id: int
    row_tile: int
    col_tile: int

    def padded(self, rows: int, k: int) -> tuple[int, int]:
        return -(-rows // self.row_tile) * self.row_tile, -(-k // self.col_tile) * self.col_tile

    def row_stride(self, k: int) -> int:
        """Bytes from one row (plain) or one 64-row block (hopper) of storage to the next."""
        return self.padded(1, k)[1] // 2 if self.layout_id == 0 else self.padded(1, k)[1] * 32

    def swizzle(self, codes: torch.Tensor) -> torch.Tensor:
        """uint8 codes [R, Kp/2] -> the flat uint8 storage of this layout (padded)."""
        return codes.reshape(-1)

    def unswizzle(self, storage: torch.Tensor, rows: int, kp: int) -> torch.Tensor:
        """The flat storage of this layout -> uint8 codes [rows, kp/2]."""
        return storage.reshape(rows, kp // 2)


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [R, Kp/2] -> uint8 codes [R, Kp] (element 2j from the low nibble)."""
    return torch.stack((codes & 15, codes >> 4), dim=-1).reshape(codes.shape[0], -1)


def _code_bits(pair: int, half: int) -> tuple[int, ...]:
    """The word bits that hold code bits 0..3 (mantissa, exponent low, exponent high, sign)
    of half ``half`` of pair ``pair`` in the sm_90 layout (upcast.hopper_code_bit)."""
    return tuple(int(hopper_code_bit(pair, half, k)) for k in range(4))


# hopper storage order of the 14 size-2 (or tile) axes of the padded codes
# [AN, n5, n4, n3, n2, n1, n0, AK, k5, k4, k3, k2, k1, k0] (AN, AK: 64-row / 64-column
# tiles; n*, k*: the bits of the row and column inside them)
_HOPPER_ORDER = (0, 7, 1, 2, 4, 5, 6, 11, 12, 8, 9, 3, 10, 13)


@dataclass(frozen=True)
class HopperValues(ValueLayout):
    """The codes in the order in which sm_90's wgmma takes its register operand A (bf16,
    m64 x k16 per warpgroup; thread ``l`` of warp ``w`` holds rows 16w + l//4 (+8) and
    columns 2(l%4) (+1, +8, +9) of each k16 step), so that the upcast GEMM's tile load
    is 16 bytes per thread and its decode needs no data movement.

    Storage: 2048-byte tiles of 64 rows x 64 columns, tiles row-major over (R/64, K/64)
    (rows padded to 256, K to 256). Inside a tile, with the row's bits n5..n0 and the
    column's bits k5..k0, the byte at ``k0 | k3<<1 | k4<<2 | k5<<3 | k1<<4 | k2<<5 |
    n0<<6 | n1<<7 | n2<<8 | n4<<9 | n5<<10``, together with the other three bytes of its
    32-bit word (little-endian), holds the 8 codes (n3, k3, k0 free) of that word: pair
    ``j = 2 n3 + k3`` of the word (upcast.py) is the bf16x2 of the columns k0 = 0, 1. So a
    thread's 16 contiguous bytes are its A fragments of 4 k16 steps, both of its rows,
    lanes 0-3 read 64 contiguous bytes and a warp 512. Inside a word, the 4 bits of the code
    of half h of pair j sit where the decode takes them from (``_code_bits(j, h)``, from
    upcast.hopper_code_bit: pair 0 in place, pair 1 4 bits down, pair 2 rotated by 10,
    pair 3 in two pieces), so that one shift or rotate and one AND (two of each for pair 3)
    make each bf16 pair."""

    def swizzle(self, codes: torch.Tensor) -> torch.Tensor:
        rows, kp = codes.shape[0], codes.shape[1] * 2
        rows_p, k_p = self.padded(rows, kp)
        x = torch.zeros(rows_p, k_p, dtype=torch.int32, device=codes.device)
        x[:rows, :kp] = _nibbles(codes).to(torch.int32)
        x = x.reshape(rows_p // 64, 2, 2, 2, 2, 2, 2, k_p // 64, 2, 2, 2, 2, 2, 2)
        x = x.permute(*_HOPPER_ORDER).reshape(-1, 4, 2)  # [word, pair j, half h]
        word = torch.zeros(x.shape[0], dtype=torch.int64, device=codes.device)
        for j in range(4):
            for h in range(2):
                c = x[:, j, h].to(torch.int64)
                for k, at in enumerate(_code_bits(j, h)):
                    word |= ((c >> k) & 1) << at
        word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
        return word.view(torch.uint8)

    def unswizzle(self, storage: torch.Tensor, rows: int, kp: int) -> torch.Tensor:
        rows_p, k_p = self.padded(rows, kp)
        word = storage.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        codes = torch.zeros(word.shape[0], 4, 2, dtype=torch.int64, device=storage.device)
        for j in range(4):
            for h in range(2):
                for k, at in enumerate(_code_bits(j, h)):
                    codes[:, j, h] |= ((word >> at) & 1) << k
        sizes = (rows_p // 64, 2, 2, 2, 2, 2, 2, k_p // 64, 2, 2, 2, 2, 2, 2)
        stored = codes.reshape(*(sizes[i] for i in _HOPPER_ORDER))
        inverse = sorted(range(14), key=_HOPPER_ORDER.__getitem__)
        x = stored.permute(*inverse).reshape(rows_p, k_p)[:rows, :kp].to(torch.uint8)
        return x[:, 0::2] | (x[:, 1::2] << 4)


PLAIN_VALUES = ValueLayout("plain", 0, 1, 32)
HOPPER_VALUES = HopperValues("hopper", 1, 256, 256)
"""Rows and K padded to 256 (the largest BLOCK_N and BLOCK_K of the upcast GEMM): its tile
loads need no mask."""
VALUE_LAYOUTS = {layout.name: layout for layout in (PLAIN_VALUES, HOPPER_VALUES)}


# ----------------------------------------------------------------------------- swizzle kernels


@triton.jit
def _hopper_values_kernel(codes_ptr, out_ptr, R, KB, stride_r, TILES_K):
    """One 64-row x 64-code tile of uint8 codes [R, KB = Kp/2] (row stride ``stride_r``)
    -> its 512 int32 words of :class:`HopperValues` storage (padding: code 0). The
    gather twin of ``HopperValues.swizzle``: word w of a tile has, low bit first, the
    bits k4 k5 k1 k2 n0 n1 n2 n4 n5 (``_HOPPER_ORDER``); pair j = 2 n3 + k3, half h = k0."""
    pid = tl.program_id(0)
    an = pid // TILES_K
    ak = pid - an * TILES_K
    w = tl.arange(0, 512)
    row0 = an * 64 + ((w >> 8) & 1) * 32 + ((w >> 7) & 1) * 16 + ((w >> 6) & 1) * 4 + ((w >> 5) & 1) * 2 \
        + ((w >> 4) & 1)
    byte0 = ak * 32 + ((w >> 1) & 1) * 16 + (w & 1) * 8 + ((w >> 3) & 1) * 2 + ((w >> 2) & 1)
    word = tl.zeros([512], dtype=tl.uint32)
    for j in tl.static_range(4):
        row = row0 + (j // 2) * 8
        byte = byte0 + (j % 2) * 4
        b = tl.load(codes_ptr + row.to(tl.int64) * stride_r + byte, mask=(row < R) & (byte < KB), other=0)
        b = b.to(tl.uint32)
        for h in tl.static_range(2):
            c = (b >> (4 * h)) & 15
            for k in tl.static_range(4):  # code bit k to the word bit the decode reads it from
                word = word | (((c >> k) & 1) << hopper_code_bit(j, h, k))
    tl.store(out_ptr + pid.to(tl.int64) * 512 + w, word.to(tl.int32, bitcast=True))


@triton.jit
def _scales_kernel(s_ptr, out_ptr, R, S, stride_r, LAYOUT: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_S: tl.constexpr):
    """uint8 scales [R, S] (row stride ``stride_r``) scattered to their offsets in scale
    layout ``LAYOUT`` (:func:`scale_offset`, the twin of ``ScaleLayout.offsets``)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
    s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)[None, :]
    mask = (r < R) & (s < S)
    v = tl.load(s_ptr + r.to(tl.int64) * stride_r + s, mask=mask)
    tl.store(out_ptr + scale_offset(r.to(tl.int64), s, S, LAYOUT), v, mask=mask)


_SWIZZLE_OPTIONS = {"num_warps": 4, "enable_fp_fusion": False}
_SCALE_TILE = (64, 32)  # scales (rows, columns) a program of _scales_kernel moves


def swizzle_launch_specs() -> list:
    """The launches :func:`swizzle_kernel` makes (the hopper values; each scale layout
    with an id), as data for the compile matrix."""
    from .launch import KernelLaunch

    ints = {"R": "i32", "KB": "i32", "stride_r": "i32", "TILES_K": "i32"}
    out = [KernelLaunch("swizzle", _hopper_values_kernel, {"codes_ptr": "*u8", "out_ptr": "*i32", **ints}, {},
                        dict(_SWIZZLE_OPTIONS), "hopper values", divisible_by_16=("KB", "stride_r"))]
    for layout in LAYOUTS.values():
        if layout.layout_id:
            signature = {"s_ptr": "*u8", "out_ptr": "*u8", "R": "i32", "S": "i32", "stride_r": "i32",
                         "LAYOUT": "constexpr", "BLOCK_R": "constexpr", "BLOCK_S": "constexpr"}
            out.append(KernelLaunch("swizzle", _scales_kernel, signature,
                                    {"LAYOUT": layout.layout_id, "BLOCK_R": _SCALE_TILE[0], "BLOCK_S": _SCALE_TILE[1]},
                                    dict(_SWIZZLE_OPTIONS), f"{layout.name} scales"))
    return out


def _runs_triton(t: torch.Tensor) -> bool:
    """Whether the swizzle kernels run on ``t``'s device: a GPU (CUDA or ROCm) with the
    kernels compiled, or the CPU with them interpreted."""
    from . import interpreting

    return (t.device.type == "cpu") == interpreting() and t.device.type in ("cpu", "cuda")


def swizzle_kernel(plain: torch.Tensor, layout) -> torch.Tensor:
    """``layout.swizzle(plain)`` in one Triton launch (after a zero fill where the scale
    layout pads its storage), bit-identical to the torch twin: for a layout with an id."""
    rows, cols = plain.shape
    if plain.stride(1) != 1:
        plain = plain.contiguous()
    rows_p, cols_p = layout.padded(rows, cols if isinstance(layout, ScaleLayout) else cols * 2)
    if isinstance(layout, HopperValues):
        out = torch.empty(rows_p * cols_p // 8, dtype=torch.int32, device=plain.device)
        tiles_k = cols_p // 64
        with _on(plain):
            _hopper_values_kernel[(rows_p // 64 * tiles_k,)](plain, out, rows, cols, plain.stride(0), tiles_k,
                                                             **_SWIZZLE_OPTIONS)
        return out.view(torch.uint8)
    alloc = torch.zeros if (rows_p, cols_p) != (rows, cols) else torch.empty
    out = alloc(rows_p * cols_p, dtype=torch.uint8, device=plain.device)
    with _on(plain):
        _scales_kernel[(-(-rows // _SCALE_TILE[0]), -(-cols // _SCALE_TILE[1]))](
            plain, out, rows, cols, plain.stride(0), layout.layout_id, *_SCALE_TILE, **_SWIZZLE_OPTIONS)
    return out


def swizzled(plain: torch.Tensor, layout) -> torch.Tensor:
    """``layout.swizzle(plain)``: by :func:`swizzle_kernel` where Triton runs on plain's
    device, else by the torch twin (about 100 elementwise kernels for the hopper values:
    ~4 ms for an 8192 x 8192 weight on an H200, paid on every call where the weight is
    quantized per call, e.g. MXLinear outside weight_cache)."""
    return swizzle_kernel(plain, layout) if _runs_triton(plain) else layout.swizzle(plain)


def _on(t: torch.Tensor):
    """The launch's device: ``t``'s GPU (Triton launches on the current device)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


# swizzled copies, kept for as long as the storage of the plain tensor they were made
# from lives (keyed by the storage object, which torch keeps one per storage: every view
# and detached alias of the tensor finds the same entry)
_PREPARED: dict[tuple, tuple[weakref.ref, int, torch.Tensor]] = {}


def _kept(plain: torch.Tensor, tag: tuple, make) -> torch.Tensor:
    """``make(plain)``, made on first use and then kept with plain's storage (for as long
    as it lives and its version does not change). Made again after an in-place write of
    plain, into the kept tensor (its address, which a CUDA graph captured with it reads,
    holds the new copy: ``_graphs.refill``). While the stream is captured into a CUDA
    graph: made for the graph, nothing read or kept (``portable_mx._graphs``)."""
    version = version_of(plain)
    if version is None or _graphs.capturing(plain):  # an inference tensor has no version counter
        return make(plain)
    storage = plain.untyped_storage()
    key = (id(storage), plain.storage_offset(), tuple(plain.shape), plain.stride(), *tag)
    hit = _PREPARED.get(key)
    if hit is not None and hit[0]() is storage:
        if hit[1] == version:
            return hit[2]
        out = make(plain)
        if _graphs.refill((hit[2],), (out,), (plain,)):
            out = hit[2]
    else:
        out = make(plain)
    ref = weakref.ref(storage, lambda _, key=key: _PREPARED.pop(key, None))
    _PREPARED[key] = (ref, version, out)
    return out


def prepared(plain: torch.Tensor, layout) -> torch.Tensor:
    """``plain`` (a weight's scales, or its codes for a :class:`ValueLayout`) in
    ``layout``: swizzled on first use and then kept with the tensor's storage (a weight's
    MXTensor is swizzled once, not per call). The plain layouts return the tensor as it
    is. An in-place change of ``plain`` (its version) makes a new copy."""
    if layout.layout_id == 0:
        return plain
    return _kept(plain, (type(layout).__name__, layout.name), lambda t: swizzled(t, layout))


def largest_scale(scales: torch.Tensor) -> torch.Tensor:
    """The largest E8M0 byte of a weight's scales (uint8 [1], on their device, computed
    there: no host synchronisation), kept like :func:`prepared`: the upcast GEMM decodes
    with one multiply where it is at most 128 (upcast.folded_scale)."""
    return _kept(scales, ("largest",), lambda t: torch.amax(t).reshape(1) if t.numel() else t.new_zeros(1))
