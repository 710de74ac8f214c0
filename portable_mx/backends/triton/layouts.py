"""Storage layouts of a GEMM weight's E8M0 scales: plain, and the vendor swizzles.

A scale layout is a private storage detail of a backend (numerics.md section 1): the
MXTensor keeps its scales plain ``[R, S]`` (R rows of the weight, S = Kp/32), and a
backend whose target wants another order swizzles them once per weight
(:func:`prepared`) and reads the swizzled copy in the GEMM. Each layout has its torch
swizzle and unswizzle side by side with the in-kernel twin of its offset formula
(:func:`scale_offset`); tests check that the kernel reading a swizzled copy multiplies
exactly what it reads from the plain one.

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

Padding (rows to the tile, columns to the tile) holds byte 0 and is never read for
in-range elements.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


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
LAYOUTS = {layout.name: layout for layout in (PLAIN, BLACKWELL, CDNA4)}


@triton.jit
def scale_offset(r, s, NB, LAYOUT: tl.constexpr):
    """Offsets of scales (r, s) of an [R, NB] scale matrix stored in layout ``LAYOUT``
    (0 plain, 1 blackwell, 2 cdna4): the twin of :meth:`ScaleLayout.offsets`."""
    if LAYOUT == 0:
        off = r * NB + s
    elif LAYOUT == 1:
        tile = (r // 128) * ((NB + 3) // 4) + s // 4
        off = tile * 512 + (r % 32) * 16 + ((r // 32) % 4) * 4 + s % 4
    else:
        r1 = r // 32
        s1 = s // 8
        off = (((r1 * ((NB + 7) // 8) + s1) * 4 + s % 4) * 16 + r % 16) * 4 + ((s // 4) % 2) * 2 + (r // 16) % 2
    return off


# swizzled copies, kept for as long as the storage of the plain scales they were made
# from lives (keyed by the storage object, which torch keeps one per storage: every view
# and detached alias of the scales finds the same entry)
_PREPARED: dict[tuple, tuple[weakref.ref, int, torch.Tensor]] = {}


def prepared(scales: torch.Tensor, layout: ScaleLayout) -> torch.Tensor:
    """``scales`` in ``layout``: swizzled on first use and then kept with the tensor's
    storage (a weight's MXTensor is swizzled once, not per call). Plain scales are
    returned as they are. An in-place change of ``scales`` (its version) makes a new copy."""
    if layout.layout_id == 0:
        return scales
    storage = scales.untyped_storage()
    key = (id(storage), scales.storage_offset(), tuple(scales.shape), scales.stride(), layout.name)
    hit = _PREPARED.get(key)
    if hit is not None and hit[0]() is storage and hit[1] == scales._version:
        return hit[2]
    out = layout.swizzle(scales)
    ref = weakref.ref(storage, lambda _, key=key: _PREPARED.pop(key, None))
    _PREPARED[key] = (ref, scales._version, out)
    return out
