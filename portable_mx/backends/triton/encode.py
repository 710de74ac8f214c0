"""The encoding steps the quantize and decompose kernels share, in the order of the
reference backend's ``encode``, on *words*.

Word layout. A row of K elements (K even) is read as K/2 words of two consecutive
elements: int32 words for bf16 / fp16 input, int64 words for fp32 (little-endian: the
even element in the low half). Packed byte j of the codes is made from word j alone, so a
tile of ``[BLOCK_R, BLOCK_K/2]`` words turns into the ``[BLOCK_R, BLOCK_K/2]`` bytes it
writes, element for element, and a 32-block is 16 consecutive words. Because the load
and the store of a quantize have the same shape, Triton's coalescing gives the load the
store's 16 bytes per thread: one thread owns whole 32-blocks (4 x 16-byte loads for bf16),
and the block reductions, the scale and the packing stay in its registers (no shuffles,
no shared memory). Inside a kernel a word tile is viewed as ``[BLOCK_R, NBK, 16]``
(rows, blocks, words) and split into the fp32 bits (int32) of its even (``lo``) and odd
(``hi``) elements.

1. :func:`unpack_words`: words -> (lo, hi) fp32 bits;
2. :func:`split_blocks`: per block the amax (an integer max of |bits|), the special flag
   (a NaN or Inf: amax >= Inf's bits; with outliers, the largest key's) and the k
   outliers taken out;
3. macro factors (in the kernels), then :func:`encode_halves`: divide by the macro
   factor, the scale exponent from the amax's bits, the E2M1 codes with the sign OR-ed in.

A kernel walks one row tile over ``SPAN`` columns (one macro block, or ``BLOCK_K``
columns) in ``NUM_CHUNKS`` chunks of ``BLOCK_K``; ``MACRO_GROUP > 0`` instead puts
several macro blocks of ``MACRO_GROUP`` 32-blocks each inside one chunk.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .numerics import (
    F32_ABS,
    F32_INF,
    F32_SIGN,
    as_f32,
    bf16_round_bits,
    e2m1_code_nearest,
    e2m1_code_stochastic,
    f32_bits,
    inverse_scale,
    macro_factor,
    philox4x32,
    scale_exponent,
)

IN_KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
"""Constexpr id of each input dtype; its words are int32 (16-bit elements) or int64."""
IN_POINTERS = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}
"""The kernels' input pointer type per dtype: the input tensor itself is passed, and the
kernel reads it as words (:func:`word_pointer`)."""


def fma_divides(interpreted: bool) -> bool:
    """Whether the kernels may divide by the macro factor with fused multiply-adds
    (:func:`scaled_halves`): always when compiled; under the interpreter only where its
    ``tl.fma`` rounds once (triton >= 3.8 has an exact fp32 fma; older versions multiply
    and add in numpy, rounding twice), else they use ``div_rn``."""
    if not interpreted:
        return True
    from triton.runtime import interpreter

    return hasattr(getattr(interpreter, "_interpreter", None), "fma_fp32")


def readable_as_words(x: torch.Tensor) -> bool:
    """Whether the kernels can read x [R, K] (unit stride along K) as words of two
    elements: K, the row stride and the storage offset even."""
    return x.shape[1] % 2 == 0 and x.stride(0) % 2 == 0 and x.storage_offset() % 2 == 0


def as_words(x: torch.Tensor) -> torch.Tensor:
    """x [R, K] (fp32 / bf16 / fp16, unit stride along K) as the kernels read it, pairs
    of elements as words: x itself when :func:`readable_as_words`, else a zero-padded
    copy [R, K + 1] (the slow path of odd shapes). Its word row stride is
    ``stride(0) // 2``."""
    if readable_as_words(x):
        return x
    r, k = x.shape
    padded = torch.zeros(r, k + (k & 1), dtype=x.dtype, device=x.device)
    padded[:, :k] = x
    return padded


@triton.jit
def word_pointer(x_ptr, IN_KIND: tl.constexpr):
    """The input pointer (bf16, fp16 or fp32 elements) as a pointer to words of two
    elements: int32 for 16-bit input, int64 for fp32 (the caller guarantees an even
    element offset, :func:`as_words`)."""
    if IN_KIND == 2:
        w = x_ptr.to(tl.pointer_type(tl.int64))
    else:
        w = x_ptr.to(tl.pointer_type(tl.int32))
    return w


# ----------------------------------------------------------------------------- tiles


MAX_GRID_YZ = 65535
"""The largest grid size along a launch's second and third axes (CUDA and HIP)."""


@triton.jit
def program_tile(K_FIRST: tl.constexpr):
    """(row tile, column span) of this program in the grid of :func:`tile_grid`. K_FIRST:
    the first grid axis counts the spans of one row tile, so consecutive programs (and the
    ones resident at any moment) read and write one contiguous stretch of the tensor, as a
    copy does; else it counts the row tiles of one span (pieces of SPAN columns, rows
    BLOCK_R apart). The other count is split over the second and third axes, which may
    leave a few programs past its end: their rows (or columns) are past the tensor's, and
    the kernel is launched with its masks then (:func:`exact_grid`)."""
    inner = tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)
    if K_FIRST:
        pid_r = inner
        pid_k = tl.program_id(0)
    else:
        pid_r = tl.program_id(0)
        pid_k = inner
    return pid_r, pid_k


def tile_grid(r: int, kp: int, block_r: int, span: int, k_first: bool) -> tuple[int, int, int]:
    """The launch grid of :func:`program_tile` for r rows of kp (padded) columns: any size
    (the second axis alone would cap the count it holds at 65535) and no division in the
    kernel."""
    rows, spans = -(-r // block_r), -(-kp // span)  # (triton.cdiv costs ~1.5 us a call on the host)
    outer, inner = (spans, rows) if k_first else (rows, spans)
    z = -(-inner // MAX_GRID_YZ)
    return outer, -(-inner // z), z


def exact_grid(r: int, kp: int, block_r: int, span: int, k_first: bool) -> bool:
    """Whether :func:`tile_grid` has exactly one program a tile (always, unless the inner
    count is above 65535 and not a multiple of its slabs): the maskless kernels need it."""
    rows, spans = -(-r // block_r), -(-kp // span)
    _, y, z = tile_grid(r, kp, block_r, span, k_first)
    return y * z == (rows if k_first else spans)


@triton.jit
def blocked(t, BLOCK_R: tl.constexpr, BW: tl.constexpr):
    """[BR, BW] words -> [BR, BW/16, 16] (rows, 32-blocks, words)."""
    return tl.reshape(t, (BLOCK_R, BW // 16, 16))


@triton.jit
def flat(t, BLOCK_R: tl.constexpr, BW: tl.constexpr):
    """[BR, BW/16, 16] -> [BR, BW]."""
    return tl.reshape(t, (BLOCK_R, BW))


@triton.jit
def chunk_words(rows, col0, c, R, KW_IN, KW, BW: tl.constexpr, SPAN: tl.constexpr):
    """Word columns [1, BW] of chunk ``c`` of the span starting at element column
    ``col0``, the load mask (inside the input's KW_IN words) and the store mask (inside
    the padded row's KW words), both within the span. (Kernels with whole tiles skip
    the masks; their computation is then dead code.)"""
    inner = c * BW + tl.arange(0, BW)
    wcol = (col0 // 2 + inner)[None, :]
    live = (rows[:, None] < R) & (inner < SPAN // 2)[None, :]
    return wcol, live & (wcol < KW_IN), live & (wcol < KW)


@triton.jit
def chunk_blocks(rows, col0, c, R, NB, NBK: tl.constexpr, SPAN: tl.constexpr):
    """32-block indices [1, NBK] of chunk ``c`` and the mask [BR, NBK] of those the
    program owns."""
    inner = c * NBK + tl.arange(0, NBK)
    bidx = (col0 // 32 + inner)[None, :]
    return bidx, (rows[:, None] < R) & (inner < SPAN // 32)[None, :] & (bidx < NB)


@triton.jit
def load_block_words(w_ptr, rows, col0, c, R, KW_IN, stride_w, BLOCK_R: tl.constexpr, NBK: tl.constexpr,
                     SPAN: tl.constexpr, VEC: tl.constexpr, EVEN: tl.constexpr, FLAT: tl.constexpr = True):
    """The words [BR, NBK, 16] of chunk ``c``, one 32-block per thread, for kernels with
    no store of the words' shape to lend the load its width (decompose; quantize's values
    output).

    Each of the block's 16/VEC pieces of VEC words (16 bytes) is loaded as its own tile
    (:func:`_load_piece`), whose layout gives a thread one block's piece and spreads the
    threads over the blocks, then the rows, as the per-block loads and stores of the
    kernels (scales, statistics) do; ``tl.join`` then stacks the pieces in the thread's
    registers and the permute + reshape to [BR, NBK, 16] puts the words back in column
    order (stochastic rounding draws by column, so the order matters). (One
    [16/VEC, BR, NBK, VEC] pointer did the same under Triton 3.9, but Triton 3.6 spread
    its first dimension over 4 lanes: blocks shared by 4 threads.) FLAT = False loads
    [BR, NBK, VEC] pieces instead, laid out rows first: for a kernel with no per-block
    tensor to agree with (quantize's values output: fewer registers that way)."""
    w = _load_four_pieces(w_ptr, rows, col0, c, 0, R, KW_IN, stride_w, BLOCK_R, NBK, VEC, SPAN, EVEN, FLAT)
    if VEC == 4:  # [BR, NBK, VEC, a, b], piece 2 b + a
        return tl.reshape(tl.permute(w, (0, 1, 4, 3, 2)), (BLOCK_R, NBK, 16))
    else:  # eight pieces of two: [BR, NBK, VEC, a, b, c], piece 4 c + 2 b + a
        w = tl.join(w, _load_four_pieces(w_ptr, rows, col0, c, 4, R, KW_IN, stride_w, BLOCK_R, NBK, VEC, SPAN,
                                         EVEN, FLAT))
        return tl.reshape(tl.permute(w, (0, 1, 5, 4, 3, 2)), (BLOCK_R, NBK, 16))


@triton.jit
def store_block_words(ptr, words, rows, col0, c, R, KW, stride, BLOCK_R: tl.constexpr, NBK: tl.constexpr,
                      SPAN: tl.constexpr, EVEN: tl.constexpr, VEC: tl.constexpr = 4, FLAT: tl.constexpr = True):
    """Store words [BR, NBK, 16] (one 32-block's 16 words a thread, as
    :func:`load_block_words` loads them; int32 with VEC = 4, int64 with VEC = 2) at word
    columns ``col0 // 2 + c * NBK * 16 + ...`` of rows of ``stride`` words, masked to the
    span and KW words unless EVEN: the block's 16-byte pieces of VEC words split in the
    thread's registers and stored one by one (:func:`_store_piece`), so that no store
    asks for a layout that spreads a block over threads. FLAT as :func:`load_block_words`."""
    if VEC == 4:  # word 8 b + 4 a + v: [.., v, a, b], piece 2 b + a
        _store_four_pieces(ptr, tl.permute(tl.reshape(words, (BLOCK_R, NBK, 2, 2, 4)), (0, 1, 4, 3, 2)), rows, col0,
                           c, 0, R, KW, stride, BLOCK_R, NBK, VEC, SPAN, EVEN, FLAT)
    else:  # word 8 d + 4 b + 2 a + v: [.., v, a, b, d], piece 4 d + 2 b + a
        x, y = tl.split(tl.permute(tl.reshape(words, (BLOCK_R, NBK, 2, 2, 2, 2)), (0, 1, 5, 4, 3, 2)))
        _store_four_pieces(ptr, x, rows, col0, c, 0, R, KW, stride, BLOCK_R, NBK, VEC, SPAN, EVEN, FLAT)
        _store_four_pieces(ptr, y, rows, col0, c, 4, R, KW, stride, BLOCK_R, NBK, VEC, SPAN, EVEN, FLAT)


@triton.jit
def _store_four_pieces(ptr, w, rows, col0, c, j0, R, KW, stride, BLOCK_R: tl.constexpr, NBK: tl.constexpr,
                       VEC: tl.constexpr, SPAN: tl.constexpr, EVEN: tl.constexpr, FLAT: tl.constexpr):
    """Store pieces j0 .. j0 + 3 of every block, stacked in each thread as
    [BR, NBK, VEC, a, b] (piece j0 + 2 b + a; the inverse of :func:`_load_four_pieces`)."""
    x, y = tl.split(w)
    p0, p1 = tl.split(x)
    p2, p3 = tl.split(y)
    _store_piece(ptr, p0, rows, col0, c, j0, R, KW, stride, BLOCK_R, NBK, VEC, SPAN, EVEN, FLAT)
    _store_piece(ptr, p1, rows, col0, c, j0 + 1, R, KW, stride, BLOCK_R, NBK, VEC, SPAN, EVEN, FLAT)
    _store_piece(ptr, p2, rows, col0, c, j0 + 2, R, KW, stride, BLOCK_R, NBK, VEC, SPAN, EVEN, FLAT)
    _store_piece(ptr, p3, rows, col0, c, j0 + 3, R, KW, stride, BLOCK_R, NBK, VEC, SPAN, EVEN, FLAT)


@triton.jit
def _piece_offsets(c, j, NBK: tl.constexpr, VEC: tl.constexpr, FLAT: tl.constexpr):
    """Word offsets in the span of piece ``j`` (words j VEC .. j VEC + VEC - 1) of every
    block of chunk ``c``: FLAT, [1, NBK * VEC], runs of VEC contiguous words 16 words
    apart (a tile of such runs is coalesced VEC words a thread with the threads along the
    flat axis: over the blocks, then the rows, as the per-block tensors are laid out);
    else [1, NBK, VEC] (whose blocks are not contiguous: laid out rows first)."""
    if FLAT:
        t = tl.arange(0, NBK * VEC)
        return (c * NBK * 16 + (t // VEC) * 16 + t % VEC + j * VEC)[None, :]
    else:
        return c * NBK * 16 + tl.arange(0, NBK)[None, :, None] * 16 + tl.arange(0, VEC)[None, None, :] + j * VEC


@triton.jit
def _piece_rows(rows, FLAT: tl.constexpr):
    """``rows`` broadcast against :func:`_piece_offsets`."""
    if FLAT:
        return rows[:, None]
    else:
        return rows[:, None, None]


@triton.jit
def _store_piece(ptr, piece, rows, col0, c, j, R, KW, stride, BLOCK_R: tl.constexpr, NBK: tl.constexpr,
                 VEC: tl.constexpr, SPAN: tl.constexpr, EVEN: tl.constexpr, FLAT: tl.constexpr):
    """Store piece ``j`` [BR, NBK, VEC] of every block of chunk ``c`` (:func:`_piece_offsets`)."""
    inner = _piece_offsets(c, j, NBK, VEC, FLAT)
    wcol = col0 // 2 + inner
    r = _piece_rows(rows, FLAT)
    p = ptr + r * stride + wcol
    if FLAT:
        piece = tl.reshape(piece, (BLOCK_R, NBK * VEC))
    if EVEN:
        tl.store(p, piece)
    else:
        tl.store(p, piece, mask=(r < R) & (inner < SPAN // 2) & (wcol < KW))


@triton.jit
def _load_four_pieces(w_ptr, rows, col0, c, j0, R, KW_IN, stride_w, BLOCK_R: tl.constexpr, NBK: tl.constexpr,
                      VEC: tl.constexpr, SPAN: tl.constexpr, EVEN: tl.constexpr, FLAT: tl.constexpr):
    """Pieces j0 .. j0 + 3 of every block of chunk ``c``, stacked in each thread as
    [BR, NBK, VEC, a, b] (piece j0 + 2 b + a)."""
    p0 = _load_piece(w_ptr, rows, col0, c, j0, R, KW_IN, stride_w, BLOCK_R, NBK, VEC, SPAN, EVEN, FLAT)
    p1 = _load_piece(w_ptr, rows, col0, c, j0 + 1, R, KW_IN, stride_w, BLOCK_R, NBK, VEC, SPAN, EVEN, FLAT)
    p2 = _load_piece(w_ptr, rows, col0, c, j0 + 2, R, KW_IN, stride_w, BLOCK_R, NBK, VEC, SPAN, EVEN, FLAT)
    p3 = _load_piece(w_ptr, rows, col0, c, j0 + 3, R, KW_IN, stride_w, BLOCK_R, NBK, VEC, SPAN, EVEN, FLAT)
    return tl.join(tl.join(p0, p1), tl.join(p2, p3))


@triton.jit
def _load_piece(w_ptr, rows, col0, c, j, R, KW_IN, stride_w, BLOCK_R: tl.constexpr, NBK: tl.constexpr,
                VEC: tl.constexpr, SPAN: tl.constexpr, EVEN: tl.constexpr, FLAT: tl.constexpr):
    """Piece ``j`` [BR, NBK, VEC] of every block of chunk ``c`` from element column
    ``col0`` (:func:`_piece_offsets`; masked to the span and the input unless EVEN)."""
    inner = _piece_offsets(c, j, NBK, VEC, FLAT)
    wcol = col0 // 2 + inner
    r = _piece_rows(rows, FLAT)
    ptr = w_ptr + r * stride_w + wcol
    if EVEN:
        w = tl.load(ptr)
    else:
        w = tl.load(ptr, mask=(r < R) & (inner < SPAN // 2) & (wcol < KW_IN), other=0)
    return tl.reshape(w, (BLOCK_R, NBK, VEC))


@triton.jit
def unpack_words(w, IN_KIND: tl.constexpr):
    """Words -> (lo, hi): the fp32 bits (int32) of the even and odd element of each.
    bf16 widens by a shift, fp16 by the exact conversion, fp32 by splitting the int64."""
    if IN_KIND == 0:
        lo = w << 16
        hi = w & -65536
    elif IN_KIND == 1:
        lo = w.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32).to(tl.int32, bitcast=True)
        hi = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32).to(tl.int32, bitcast=True)
    else:
        lo = w.to(tl.int32)
        hi = (w >> 32).to(tl.int32)
    return lo, hi


# ----------------------------------------------------------------------------- blocks


OUTLIER_CAP = tl.constexpr(0xFF000002)
"""The largest rotated word a 16-bit input's key keeps (:func:`_outlier_keys`): above
-Inf's (0xFF000001) and below every NaN's, with only bit 1 set below the magnitude, so
that every NaN becomes one key that ties with +-Inf and rotates back to a NaN
(0x7F800001)."""
SPECIAL_KEY = tl.constexpr(0xFF000000)
"""The rotated word of +Inf: 16-bit inputs' keys at or above it are NaN or Inf."""


@triton.jit
def _lane_shift(IN_KIND: tl.constexpr):
    """Where the in-block index sits in a 16-bit input's key: above the bits a rotated
    element never sets (bf16 in fp32 leaves 16 low bits zero, fp16 13: rotated, bits
    1..16 and 1..13 are free; bit 0 holds the sign), and above OUTLIER_CAP's bit 1."""
    if IN_KIND == 0:
        return 12
    else:
        return 9


@triton.jit
def _outlier_keys(v, lane, IN_KIND: tl.constexpr):
    """Keys of the fp32 bits ``v`` (int32) at in-block indices ``lane``: their max is the
    first largest |x| of a block, NaN ranking as Inf (the reference's order), and keys
    differ by their index. 16-bit inputs (uint32 keys): the word rotated left by one
    (|x| above its sign, compared unsigned), capped at OUTLIER_CAP (every NaN), with
    31 - lane in bits the element leaves zero: :func:`_key_bits` gives the element back.
    fp32 (int64 keys, no spare bits): min(|x|, Inf) above 31 - lane."""
    if IN_KIND == 2:
        return (tl.minimum(v & F32_ABS, F32_INF).to(tl.int64) << 5) | (31 - lane)
    else:
        u = v.to(tl.uint32, bitcast=True)
        r = tl.minimum((u << 1) | (u >> 31), OUTLIER_CAP)
        return r | ((31 - lane) << _lane_shift(IN_KIND)).to(tl.uint32)


@triton.jit
def _key_index(top, IN_KIND: tl.constexpr):
    """In-block index (int32) of the element of the key ``top``."""
    if IN_KIND == 2:
        return 31 - (top & 31).to(tl.int32)
    else:
        return 31 - ((top >> _lane_shift(IN_KIND)) & 31).to(tl.int32)


@triton.jit
def _key_bits(top, klo, khi, lo, hi, IN_KIND: tl.constexpr):
    """fp32 bits (int32) of the element whose key is ``top`` [BR, NBK]: a 16-bit input's
    key rotated back (a NaN for every NaN: 0x7F800001); for fp32 the element picked out
    of the block by its key."""
    if IN_KIND == 2:
        return (tl.sum(tl.where(klo == top[:, :, None], lo, 0), axis=2)
                + tl.sum(tl.where(khi == top[:, :, None], hi, 0), axis=2))
    else:
        lane = tl.full([], 31 << _lane_shift(IN_KIND), tl.uint32)
        r = top & (lane ^ 0xFFFFFFFF)  # (not ~lane: triton 3.6's interpreter made that a negative int)
        return ((r >> 1) | (r << 31)).to(tl.int32, bitcast=True)


@triton.jit
def _is_special_key(top, IN_KIND: tl.constexpr):
    """Whether the block whose largest key is ``top`` holds a NaN or an Inf."""
    if IN_KIND == 2:
        return top >= (F32_INF << 5)
    else:
        return top >= SPECIAL_KEY


@triton.jit
def split_blocks(lo, hi, IN_KIND: tl.constexpr, N_OUT: tl.constexpr):
    """Special blocks and outliers of a chunk (fp32 bits [BR, NBK, 16] of the halves).

    Returns (rlo, rhi, amax, special, idx1, ob1, idx2, ob2): the halves with outliers
    replaced by +0.0 (the rest), the bits of the rest's amax per block (0 in special
    blocks, which count as 0 for the macro amax), the special flag (a NaN or Inf in the
    block), and per outlier its in-block index and bf16 bits (int32; 0 when unused).

    Outliers: one max of the keys (:func:`_outlier_keys`) per outlier gives its index and
    its bits (a 16-bit input's key holds the element), the largest key marks a special
    block, and the elements whose keys are at least the k-th largest are the k outliers
    (keys differ by their index): one compare an element takes both of OF-2's out."""
    rlo = lo
    rhi = hi
    if N_OUT == 0:
        amax = tl.maximum(tl.max(lo & F32_ABS, axis=2), tl.max(hi & F32_ABS, axis=2))
        special = amax >= F32_INF
        idx1 = tl.zeros(amax.shape, tl.int32)
        ob1 = idx1
        idx2 = idx1
        ob2 = idx1
    else:
        lane = tl.arange(0, 16)[None, None, :] * 2
        klo = _outlier_keys(lo, lane, IN_KIND)
        khi = _outlier_keys(hi, lane + 1, IN_KIND)
        top = tl.maximum(tl.max(klo, axis=2), tl.max(khi, axis=2))
        special = _is_special_key(top, IN_KIND)
        idx1 = _key_index(top, IN_KIND)
        ob1 = bf16_round_bits(_key_bits(top, klo, khi, lo, hi, IN_KIND))
        idx2 = tl.zeros(idx1.shape, tl.int32)
        ob2 = idx2
        out_lo = klo == top[:, :, None]
        out_hi = khi == top[:, :, None]
        if N_OUT == 2:
            cut = tl.maximum(tl.max(tl.where(out_lo, 0, klo), axis=2), tl.max(tl.where(out_hi, 0, khi), axis=2))
            idx2 = _key_index(cut, IN_KIND)
            ob2 = bf16_round_bits(_key_bits(cut, klo, khi, lo, hi, IN_KIND))
            out_lo = klo >= cut[:, :, None]
            out_hi = khi >= cut[:, :, None]
        rlo = tl.where(out_lo, 0, lo)
        rhi = tl.where(out_hi, 0, hi)
        amax = tl.maximum(tl.max(rlo & F32_ABS, axis=2), tl.max(rhi & F32_ABS, axis=2))
    amax = tl.where(special, 0, amax)
    return rlo, rhi, amax, special, idx1, ob1, idx2, ob2


@triton.jit
def group_macro_factors(amax, BLOCK_R: tl.constexpr, NBK: tl.constexpr, GROUP: tl.constexpr):
    """Macro factors [BR, NBK/GROUP] of the macro blocks of GROUP 32-blocks in a chunk,
    from the per-block amax bits [BR, NBK], and the same broadcast back to [BR, NBK]."""
    mg = macro_factor(as_f32(tl.max(tl.reshape(amax, (BLOCK_R, NBK // GROUP, GROUP)), axis=2)))
    m = tl.reshape(tl.broadcast_to(mg[:, :, None], (BLOCK_R, NBK // GROUP, GROUP)), (BLOCK_R, NBK))
    return mg, m


@triton.jit
def _evens_odds(t, BLOCK_R: tl.constexpr, NBK: tl.constexpr):
    """[BR, NBK, 16] -> (even words, odd words) [BR, NBK, 8]."""
    return tl.split(tl.reshape(t, (BLOCK_R, NBK, 8, 2)))


@triton.jit
def _interleave(even, odd, BLOCK_R: tl.constexpr, NBK: tl.constexpr):
    """Inverse of :func:`_evens_odds`."""
    return tl.reshape(tl.join(even, odd), (BLOCK_R, NBK, 16))


@triton.jit
def _stochastic_part(sbits, inv, rand):
    """:func:`encode_half` with stochastic rounding of scaled bits ``sbits`` [BR, NBK, 8]
    times ``inv`` (the same shape and layout) with the Philox words ``rand``."""
    a = f32_bits(tl.abs(as_f32(sbits)) * inv)
    return e2m1_code_stochastic(a, (rand >> 8).to(tl.int32)) | ((sbits >> 28) & 8), a


@triton.jit
def encode_stochastic(slo, shi, inv, seed, rows, wcol0, KW, BLOCK_R: tl.constexpr, NBK: tl.constexpr):
    """:func:`encode_half` of both halves with stochastic rounding: (code_lo, code_hi,
    a_lo, a_hi). The draws follow format.uniform_u24: element i = row * Kp + column takes
    word i % 4 of Philox at counter i // 4, so the two words 2p, 2p+1 of a row (elements
    4p .. 4p+3) share the call at counter row * Kp/4 + p: words 0 and 1 round word 2p's
    halves, words 2 and 3 word 2p+1's. The words are split into even and odd ones for it
    (in registers), so that each call is made once.

    Layouts: everything the calls meet is a split of a [BR, NBK, 16] tensor of the
    words' layout (the halves, the broadcast 2**-e), and the counters are tied to the
    even words by a term that is always 0 (``(le & 1) >> 1``, folded by LLVM after the
    layouts are chosen), so that Triton computes the calls in the words' layout instead
    of converting their results through shared memory."""
    le, lo_ = _evens_odds(slo, BLOCK_R, NBK)
    he, ho = _evens_odds(shi, BLOCK_R, NBK)
    inv_e, inv_o = _evens_odds(tl.broadcast_to(inv[:, :, None], slo.shape), BLOCK_R, NBK)
    counter = (rows[:, None, None] * (KW // 2) + wcol0 // 2 + tl.arange(0, NBK)[None, :, None] * 8
               + tl.arange(0, 8)[None, None, :]) + ((le & 1) >> 1)
    r0, r1, r2, r3 = philox4x32(seed, counter)
    c_le, a_le = _stochastic_part(le, inv_e, r0)
    c_he, a_he = _stochastic_part(he, inv_e, r1)
    c_lo, a_lo = _stochastic_part(lo_, inv_o, r2)
    c_ho, a_ho = _stochastic_part(ho, inv_o, r3)
    return (_interleave(c_le, c_lo, BLOCK_R, NBK), _interleave(c_he, c_ho, BLOCK_R, NBK),
            _interleave(a_le, a_lo, BLOCK_R, NBK), _interleave(a_he, a_ho, BLOCK_R, NBK))


TINY_BITS = tl.constexpr(9 << 23)
"""|x| below 2**-118 (exponent field < 9): the fused division may be off there."""


@triton.jit
def _divide_fused(rbits, m, rm):
    """fp32 bits of rest / m, correctly rounded, by Markstein's correction: q0 = |x| 1/m,
    r = |x| - q0 m (exact in one fma), q = q0 + r / m (one fma), sign OR-ed from x. Equal
    to the IEEE division for every |x| >= 2**-118 and every macro factor m = k/128,
    k in [128, 256], given rm = RN(1/m): checked exhaustively over all 2**23 significands
    and all m (benchmarks/NOTES-elementwise.md); below 2**-118 the remainder r can be
    subnormal and inexact."""
    x = tl.abs(as_f32(rbits))
    neg_m = tl.broadcast_to(as_f32(f32_bits(m) | F32_SIGN)[:, :, None], rbits.shape)
    rmb = tl.broadcast_to(rm[:, :, None], rbits.shape)
    q0 = x * rmb
    q = tl.fma(tl.fma(q0, neg_m, x), rmb, q0)
    return f32_bits(q) | (rbits & F32_SIGN)


@triton.jit
def scaled_halves(rlo, rhi, m, HAS_MACRO: tl.constexpr, FMA_DIV: tl.constexpr):
    """fp32 bits of the rest's halves divided by the macro factors m [BR, NBK] (as the
    reference's IEEE division), or the rest itself without macro blocks.

    With FMA_DIV, by :func:`_divide_fused` (3 operations an element instead of a
    division's ~10) unless the chunk holds a nonzero |x| < 2**-118 (then, for the whole
    chunk, ``div_rn``): one integer min an element decides, a uniform branch."""
    if HAS_MACRO:
        mb = tl.broadcast_to(m[:, :, None], rlo.shape)
        if FMA_DIV:
            least = tl.minimum(tl.min(((rlo & F32_ABS) - 1).to(tl.uint32), axis=2),
                               tl.min(((rhi & F32_ABS) - 1).to(tl.uint32), axis=2))
            if tl.min(tl.min(least, axis=1), axis=0) < TINY_BITS - 1:
                slo = f32_bits(tl.math.div_rn(as_f32(rlo), mb))
                shi = f32_bits(tl.math.div_rn(as_f32(rhi), mb))
            else:
                rm = tl.math.div_rn(tl.full(m.shape, 1.0, tl.float32), m)
                slo = _divide_fused(rlo, m, rm)
                shi = _divide_fused(rhi, m, rm)
        else:
            slo = f32_bits(tl.math.div_rn(as_f32(rlo), mb))
            shi = f32_bits(tl.math.div_rn(as_f32(rhi), mb))
        return slo, shi
    else:
        return rlo, rhi


@triton.jit
def block_exponent(amax, m, RULE: tl.constexpr, HAS_MACRO: tl.constexpr):
    """Clamped shared exponent e [BR, NBK] (int32, >= -127) of blocks whose rest has amax
    bits ``amax``; with macro blocks, of the amax divided by m (the max of the divided
    values: division by m > 0 is monotonic)."""
    if HAS_MACRO:
        amax = f32_bits(tl.math.div_rn(as_f32(amax), m))
    return tl.maximum(scale_exponent(amax, RULE), -127)


@triton.jit
def encode_half(sbits, inv, rand24, STOCHASTIC: tl.constexpr):
    """E2M1 codes (int32 0..15) of the scaled values with bits ``sbits`` [BR, NBK, 16]
    times 2**-e (``inv`` [BR, NBK]); returns (codes, bits of |y|) with y the value that
    was rounded. The sign bit of y is bit 3 of the code (code 8 for -0.0 and for negative
    values that round or underflow to 0)."""
    a = f32_bits(tl.abs(as_f32(sbits)) * inv[:, :, None])
    if STOCHASTIC:
        code = e2m1_code_stochastic(a, rand24)
    else:
        code = e2m1_code_nearest(a)
    return code | ((sbits >> 28) & 8), a


@triton.jit
def span_macro_factor(w_ptr, rows, col0, R, KW_IN, KW, stride_w, BLOCK_R: tl.constexpr, BW: tl.constexpr,
                      SPAN: tl.constexpr, NUM_CHUNKS: tl.constexpr, IN_KIND: tl.constexpr, N_OUT: tl.constexpr):
    """The macro factor [BR] of a span read in NUM_CHUNKS chunks (a first pass over the
    span, from L2 on the second read; single-chunk spans compute it from the chunk)."""
    amax = tl.zeros([BLOCK_R], tl.int32)
    for c in range(NUM_CHUNKS):
        wcol, lmask, _ = chunk_words(rows, col0, c, R, KW_IN, KW, BW, SPAN)
        w = tl.load(w_ptr + rows[:, None] * stride_w + wcol, mask=lmask, other=0)
        lo, hi = unpack_words(blocked(w, BLOCK_R, BW), IN_KIND)
        _, _, a, _, _, _, _, _ = split_blocks(lo, hi, IN_KIND, N_OUT)
        amax = tl.maximum(amax, tl.max(a, axis=1))
    return macro_factor(as_f32(amax))
