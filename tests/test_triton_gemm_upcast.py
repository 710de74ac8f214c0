"""The upcast GEMM (gemm_upcast.py), the weight layouts it reads (layouts.py), split-K
(splitk.py) in both GEMM kernels, the output dtypes, and the backends' GEMM routing.

Expected values are the reference backend's (bit for bit for the decode) or float64
products of the dequantized operands, within the fp32 accumulation bound of
test_triton_gemm.py. Without a GPU the kernels run in the Triton interpreter (its dot in
fp32: numerics.md section 5); with one, compiled, and the GPU-only tests hold the sm_90
inline-PTX decode to its pure-Triton twin.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import portable_mx as pmx
from portable_mx import ops, registry
from portable_mx.backends.reference import ReferenceBackend
from portable_mx.backends.targets import TARGETS
from portable_mx.recipe import QuantRecipe as QR
from portable_mx.tensor import MXTensor

from conftest import indexed, kernel_backends, left_stream, no_kernels_reason, values_route_spy
from test_triton_gemm import assert_accumulation_close, randn, rows_mx

REF = ReferenceBackend()
needs_kernels = pytest.mark.skipif(not kernel_backends("matmul"), reason=no_kernels_reason("matmul"))

try:  # a module global, for the jit kernel of the emulation test (a test's local is not seen)
    from portable_mx.backends.triton import upcast as upcast_kernels
except ImportError:  # no Triton: the tests that need it skip
    upcast_kernels = None
_no_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def needs_gpu(test):
    """Marks a test ``gpu`` (``pytest -m gpu`` selects it) and skips it without a GPU."""
    return pytest.mark.gpu(_no_gpu(test))


def _routes():
    from portable_mx.backends.triton.gemm_upcast import UpcastRoute
    from portable_mx.backends.triton.layouts import HOPPER_VALUES, PLAIN_VALUES

    return {"plain": UpcastRoute(PLAIN_VALUES), "hopper": UpcastRoute(HOPPER_VALUES)}


def upcast(gemm_kernel, a, b, config, route, **kw):
    """The upcast GEMM on the kernel backend's device (interpreted on the CPU)."""
    from portable_mx.backends.triton import gemm_upcast

    backend, device = gemm_kernel
    a = a.to(device)
    b = b.to(device)
    with backend.running():
        return gemm_upcast.matmul(a, b, config, backend.options(config), route, interpreted=device == "cpu", **kw)


def any_bytes(rows, k, seed):
    """An MXTensor (rows, k) whose codes and scales are every byte value at random: ±0, NaN
    scales (255), the subnormal scale 2**-127 (0), overflow to inf (254 with code 6)."""
    g = torch.Generator().manual_seed(seed)
    mx = rows_mx(randn(rows, k, seed=seed), QR())
    qdata = torch.randint(0, 256, mx.qdata.shape, dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 256, mx.scales.shape, dtype=torch.uint8, generator=g)
    scales[0, :4] = torch.tensor([0, 254, 255, 1], dtype=torch.uint8)
    return MXTensor(qdata=qdata, scales=scales, shape=mx.shape, dtype=mx.dtype, axis=1, recipe=mx.recipe)


def bitwise_equal(got, want):
    """Same values bit for bit (sign of zero included), any NaN for NaN."""
    got, want = got.float().cpu(), want.float().cpu()
    return bool(((got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())).all())


# ----------------------------------------------------------------------------- layouts


@pytest.mark.triton
@pytest.mark.parametrize("rows,k", [(1, 32), (70, 96), (256, 512), (300, 1056)])
def test_hopper_value_layout_roundtrips(rows, k):
    """swizzle then unswizzle is the identity; the storage is padded to 256 x 256 values."""
    from portable_mx.backends.triton.layouts import HOPPER_VALUES

    codes = torch.randint(0, 256, (rows, k // 2), dtype=torch.uint8, generator=torch.Generator().manual_seed(k))
    storage = HOPPER_VALUES.swizzle(codes)
    rows_p, k_p = HOPPER_VALUES.padded(rows, k)
    assert (rows_p % 256, k_p % 256) == (0, 0) and storage.numel() == rows_p * k_p // 2
    assert torch.equal(HOPPER_VALUES.unswizzle(storage, rows, k), codes)
    assert HOPPER_VALUES.row_stride(k) == k_p * 32  # bytes per 64-row block


@pytest.mark.triton
def test_hopper_value_layout_golden_word():
    """The first word of a tile holds rows 0 and 8, columns 0, 1, 8, 9 (thread 0's first
    k16 wgmma fragment) at the bits upcast.py's decode takes each pair from (pair 0 in
    place, pair 1 shifted left by 4, pair 2 rotated left by 10, pair 3 shifted left by 6
    except its two exponent-high bits, shifted right by 2), and that decode gives back the
    bf16 bits of every code (value * 2**-126: sign 15, exponent 8..7, mantissa 6)."""
    from portable_mx.backends.triton.layouts import HOPPER_VALUES

    nib = torch.zeros(64, 64, dtype=torch.uint8)
    # (row, col) -> code: pair j = 2 n3 + k3 (n3 = row // 8, k3 = col // 8), half = col % 2
    nib[0, 0], nib[0, 1], nib[0, 8], nib[0, 9] = 1, 2, 3, 4
    nib[8, 0], nib[8, 1], nib[8, 8], nib[8, 9] = 5, 6, 7, 15
    codes = nib[:, 0::2] | (nib[:, 1::2] << 4)
    word = int(HOPPER_VALUES.swizzle(codes)[:4].view(torch.int32)) & 0xFFFFFFFF
    # bit targets: mantissa 6, exponent 7 (low) and 8 (high), sign 15; +16 in the high half
    want = (1 << 6) | (1 << 23)  # pair 0, codes 1 (m) and 2 (e0): in place
    want |= (1 << 2) | (1 << 3) | (1 << 20)  # pair 1, codes 3 (m, e0) and 4 (e1): 4 bits down
    want |= (1 << 28) | (1 << 30) | (1 << 13) | (1 << 14)  # pair 2, codes 5 (m, e1), 6 (e0, e1): 10 down, wrapped
    want |= (1 << 0) | (1 << 1) | (1 << 10)  # pair 3, code 7 (m, e0 6 down; e1 2 up)
    want |= (1 << 16) | (1 << 17) | (1 << 26) | (1 << 25)  # code 15: m, e0, sign 6 down, e1 2 up
    assert word == want

    def rotl(w, r):
        return ((w << r) | (w >> (32 - r))) & 0xFFFFFFFF

    s_mask = 0x81C081C0
    pairs = [word & s_mask, (word << 4) & s_mask, rotl(word, 10) & s_mask,
             ((word << 6) & 0x80C080C0) | ((word >> 2) & 0x01000100)]

    def bf16_bits(c):
        return ((c >> 3) << 15) | ((c & 7) << 6)

    assert pairs == [bf16_bits(lo) | (bf16_bits(hi) << 16) for lo, hi in ((1, 2), (3, 4), (5, 6), (7, 15))]


def _probe_words(n_random: int, total: int, fill: int, seed: int) -> list[int]:
    """32-bit words (as unsigned ints): every byte value in every byte position, then
    ``n_random`` random words, padded with ``fill`` to ``total`` (a power of two)."""
    g = torch.Generator().manual_seed(seed)
    words = [b << (8 * t) for t in range(4) for b in range(256)]
    words += torch.randint(0, 2**32, (n_random,), dtype=torch.int64, generator=g).tolist()
    return words + [fill] * (total - len(words))


def _run_on_words(backend, device, kernel_fn, words: list[int], out_dtype: torch.dtype) -> list[list[int]]:
    """``kernel_fn[(1,)](words, out, N)`` writing 4 values a word; the outputs' 32-bit
    patterns as signed ints, 4 a word."""
    w = torch.tensor([x - 2**32 if x >= 2**31 else x for x in words], dtype=torch.int32)
    out = torch.empty(4 * w.numel(), dtype=out_dtype)
    with backend.running():
        wd, od = w.to(device), out.to(device)
        kernel_fn[(1,)](wd, od, N=w.numel())
    return od.cpu().view(torch.int32).to(torch.int64).view(-1, 4).tolist()


def _emulate_ptx(asm: str, operand: int, outputs: int = 4) -> list[int]:
    """Run an inline-asm block of 32-bit integer PTX (and, or, shl, shr, shf.l.wrap, prmt,
    mad.lo, mov) on one input register ``$<outputs>``; the outputs $0..$<outputs - 1>.
    Enough to hold the sm_90 decode's texts to their twins on a CPU (the GPU tests run the
    real thing)."""
    regs = {f"${outputs}": operand & 0xFFFFFFFF}
    mask = 0xFFFFFFFF

    def val(tok):
        tok = tok.strip()
        return regs[tok] if tok in regs else int(tok, 0) & mask

    for line in asm.split(";"):
        line = line.strip()
        if not line or line.startswith((".reg", "{", "}")):
            continue
        op, args = line.split(None, 1)
        a = [x.strip() for x in args.split(",")]
        if op == "and.b32":
            regs[a[0]] = val(a[1]) & val(a[2])
        elif op == "or.b32":
            regs[a[0]] = val(a[1]) | val(a[2])
        elif op == "shl.b32":
            regs[a[0]] = (val(a[1]) << val(a[2])) & mask
        elif op == "shr.b32":
            regs[a[0]] = val(a[1]) >> val(a[2])
        elif op == "shf.l.wrap.b32":  # upper 32 bits of {b, a} << (c mod 32)
            lo, hi, n = val(a[1]), val(a[2]), val(a[3]) % 32
            regs[a[0]] = (((hi << 32) | lo) << n >> 32) & mask
        elif op == "mov.b32":
            regs[a[0]] = val(a[1])
        elif op == "mad.lo.u32":
            regs[a[0]] = (val(a[1]) * val(a[2]) + val(a[3])) & mask
        elif op == "prmt.b32":  # default mode: byte i of d is byte sel_i & 7 of {b, a}, sel_i & 8 its sign
            src, sel, out = (val(a[2]) << 32) | val(a[1]), val(a[3]), 0
            for i in range(4):
                nib = (sel >> (4 * i)) & 15
                byte = (src >> (8 * (nib & 7))) & 0xFF
                out |= ((0xFF if byte & 0x80 else 0) if nib & 8 else byte) << (8 * i)
            regs[a[0]] = out
        else:
            raise AssertionError(f"no emulation of {op}")
    return [regs[f"${i}"] for i in range(outputs)]


@pytest.mark.triton
def test_folded_scale_asm_equals_its_twin_by_emulation(kernel):
    """The inline PTX that makes the folded decode's per-block factors from a scale word
    (upcast._SCALE_PAIRS: a mask, a byte permute and two multiply-adds), emulated on the
    CPU, gives the factors of the pure-Triton twin (upcast.folded_scales_of_words, run by
    the backend here, fp32) for every byte value in every byte position and 2048 random
    words; and, for bytes <= 128, 2**(s - 1) (the folded scale's definition)."""
    import triton
    import triton.language as tl

    backend, device = kernel

    @triton.jit
    def scales_kernel(w_ptr, out_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        w = tl.load(w_ptr + i)[:, None]
        f = upcast_kernels.folded_scales_of_words(w, tl.float32, N, 4)
        tl.store(out_ptr + 4 * i[:, None] + tl.arange(0, 4)[None, :], f)

    words = _probe_words(2048, 4096, 0x80808080, seed=6)
    twin = _run_on_words(backend, device, scales_kernel, words, torch.float32)
    for x, want in zip(words, twin):
        t, u = _emulate_ptx(upcast_kernels._SCALE_PAIRS.value, x, outputs=2)
        got = [(t & 0xFFFF) << 16, (u & 0xFFFF) << 16, (t >> 16) << 16, (u >> 16) << 16]  # bytes 0, 1, 2, 3
        assert [v - 2**32 if v >= 2**31 else v for v in got] == want, hex(x)
        for k in range(4):
            b = (x >> (8 * k)) & 0xFF
            if b <= 128:
                assert torch.tensor(got[k]).to(torch.int32).view(torch.float32).item() == 2.0 ** (b - 1)


@pytest.mark.triton
def test_sm90_decode_asm_equals_its_twin_by_emulation(kernel):
    """The inline PTX of the sm_90 decode (upcast._PAIRS, the integer part of hopper_asm),
    emulated on the CPU, gives the same four bf16x2 pairs as the pure-Triton twin
    (upcast._hopper_pair, run by the backend here) for every byte value in every byte
    position and 4096 random words: the asm cannot drift from the twin the tests hold to
    the reference (on an sm_90 GPU the compiled asm itself is compared too)."""
    import triton
    import triton.language as tl

    backend, device = kernel

    @triton.jit
    def pairs_kernel(w_ptr, out_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        w = tl.load(w_ptr + i)
        tl.store(out_ptr + 4 * i, upcast_kernels._hopper_pair(w, 0))
        tl.store(out_ptr + 4 * i + 1, upcast_kernels._hopper_pair(w, 1))
        tl.store(out_ptr + 4 * i + 2, upcast_kernels._hopper_pair(w, 2))
        tl.store(out_ptr + 4 * i + 3, upcast_kernels._hopper_pair(w, 3))

    words = _probe_words(4096, 8192, 0xFFFFFFFF, seed=5)
    twin = [[v & 0xFFFFFFFF for v in row] for row in _run_on_words(backend, device, pairs_kernel, words, torch.int32)]
    for x, want in zip(words, twin):
        assert _emulate_ptx(upcast_kernels._PAIRS, x) == want, hex(x)


@pytest.mark.triton
def test_hopper_scale_layout():
    """Round trip, padding, and rows r and r + 8 of a K block side by side."""
    from portable_mx.backends.triton.layouts import HOPPER

    for rows, cols in ((1, 1), (130, 9), (256, 16), (70, 33)):
        s = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=torch.Generator().manual_seed(rows))
        flat = HOPPER.swizzle(s)
        assert flat.numel() == (-(-rows // 256) * 256) * (-(-cols // 8) * 8)
        assert torch.equal(HOPPER.unswizzle(flat, rows, cols), s)
    r, c = torch.tensor([[0], [8], [1], [16], [64]]), torch.tensor([[0, 1, 8]])
    assert torch.equal(HOPPER.offsets(r, c, 16), torch.tensor([[0, 2, 512], [1, 3, 513], [16, 18, 528],
                                                                [128, 130, 640], [1024, 1026, 1536]]))


@needs_kernels
@pytest.mark.parametrize("layout", ["hopper-values", "hopper", "blackwell", "cdna4"])
@pytest.mark.parametrize("rows,k", [(1, 32), (70, 96), (256, 512), (300, 1056)])
def test_swizzle_kernels_equal_the_torch_twins(gemm_kernel, layout, rows, k):
    """layouts.swizzle_kernel (what prepared() runs on a GPU or the interpreter: one or two
    launches) writes the torch swizzle's storage bit for bit, padding included, from a
    row-strided view too."""
    from portable_mx.backends.triton import layouts as L

    _, device = gemm_kernel
    lay = L.HOPPER_VALUES if layout == "hopper-values" else L.LAYOUTS[layout]
    cols = k // 2 if lay is L.HOPPER_VALUES else k // 32
    g = torch.Generator().manual_seed(rows + k)
    wide = torch.randint(0, 256, (rows, cols + 8), dtype=torch.uint8, generator=g)
    for plain in (wide[:, :cols].contiguous(), wide[:, :cols]):
        got = L.swizzle_kernel(plain.to(device), lay).cpu()
        assert torch.equal(got, lay.swizzle(plain))


@needs_kernels
def test_prepared_swizzles_with_the_kernels(gemm_kernel, monkeypatch):
    """A weight's hopper layouts are made by the swizzle kernels, not by the torch twins
    (about 100 elementwise kernels per weight: 4 ms for 8192 x 8192 on an H200, paid on
    every forward where the weight is quantized per call)."""
    from portable_mx.backends.triton import layouts as L

    _, device = gemm_kernel
    mx = any_bytes(256, 512, seed=5)
    want = (L.HOPPER_VALUES.swizzle(mx.qdata), L.HOPPER.swizzle(mx.scales))

    def refuse(*args, **kwargs):
        raise AssertionError("the torch swizzle ran")

    monkeypatch.setattr(L.HopperValues, "swizzle", refuse)
    monkeypatch.setattr(L.ScaleLayout, "swizzle", refuse)
    got = (L.prepared(mx.qdata.to(device), L.HOPPER_VALUES), L.prepared(mx.scales.to(device), L.HOPPER))
    assert all(torch.equal(a.cpu(), b) for a, b in zip(got, want))


# ----------------------------------------------------------------------------- decode


@needs_kernels
@pytest.mark.parametrize("layout", ["plain", "hopper"])
def test_decoded_tiles_equal_the_reference_bit_for_bit(gemm_kernel, layout):
    """Every code and scale byte (NaN, 2**-127, overflow, ±0): the GEMM's weight tiles
    decode to the reference's values exactly (fp32 dot dtype; bf16 on a GPU too)."""
    from portable_mx.backends.triton.gemm_upcast import decode_tiles

    backend, device = gemm_kernel
    b = any_bytes(130, 512, seed=4)
    want = REF.dequantize(b)
    for block_n, block_k in ((64, 64), (128, 256)):
        with backend.running():
            got = decode_tiles(b.to(device), block_n, block_k, _routes()[layout], "fp32")
            assert bitwise_equal(got, want)
            if device != "cpu":
                assert bitwise_equal(decode_tiles(b.to(device), block_n, block_k, _routes()[layout], "bf16"), want)


def small_scale_bytes(rows, k, seed):
    """An MXTensor (rows, k) of random codes (every one) and scale bytes 0..128 (0, 127 and
    128 included): the weights the folded decode takes (upcast.folded_scale)."""
    b = any_bytes(rows, k, seed)
    g = torch.Generator().manual_seed(seed + 1)
    scales = torch.randint(0, 129, b.scales.shape, dtype=torch.uint8, generator=g)
    scales[0, :3] = torch.tensor([0, 127, 128], dtype=torch.uint8)
    return MXTensor(qdata=b.qdata, scales=scales, shape=b.shape, dtype=b.dtype, axis=1, recipe=b.recipe)


@needs_kernels
def test_folded_decode_is_exact_for_scale_bytes_up_to_128(gemm_kernel):
    """Scale bytes <= 128: the one-multiply decode (the default, picked on the device from
    the largest byte) gives the reference's values bit for bit, as the two-multiply decode
    (forced by a largest byte of 255) does; a byte above 128 with the folded decode forced
    (largest 0) would overflow: the choice matters, and the weight's own largest byte
    makes it (any_bytes: the exact decode, test above)."""
    from portable_mx.backends.triton.gemm_upcast import decode_tiles
    from portable_mx.backends.triton.layouts import largest_scale

    backend, device = gemm_kernel
    route = _routes()["hopper"]
    dots = ("fp32",) if device == "cpu" else ("fp32", "bf16")
    b = small_scale_bytes(130, 512, seed=6).to(device)
    assert int(largest_scale(b.scales)) == 128
    want = REF.dequantize(b.to("cpu"))
    force_exact = torch.full((1,), 255, dtype=torch.uint8, device=device)
    force_fold = torch.zeros(1, dtype=torch.uint8, device=device)
    with backend.running():
        for dot in dots:
            for block_n, block_k in ((64, 64), (128, 256)):
                assert bitwise_equal(decode_tiles(b, block_n, block_k, route, dot), want)
                assert bitwise_equal(decode_tiles(b, block_n, block_k, route, dot, largest=force_exact), want)
        big = any_bytes(130, 512, seed=4).to(device)
        assert int(largest_scale(big.scales)) == 255
        assert not bitwise_equal(decode_tiles(big, 64, 64, route, "fp32", largest=force_fold), REF.dequantize(big.to("cpu")))


@needs_kernels
def test_largest_scale_follows_in_place_writes(gemm_kernel):
    """The kept largest scale byte (and swizzled copies) of a weight are redone after an
    in-place write of its scales: a byte raised above 128 after a first GEMM switches the
    next one to the exact decode, and its result stays the dequantized product."""
    from portable_mx.backends.triton.launch import GemmConfig
    from portable_mx.backends.triton.layouts import largest_scale

    backend, device = gemm_kernel
    b = rows_mx(randn(64, 128, seed=31, scale=0.5), QR()).to(device)
    a = randn(1, 128, seed=32).to(torch.bfloat16)
    config = GemmConfig(16, 64, 64, split_k=1)
    assert int(largest_scale(b.scales)) <= 128
    assert_accumulation_close(upcast(gemm_kernel, a, b, config, _routes()["hopper"]), a, b, 128)
    b.scales[3, 1] = 140  # in place: a block now scaled by 2**13
    assert int(largest_scale(b.scales)) == 140
    assert_accumulation_close(upcast(gemm_kernel, a, b, config, _routes()["hopper"]), a, b, 128)


@needs_kernels
@pytest.mark.parametrize("magnitude", [0.5, 3000.0], ids=["folded", "scales-above-128"])
def test_small_m_gemm_on_both_decodes(gemm_kernel, magnitude):
    """A decode-sized GEMM (token tile 16: the kernel carries both decodes) on the hopper
    layout, W4A16 and A4W4, with split-K: weights whose scale bytes all lie at or below 128
    (the folded decode) and weights with larger ones (|w| ~ 3000: bytes ~136, the exact
    decode) both equal the dequantized product within the accumulation bound."""
    from portable_mx.backends.triton.launch import GemmConfig
    from portable_mx.backends.triton.layouts import largest_scale

    for i, (m, n, k) in enumerate(SHAPES):
        b = rows_mx(randn(n, k, seed=200 + i, scale=magnitude), QR())
        assert (int(largest_scale(b.scales)) <= 128) == (magnitude < 1)
        for a in (randn(m, k, seed=i).to(torch.bfloat16), rows_mx(randn(m, k, seed=i), QR())):
            config = GemmConfig(16, 64, 64, split_k=2)
            assert_accumulation_close(upcast(gemm_kernel, a, b, config, _routes()["hopper"]), a, b, k)


@needs_kernels
@pytest.mark.parametrize("layout", ["plain", "hopper"])
@pytest.mark.parametrize("rb", [QR(outliers_per_block=1), QR(outliers_per_block=2),
                                QR(outliers_per_block=2, macro_block=64)], ids=lambda r: r.describe())
def test_w4a16_sparse_outliers_at_decode(gemm_kernel, layout, rb):
    """W4A16 with M <= 4 tokens takes the weight's outliers as a sparse correction (the
    x values at their columns): M = 1..4 (SPARSE_M 1, 2, 4 with masked rows), K off the
    block (an outlier column past K reads nothing), bf16 tokens, split-K, MBS; within the
    accumulation bound of the dequantized product, as the dense path is. fp16 tokens take
    the dense outlier tile (its two bf16 MMAs; the sparse form serialized sm_90's wgmmas)."""
    from portable_mx.backends.triton.gemm_upcast import sparse_rows
    from portable_mx.backends.triton.gemm import Operand
    from portable_mx.backends.triton.launch import GemmConfig

    assert [sparse_rows(Operand(torch.bfloat16, None, 0), Operand(None, None, 2), m) for m in (1, 2, 3, 4, 5)] == \
        [1, 2, 4, 4, 0]
    assert sparse_rows(Operand(torch.float16, None, 0), Operand(None, None, 2), 1) == 0
    for i, (m, n, k, dtype) in enumerate([(1, 70, 250, torch.bfloat16), (2, 64, 256, torch.float16),
                                          (3, 130, 300, torch.bfloat16), (4, 65, 96, torch.bfloat16)]):
        a = randn(m, k, seed=i).to(dtype)
        b = rows_mx(randn(n, k, seed=300 + i, scale=3.0), rb)
        config = GemmConfig(16, 64, 64, split_k=1 + i % 2)
        assert_accumulation_close(upcast(gemm_kernel, a, b, config, _routes()[layout]), a, b, k)


@needs_gpu
def test_inline_ptx_decode_equals_its_twin_on_sm90():
    """sm_90: the inline-PTX word decode gives the pure-Triton twin's bits."""
    from portable_mx.backends.targets import probe
    from portable_mx.backends.triton.gemm_upcast import UpcastRoute, decode_tiles
    from portable_mx.backends.triton.layouts import HOPPER_VALUES

    target, why = probe("cuda")
    if target is None or target.name != "sm_90":
        pytest.skip(f"needs sm_90 ({why or target.name})")
    b = any_bytes(256, 1024, seed=5).to("cuda")
    for block_n, block_k, warps in ((64, 64, 4), (128, 128, 4), (256, 128, 8)):
        options = {"num_warps": warps}
        asm = decode_tiles(b, block_n, block_k, UpcastRoute(HOPPER_VALUES, asm=True), "bf16", options)
        twin = decode_tiles(b, block_n, block_k, UpcastRoute(HOPPER_VALUES, asm=False), "bf16", options)
        assert torch.equal(asm.view(torch.int16), twin.view(torch.int16))
        assert bitwise_equal(asm, REF.dequantize(b.to("cpu")))
    small = small_scale_bytes(256, 1024, seed=7).to("cuda")  # the folded decode (no bias multiply)
    for block_n, block_k, warps in ((64, 64, 4), (128, 128, 4)):
        options = {"num_warps": warps}
        asm = decode_tiles(small, block_n, block_k, UpcastRoute(HOPPER_VALUES, asm=True), "bf16", options)
        twin = decode_tiles(small, block_n, block_k, UpcastRoute(HOPPER_VALUES, asm=False), "bf16", options)
        assert torch.equal(asm.view(torch.int16), twin.view(torch.int16))
        assert bitwise_equal(asm, REF.dequantize(small.to("cpu")))


# ----------------------------------------------------------------------------- the GEMM

# M, N, K off every tile (K not a multiple of 32 in two), one or many K tiles
SHAPES = [(1, 7, 70), (17, 65, 300), (33, 130, 250)]


@needs_kernels
@pytest.mark.parametrize("layout", ["plain", "hopper"])
@pytest.mark.parametrize("pair", [
    (QR(), QR()),
    (QR(macro_block=64), QR(macro_block=128)),
    (QR(macro_block=4096), QR(macro_block=4096)),
    (QR(outliers_per_block=1), QR(outliers_per_block=2)),
    (QR(outliers_per_block=2, macro_block=64), QR(macro_block=128, outliers_per_block=1)),
    (QR(outliers_per_block=1), QR(macro_block=64)),
], ids=lambda p: f"{p[0].describe()}x{p[1].describe()}")
def test_a4w4_equals_dequantized_product(gemm_kernel, layout, pair):
    """Both operands decoded in registers (exact), with MBS promotion, MBS in the
    epilogue, outliers folded into their tile or as correction dots, split-K."""
    from portable_mx.backends.triton.launch import GemmConfig

    ra, rb = pair
    for i, (m, n, k) in enumerate(SHAPES):
        a = rows_mx(randn(m, k, seed=i), ra)
        b = rows_mx(randn(n, k, seed=100 + i, scale=3.0), rb)
        config = GemmConfig(16, 64, 128, split_k=1 + i)
        assert_accumulation_close(upcast(gemm_kernel, a, b, config, _routes()[layout]), a, b, k)


@needs_kernels
@pytest.mark.parametrize("layout", ["plain", "hopper"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rb", [QR(), QR(macro_block=128), QR(outliers_per_block=2),
                                QR(outliers_per_block=1, macro_block=64)], ids=lambda r: r.describe())
def test_w4a16_equals_dequantized_product(gemm_kernel, layout, dtype, rb):
    """bf16 and fp16 activations (the fp16 dot decodes the weight to fp16; in the
    interpreter both the fp32 and the fp16 dot are checked), weight MBS and OF, split-K."""
    from portable_mx.backends.triton.launch import GemmConfig

    backend, device = gemm_kernel
    for i, (m, n, k) in enumerate(SHAPES):
        a = randn(m, k, seed=i).to(dtype)
        b = rows_mx(randn(n, k, seed=100 + i, scale=3.0), rb)
        config = GemmConfig(16, 64, 64, split_k=3 - i)
        assert_accumulation_close(upcast(gemm_kernel, a, b, config, _routes()[layout]), a, b, k)
        if device == "cpu" and dtype == torch.float16 and i == 1:
            assert_accumulation_close(upcast(gemm_kernel, a, b, config, _routes()[layout], dot="fp16"), a, b, k)


@needs_kernels
def test_split_k_is_deterministic_and_leaves_counters_at_zero(gemm_kernel):
    """Several split counts, including more splits than K tiles (empty splits), give
    results within the bound, the same bits on a second call, and counters back at 0."""
    from portable_mx.backends.triton import splitk
    from portable_mx.backends.triton.launch import GemmConfig

    backend, device = gemm_kernel
    a = randn(5, 1000, seed=1).bfloat16()
    b = rows_mx(randn(70, 1000, seed=2), QR())
    for split in (2, 5, 8, 12):
        config = GemmConfig(16, 64, 128, split_k=split)
        got = upcast(gemm_kernel, a, b, config, _routes()["hopper"])
        assert_accumulation_close(got, a, b, 1000)
        assert torch.equal(got, upcast(gemm_kernel, a, b, config, _routes()["hopper"]))
        assert int(splitk.counters(device).abs().sum()) == 0


@needs_kernels
def test_output_dtypes(gemm_kernel):
    """fp32, bf16 and fp16 outputs: the fp32 result rounded to nearest (the kernel's store
    on a GPU, the host cast in the interpreter, whose casts truncate)."""
    from portable_mx.backends.triton.launch import GemmConfig

    backend, device = gemm_kernel
    a = rows_mx(randn(17, 300, seed=3), QR())
    b = rows_mx(randn(65, 300, seed=4), QR())
    for config in (GemmConfig(16, 64, 128), GemmConfig(16, 64, 128, split_k=2)):
        with backend.running():
            full = backend.run_gemm(a.to(device), b.to(device), config, backend.target(b.to(device).device))
        assert_accumulation_close(full, a, b, 300)
        for dtype in (torch.bfloat16, torch.float16):
            with backend.running():
                got = backend.run_gemm(a.to(device), b.to(device), config, backend.target(b.to(device).device), dtype)
            assert got.dtype == dtype and torch.equal(got.cpu(), full.cpu().to(dtype))


@needs_kernels
def test_scaled_kernel_split_k(gemm_kernel):
    """The tl.dot_scaled kernel (native targets' decode path) with split-K: A4W4 with MBS
    and OF, W4A16."""
    from portable_mx.backends.triton import gemm, splitk
    from portable_mx.backends.triton.launch import GemmConfig

    backend, device = gemm_kernel
    for ra, rb in ((QR(), QR()), (QR(outliers_per_block=1, macro_block=64), QR(macro_block=128))):
        a = rows_mx(randn(3, 500, seed=5), ra)
        b = rows_mx(randn(40, 500, seed=6), rb)
        config = GemmConfig(16, 32, 64, split_k=3)
        with backend.running():
            got = gemm.matmul(a.to(device), b.to(device), config, backend.options(config))
        assert_accumulation_close(got, a, b, 500)
    x = randn(3, 500, seed=7).bfloat16()
    with backend.running():
        got = gemm.matmul(x.to(device), b.to(device), config, backend.options(config))
    assert_accumulation_close(got, x, b, 500)
    assert int(splitk.counters(device).abs().sum()) == 0


@needs_kernels
def test_public_matmul_through_the_upcast_route(gemm_kernel, monkeypatch):
    """pmx.matmul with the backend routed to the upcast kernel (as on sm_90 and gfx942)
    and a split-K decode config: W4A16 and A4W4, a prequantized weight."""
    from portable_mx.backends.triton.backend import GemmRoute
    from portable_mx.backends.triton.launch import GemmConfig

    backend, device = gemm_kernel
    monkeypatch.setenv(registry.ENV_BACKEND, backend.name)
    monkeypatch.setattr(backend, "_devices", {})  # no plan made by another test with another route
    monkeypatch.setattr(type(backend), "gemm_route",
                        lambda self, target, a, b: GemmRoute("upcast", upcast=_routes()["hopper"]))
    monkeypatch.setattr(type(backend), "default_gemm_config",
                        lambda self, target, m, a_format, heavy, **_: GemmConfig(16, 64, 128, split_k=2))
    x, w = randn(2, 9, 100, seed=3), randn(100, 70, seed=4)
    for recipe in (QR(), QR(activations="bf16")):
        w_mx = pmx.quantize(w.to(device), recipe, axis=0)
        out = pmx.matmul(x.to(device), w_mx, recipe)
        plans = backend._devices[torch.device(w_mx.device)].gemm_plans.values()
        assert {p.launch.kernel for p in plans} == {"gemm-upcast"}
        with monkeypatch.context() as cpu:  # the exact operands, on the CPU by the reference
            cpu.setenv(registry.ENV_BACKEND, "reference")
            left = ops.left_operand(x.reshape(-1, 100), recipe)
        left = left if isinstance(left, torch.Tensor) else ops._mx_rows(left)
        assert_accumulation_close(out.reshape(-1, 70), left, ops._mx_rows(w_mx.to("cpu")), 100)


# ----------------------------------------------------------------------------- split-K buffers and streams


def _split_k_matmuls(backend, device, monkeypatch, split: int = 3):
    """pmx.matmul on ``backend`` with every default config split ``split`` ways (no plan
    of another test, no tuned config): W4A16 x [5, 300] @ a weight [300, 70]."""
    from portable_mx.backends.triton import splitk
    from portable_mx.backends.triton.launch import GemmConfig

    monkeypatch.setenv(registry.ENV_BACKEND, backend.name)
    monkeypatch.setattr(backend, "_devices", {})
    monkeypatch.setattr(splitk, "_BUFFERS", {})
    monkeypatch.setattr(type(backend), "default_gemm_config",
                        lambda self, target, m, a_format, heavy, **_: GemmConfig(16, 64, 64, split_k=split))
    recipe = QR(activations="bf16")
    w_mx = pmx.quantize(randn(300, 70, seed=11).to(device), recipe, axis=0)
    return recipe, w_mx


@needs_kernels
def test_split_k_buffers_belong_to_the_launch_stream_not_the_plan(gemm_kernel, monkeypatch, tmp_path):
    """One plan launched on two streams uses each stream's workspace and counters (one
    shared pair would mix the partial sums and arrival counts of launches that run at the
    same time: a wrong result, silently); a launch while its stream is captured into a
    CUDA graph gets new buffers, counters zero, and keeps none. The streams and the
    capture are simulated (splitk's stream key and capture test patched); real ones are
    the GPU tests below."""
    from portable_mx.backends.triton import splitk

    backend, device = gemm_kernel
    monkeypatch.setenv("PORTABLE_MX_CACHE_DIR", str(tmp_path))
    recipe, w_mx = _split_k_matmuls(backend, device, monkeypatch)
    stream, capturing, got = ["A"], [False], []
    monkeypatch.setattr(splitk, "_STREAMED", {indexed(device): True})
    monkeypatch.setattr(splitk, "_stream", lambda dev: ((dev, stream[0]), capturing[0]))
    real_buffers = splitk.buffers

    def spy(dev, part_elems, tiles):
        pair = real_buffers(dev, part_elems, tiles)
        assert pair[0].numel() >= part_elems and pair[1].numel() >= tiles
        got.append(pair)
        return pair

    monkeypatch.setattr(splitk, "buffers", spy)
    x = randn(5, 300, seed=12).to(device)
    outs = []
    for name, capture in (("A", False), ("B", False), ("A", False), ("B", True), ("B", True)):
        stream[0], capturing[0] = name, capture
        outs.append(pmx.matmul(x, w_mx, recipe))
    (pa, ca), (pb, cb), (pa2, ca2), (pg1, cg1), (pg2, cg2) = got
    assert len(backend._devices[indexed(device)].gemm_plans) == 1  # one plan, five launches
    assert pa is pa2 and ca is ca2  # a stream keeps its own
    ptrs = {t.data_ptr() for t in (pa, pb, pg1, pg2)}
    assert len(ptrs) == 4 and len({t.data_ptr() for t in (ca, cb, cg1, cg2)}) == 4
    kept = {id(t) for entry in splitk._BUFFERS.values() for t in entry[0]}
    assert len(splitk._BUFFERS) == 2 and not kept & {id(pg1), id(cg1), id(pg2), id(cg2)}
    for counts in (ca, cb, cg1, cg2):
        assert int(counts.abs().sum()) == 0
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    with monkeypatch.context() as cpu:  # the exact operands, on the CPU by the reference
        cpu.setenv(registry.ENV_BACKEND, "reference")
        left = ops.left_operand(x.cpu(), recipe)
    assert_accumulation_close(outs[0], left, ops._mx_rows(w_mx.to("cpu")), 300)


@pytest.mark.triton
def test_split_k_buffers_grow_per_stream_and_keep_a_bounded_number_of_streams(monkeypatch):
    """A stream's buffers grow to the largest launch and are then reused; beyond
    ``_MAX_KEPT`` streams the oldest entry goes (its memory is reused in its stream's
    order, as a grown buffer's)."""
    from portable_mx.backends.triton import splitk

    cpu, stream = torch.device("cpu"), ["A"]
    monkeypatch.setattr(splitk, "_BUFFERS", {})
    monkeypatch.setattr(splitk, "_MAX_KEPT", 2)
    monkeypatch.setattr(splitk, "_STREAMED", {cpu: True})
    monkeypatch.setattr(splitk, "_stream", lambda dev: ((dev, stream[0]), False))
    first = splitk.buffers(cpu, 10, 3)
    assert first[0].numel() >= 10 and first[1].numel() >= 3 and int(first[1].abs().sum()) == 0
    assert all(x is y for x, y in zip(splitk.buffers(cpu, 10, 3), first))
    grown = splitk.buffers(cpu, 1 << 20, 5000)
    assert grown[0].numel() >= 1 << 20 and grown[1].numel() >= 5000 and int(grown[1].abs().sum()) == 0
    assert all(x is y for x, y in zip(splitk.buffers(cpu, 10, 3), grown))
    for name in "BAC":
        stream[0] = name
        splitk.buffers(cpu, 10, 3)
    assert list(splitk._BUFFERS) == [(cpu, "B"), (cpu, "C")]

def _gpu_split_k(monkeypatch, tmp_path):
    """(backend, device, recipe, weight [4096, 4096] MXFP4, two bf16 inputs [16, 4096],
    their products from one stream) on the current GPU, every GEMM split 8 ways."""
    device = torch.device("cuda", torch.cuda.current_device())
    names = [name for name, where in kernel_backends("matmul") if where == "cuda"]
    if not names:
        pytest.skip(no_kernels_reason("matmul"))
    backend = registry.get(names[0])
    monkeypatch.setenv("PORTABLE_MX_CACHE_DIR", str(tmp_path))
    recipe, _ = _split_k_matmuls(backend, device, monkeypatch, split=8)
    w_mx = pmx.quantize(randn(4096, 4096, seed=21).to(device), recipe, axis=0)
    xs = [randn(16, 4096, seed=22 + i).bfloat16().to(device) for i in range(2)]
    want = [pmx.matmul(x, w_mx, recipe) for x in xs]
    plans = backend._devices[device].gemm_plans.values()
    assert plans and all(p.split is not None for p in plans)
    return backend, device, recipe, w_mx, xs, want


@needs_gpu
def test_gpu_split_k_launches_on_two_streams_at_once(monkeypatch, tmp_path):
    """Split-K GEMMs queued on two streams behind a sleep, so that they run at the same
    time, give the bits of the same GEMMs run one after another (each stream has its own
    workspace and counters)."""
    backend, device, recipe, w_mx, xs, want = _gpu_split_k(monkeypatch, tmp_path)
    streams = [torch.cuda.Stream(device), torch.cuda.Stream(device)]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(s):
            torch.cuda._sleep(100_000_000)  # ~50 ms: the launches below queue up behind it
    outs: list = [[], []]
    for _ in range(64):
        for i, s in enumerate(streams):
            with torch.cuda.stream(s):
                outs[i].append(pmx.matmul(xs[i], w_mx, recipe))
    torch.cuda.synchronize(device)
    for i in range(2):
        bad = sum(not torch.equal(o, want[i]) for o in outs[i])
        assert bad == 0, f"stream {i}: {bad} of {len(outs[i])} results differ from the serial ones"


@needs_gpu
def test_gpu_a_captured_split_k_launch_survives_the_kept_buffers_changing(monkeypatch, tmp_path):
    """A split-K GEMM captured in a CUDA graph uses buffers of its own: it replays
    correctly after the buffers kept for eager launches grew (a larger split-K launch),
    the plans were dropped, and every buffer kept before or after the capture was
    overwritten (NaN partials, counters at 7); eager launches are correct again once
    their counters are zero."""
    from portable_mx.backends.triton import splitk

    backend, device, recipe, w_mx, xs, want = _gpu_split_k(monkeypatch, tmp_path)
    x = xs[0].clone()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm up off the default stream, as torch.cuda.graph asks
        pmx.matmul(x, w_mx, recipe)
    torch.cuda.current_stream(device).wait_stream(side)
    kept = [entry[0] for entry in splitk._BUFFERS.values()]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = pmx.matmul(x, w_mx, recipe)
    pmx.matmul(randn(512, 4096, seed=30).bfloat16().to(device), w_mx, recipe)  # grows the kept buffers
    backend._devices[device].gemm_plans.clear()
    kept += [entry[0] for entry in splitk._BUFFERS.values()]
    for part, counts in kept:
        part.fill_(float("nan"))
        counts.fill_(7)
    for i in (1, 0, 1):
        x.copy_(xs[i])
        graph.replay()
        torch.cuda.synchronize(device)
        assert torch.equal(y, want[i])
    for _, counts in kept:
        counts.zero_()
    for i in (0, 1):
        assert torch.equal(pmx.matmul(xs[i], w_mx, recipe), want[i])

# ----------------------------------------------------------------------------- routing


@pytest.mark.triton
def test_routes_and_default_configs():
    """sm_90: the upcast kernel on the hopper layout with the inline-PTX decode; gfx942:
    the upcast kernel on the plain layout (no tl.dot_scaled there with Triton 3.6); native
    targets: tl.dot_scaled with their scale swizzle. Small M splits K, prefill does not."""
    from portable_mx.backends.triton.gemm import Operand
    from portable_mx.backends.triton.layouts import HOPPER_VALUES, PLAIN_VALUES

    cuda, rocm = registry.get("cuda"), registry.get("rocm")
    mx, bf16, heavy = Operand(None, None, 0), Operand(torch.bfloat16, None, 0), Operand(None, 128, 2)
    r = cuda.gemm_route(TARGETS["sm_90"], bf16, mx)
    assert r.kernel == "upcast" and r.upcast.values is HOPPER_VALUES and r.upcast.asm
    assert cuda.gemm_route(TARGETS["sm_90"], mx, heavy).kernel == "upcast"
    for a, b in ((mx, mx), (bf16, heavy), (heavy, heavy)):
        r = rocm.gemm_route(TARGETS["gfx942"], a, b)
        assert r.kernel == "upcast" and r.upcast.values is PLAIN_VALUES and not r.upcast.asm
    assert cuda.gemm_route(TARGETS["sm_100"], mx, mx).scales.name == "blackwell"
    assert rocm.gemm_route(TARGETS["gfx950"], bf16, heavy).scales.name == "cdna4"
    for backend, target in ((cuda, "sm_90"), (cuda, "sm_100"), (rocm, "gfx942")):
        t = TARGETS[target]
        decode = backend.resolve_split_k(backend.default_gemm_config(t, 1, torch.bfloat16, False), 1, 8192, 8192,
                                         backend.gemm_sms[target])
        prefill = backend.resolve_split_k(backend.default_gemm_config(t, 4096, torch.bfloat16, False), 4096, 8192,
                                          8192, backend.gemm_sms[target])
        assert decode.split_k > 1 and prefill.split_k == 1
        ctas = -(-8192 // decode.block_n) * decode.split_k
        assert backend.gemm_sms[target] <= ctas <= 2 * backend.gemm_sms[target]


@pytest.mark.triton
def test_fp16_tokens_with_weight_outliers_take_the_pair_tiles_above_decode():
    """fp16 tokens times a weight's outliers run two more MMAs a K step (numerics.bf16_pair):
    on AMD, whose prefill tiles spilled with them, the "-pair" tile is taken above the
    decode class (M > 16), and only for that operand pair; the compile matrix compiles the
    operand kind at every M class (it spilled nowhere there since)."""
    from portable_mx.backends.triton.backend import _aot_gemms
    from portable_mx.backends.triton.gemm import Operand
    from portable_mx.tuning import search

    rocm = registry.get("rocm")
    f16, bf16, of2, mbs = (Operand(torch.float16, None, 0), Operand(torch.bfloat16, None, 0),
                           Operand(None, None, 2), Operand(None, 128, 0))
    assert f16.pairs_with(of2) and not f16.pairs_with(mbs) and not bf16.pairs_with(of2)
    assert not Operand(torch.float16, None, 0, 1).pairs_with(of2)  # (tokens the kernel quantizes: bf16 values)
    for name in ("gfx942", "gfx950"):
        t = TARGETS[name]
        pair = rocm.gemm_tiles[name]["w4a16-pair"]
        for m in (17, 128, 4096):
            assert rocm.default_gemm_config(t, m, torch.float16, True, pair=f16.pairs_with(of2)) == pair
            assert rocm.default_gemm_config(t, m, torch.bfloat16, True, pair=bf16.pairs_with(of2)) != pair
        assert rocm.default_gemm_config(t, 1, torch.float16, True, pair=True) == rocm.gemm_tiles[name]["w4a16-small"]
        # the grouped GEMM's config (gpt-oss's 32 experts at prefill: its own "-pair" tile
        # where it has one) and the tuner's default
        g = rocm.grouped_config(t, 4096 * 4, 32, torch.float16, True, pair=True)
        gp = rocm.grouped_tiles.get(name, {}).get("w4a16-pair", pair)
        assert (g.block_n, g.block_k, g.num_warps) == (gp.block_n, gp.block_k, gp.num_warps)
        p = search.plan(search.Problem(4096, 4096, 4096, QR(activations="fp16", outliers_per_block=2)), rocm, t,
                        static_target=None)
        assert (p.default.block_m, p.default.block_n, p.default.block_k, p.default.num_warps) == (
            pair.block_m, pair.block_n, pair.block_k, pair.num_warps)
    assert (f16, of2, torch.float16) in _aot_gemms()
    cuda = registry.get("cuda")  # NVIDIA: the grouped GEMM's own pair tiles (the dense ones compile clean)
    for name in ("sm_90", "sm_100", "sm_120"):
        gp = cuda.grouped_tiles[name]["w4a16-pair"]
        g = cuda.grouped_config(TARGETS[name], 4096 * 4, 32, torch.float16, True, pair=True)
        assert (g.block_n, g.block_k, g.num_warps, g.num_stages) == (gp.block_n, gp.block_k, gp.num_warps,
                                                                     gp.num_stages)
        assert cuda.grouped_config(TARGETS[name], 4096 * 4, 32, torch.bfloat16, True) != g  # (pair only)
    labels = [launch.label for launch in cuda.grouped_launches(TARGETS["sm_90"])]
    assert any(label.startswith("W4A16-fp16 b:OF-2") for label in labels)  # compiled by the matrix


def test_resolve_split_k():
    """split_k = 0 fills one wave (2 programs per SM for small M tiles, 1 otherwise), at
    most 16 splits and at least 2 K tiles each; explicit splits are kept."""
    from portable_mx.backends.triton.launch import GemmConfig

    cuda = registry.get("cuda")
    assert cuda.resolve_split_k(GemmConfig(16, 128, 128, split_k=0), 1, 8192, 8192, 132).split_k == 4
    assert cuda.resolve_split_k(GemmConfig(64, 256, 128, split_k=0), 128, 8192, 8192, 132).split_k == 2
    assert cuda.resolve_split_k(GemmConfig(16, 128, 128, split_k=0), 1, 1024, 8192, 132).split_k == 16
    assert cuda.resolve_split_k(GemmConfig(16, 128, 128, split_k=0), 1, 1024, 256, 132).split_k == 1
    assert cuda.resolve_split_k(GemmConfig(16, 128, 128, split_k=3), 1, 8192, 8192, 132).split_k == 3
    assert GemmConfig(16, 128, 128, split_k=4).label().endswith("sk4")


# ----------------------------------------------------------------------------- assembly


_SM90_PROBE = textwrap.dedent("""
    import json, re, sys, torch, triton
    from triton.compiler import ASTSource
    from portable_mx import registry
    from portable_mx.backends.targets import TARGETS
    from portable_mx.backends.triton.gemm import Operand
    target, cuda = TARGETS["sm_90"], registry.get("cuda")

    def loops(ptx):  # the PTX from each label to the last branch back to it
        lines = ptx.splitlines()
        for i, line in enumerate(lines):
            label = re.match(r"(\\$L__\\w+):", line.strip())
            if label:
                back = [j for j in range(i + 1, len(lines)) if re.search(r"bra(\\.uni)?\\s+" + re.escape(label.group(1)) + ";", lines[j])]
                if back:
                    yield "\\n".join(lines[i:back[-1] + 1])

    out = {}
    for name, m in (("decode", 1), ("prefill", 4096)):
        a = Operand(torch.bfloat16, None, 0)
        config = cuda.default_gemm_config(target, m, torch.bfloat16, False)
        launch = cuda.gemm_launch_spec(target, a, Operand(None, None, 0), config, m=m, out_dtype=torch.bfloat16)
        k = triton.compile(ASTSource(launch.fn, dict(launch.signature), constexprs=dict(launch.constexprs),
                                     attrs=launch.attrs()), target=target.gpu_target(), options=dict(launch.options))
        ttgir, ptx = k.asm["ttgir"], k.asm["ptx"]
        # the decode's asm (on the code bytes; the folded scales' asm works on int32 words)
        asm_line = next(line for line in ttgir.splitlines() if "tt.elementwise_inline_asm" in line and "xi8" in line)
        layout = re.search(r"tensor<\\d+x\\d+xi8, (#\\w+)>", asm_line).group(1)
        regs = re.search(re.escape(layout) + r" = #ttg.linear<\\{register = (\\[\\[.*?\\]\\])", ttgir).group(1)
        wgmma = re.search(r"wgmma\\.mma_async\\S* \\{[^}]*\\}, (\\{|%rd)", ptx)
        out[name] = {"asm_registers": json.loads(regs), "wgmma_a_in_registers": wgmma.group(1) == "{",
                     "cp_async_16": ptx.count("cp.async.cg.shared.global"), "local": "ld.local" in ptx,
                     "loops": len(list(loops(ptx))), "global_loads_in_loop": sum(len(re.findall(r"ld\\.global\\.(?:b8|b16)", body))
                                                 for body in loops(ptx))}
    print(json.dumps(out))
""")


@pytest.mark.triton
def test_sm90_assembly():
    """Compiled for sm_90 (no GPU needed): wgmma takes the decoded weight from registers;
    the inline PTX gets 4 consecutive bytes of one 32-bit word (the first two register
    bases of its operand's layout are the byte's two low column bits: what the hopper
    layout and the twin assume); codes arrive by 16-byte cp.async; nothing spills to local
    memory and no narrow global load is left in a loop (everything there is pipelined; the
    largest scale byte is one byte read once, before the K loop)."""
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _SM90_PROBE], capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr:
        pytest.skip("no ptxas")
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    for name, facts in json.loads(proc.stdout.strip().splitlines()[-1]).items():
        assert facts["asm_registers"][:2] == [[0, 1], [0, 2]], (name, facts)
        assert facts["wgmma_a_in_registers"] and facts["cp_async_16"] > 0, (name, facts)
        assert not facts["local"] and facts["loops"] > 0 and facts["global_loads_in_loop"] == 0, (name, facts)


# ----------------------------------------------------------------------------- the GPU sweep


def _interpreter_usable() -> bool:
    from portable_mx.backends.triton import MIN_TRITON_INTERPRET_GEMM, triton_version

    version = triton_version()
    return version is not None and version >= MIN_TRITON_INTERPRET_GEMM


@pytest.mark.skipif(torch.cuda.is_available() or not _interpreter_usable(),
                    reason="the sweep's CPU smoke run is for machines without a GPU, with triton >= 3.8")
def test_gemm_sweep_cpu_smoke(tmp_path):
    """benchmarks/sweeps/gemm_sweep.py --cpu-smoke runs end to end in the interpreter: every
    candidate checked against the float64 product on both problems, one JSON written."""
    import json
    import os
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "sweeps" / "gemm_sweep.py"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(script), "--cpu-smoke", "--shapes", "m16", "--kinds", "a4w4,w4a16-of2",
                           "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((tmp_path / "gemm_sweep.json").read_text())
    assert result["smoke"] and set(result["shapes"]) == {"m16"}
    assert {r["kind"] for r in result["candidates"]} == {"a4w4", "w4a16-of2"}
    assert result["candidates"] and all(r["check_small"] and r["check_rows"] and "ms" in r
                                        for r in result["candidates"])


# ----------------------------------------------------------------------------- A4W4 at decode


@pytest.mark.triton
def test_left_values_policy():
    """Backend.left_values: the W4A16 GEMM on the tokens' quantized values where the A4W4
    GEMM decodes its operands (sm_90, gfx942), at decode sizes (M <= 16) and for wide
    outputs (N >= VALUES_MIN_N) at any M, for recipes whose values are bf16 numbers (no
    macro blocks, no outliers); never on native targets."""
    from portable_mx.backends.cuda import CudaBackend
    from portable_mx.backends.rocm import RocmBackend
    from portable_mx.backends.triton.backend import VALUES_MIN_N

    def on(base, name):
        class Simulated(base):
            def target(self, device):
                return TARGETS[name]

        return Simulated()

    cpu = torch.device("cpu")
    wide = VALUES_MIN_N
    for base, name, upcasts in ((CudaBackend, "sm_90", True), (CudaBackend, "sm_100", False),
                                (CudaBackend, "sm_120", False), (RocmBackend, "gfx942", True),
                                (RocmBackend, "gfx950", False)):
        backend = on(base, name)
        assert backend.left_values(1, 64, QR(), cpu) is upcasts, name
        assert backend.left_values(16, 64, QR(rounding="stochastic", seed=3), cpu) is upcasts, name
        assert backend.left_values(17, wide - 1, QR(), cpu) is False
        assert backend.left_values(17, wide, QR(), cpu) is upcasts, name
        assert backend.left_values(8192, 8192, QR(), cpu) is upcasts, name
        assert backend.left_values(1, 64, QR(macro_block=64), cpu) is False
        assert backend.left_values(4096, wide, QR(outliers_per_block=1), cpu) is False
    assert ReferenceBackend().left_values(1, wide, QR(), cpu) is False


@needs_kernels
def test_a4w4_at_decode_through_quantized_values(gemm_kernel, monkeypatch):
    """With left_values' policy as on sm_90 (the backend's own, its device marked as an
    upcast target; the wide-output threshold lowered to 64 columns to keep the shapes
    small), pmx.matmul A4W4 runs the W4A16 GEMM on the tokens' quantized values at M <= 16
    and at M = 17 with a wide output: the same products as the A4W4 GEMM, so within the
    fp32 accumulation bound of the exact product of the quantized operands; and bit for
    bit the W4A16 GEMM of the reference's dequantized tokens (same kernel, same config)."""
    backend, device = gemm_kernel
    monkeypatch.setenv(registry.ENV_BACKEND, backend.name)
    monkeypatch.setattr(backend, "_devices", {})
    calls = values_route_spy(backend, device, monkeypatch)
    x, w = randn(1, 5, 100, seed=11, scale=3.0), randn(100, 70, seed=12)
    for recipe in (QR(), QR(scale_rule="rceil", rounding="stochastic", seed=9)):
        w_mx = pmx.quantize(w.to(device), recipe, axis=0)
        calls.clear()
        out = pmx.matmul(x.to(device), w_mx, recipe)
        assert calls == [(5, 100)] and out.shape == (1, 5, 70)
        with monkeypatch.context() as cpu:
            cpu.setenv(registry.ENV_BACKEND, "reference")
            left = ops.left_operand(x.reshape(-1, 100), recipe)
        assert_accumulation_close(out.reshape(-1, 70), ops._mx_rows(left), ops._mx_rows(w_mx.to("cpu")), 100)
        values = REF.dequantize(ops._mx_rows(left), torch.bfloat16)[:, :100]
        w16 = backend.matmul(values.to(device), w_mx.rows(), torch.float32)  # as the dispatch layer calls it
        assert bitwise_equal(out.reshape(-1, 70), w16)
    calls.clear()
    x17 = randn(17, 100, seed=13)
    w_mx = pmx.quantize(w.to(device), axis=0)
    out = pmx.matmul(x17.to(device), w_mx)  # M > 16, N = 70 >= 64: a wide output
    assert calls == [(17, 100)]
    assert_accumulation_close(out, ops._mx_rows(REF.quantize(x17, QR())), ops._mx_rows(w_mx.to("cpu")), 100)
    calls.clear()
    pmx.matmul(x.to(device), pmx.quantize(w.to(device), QR(macro_block=64), axis=0), QR(macro_block=64))
    pmx.matmul(x17.to(device), pmx.quantize(w[:, :48].to(device), axis=0))
    assert calls == []  # macro blocks (values not bf16), and M > 16 with N = 48 < 64: the A4W4 GEMM


@needs_kernels
@pytest.mark.parametrize("layout", ["plain", "hopper"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tokens_quantized_by_the_gemm_equal_the_two_launch_route(gemm_kernel, layout, dtype):
    """The upcast kernel quantizing its 16-bit tokens itself (``quant``: A4W4 at decode in
    one launch) equals the W4A16 kernel on the reference's quantized values of the same
    tokens, bit for bit: every scale rule, ragged K (zero padding), split-K, tokens over
    ~40 binades with NaN, +-Inf, -0, subnormals and the largest values (NaN blocks,
    saturation, overflow to inf); and differs from the W4A16 product of the raw tokens
    (the quantization happened)."""
    from portable_mx.backends.triton.launch import GemmConfig
    from portable_mx.backends.triton.numerics import RULE_IDS

    sys.path.insert(0, os.path.dirname(__file__))
    from test_triton_kernels import sample

    backend, device = gemm_kernel
    route = _routes()[layout]
    for i, (m, k, n, split) in enumerate([(1, 64, 64, 1), (3, 100, 64, 2), (16, 256, 128, 3)]):
        x = sample((m, k), seed=130 + i).to(dtype)
        b = rows_mx(randn(n, k, seed=140 + i, scale=2.0), QR())
        config = GemmConfig(16, 64, 64, split_k=split)
        for rule in ("floor", "rceil", "even", "ceil"):
            recipe = QR(scale_rule=rule)
            values = REF.quantized_values(x, recipe)[:, :k].contiguous()
            want = upcast(gemm_kernel, values, b, config, route)
            got = upcast(gemm_kernel, x, b, config, route, quant=RULE_IDS[recipe.scale_rule])
            assert bitwise_equal(got, want), (m, k, rule)
        finite = randn(m, k, seed=135 + i, scale=3.0).to(dtype)  # (NaN rows are NaN either way)
        raw = upcast(gemm_kernel, finite, b, config, route)
        assert not bitwise_equal(upcast(gemm_kernel, finite, b, config, route, quant=0), raw)


def test_tokens_quantized_by_the_gemm_refuse_what_they_cannot_be():
    """Only 16-bit tokens without macro blocks or outliers, with an even K, are quantized
    by the kernel (the constexprs refuse the rest)."""
    from portable_mx.backends.triton import gemm_upcast
    from portable_mx.backends.triton.gemm import Operand
    from portable_mx.backends.triton.launch import GemmConfig

    config, mx = GemmConfig(16, 64, 64), Operand(None, None, 0)
    ok = gemm_upcast.constexprs(Operand(torch.bfloat16, None, 0, 1), mx, 64, 64, config, _routes()["plain"], False)
    assert ok["A_QUANT"] == 1 and ok["DOT"] == "bf16" and ok["SPARSE_M"] == 0
    assert gemm_upcast.constexprs(Operand(torch.float16, None, 0, 0), mx, 64, 64, config, _routes()["plain"],
                                  False)["DOT"] == "bf16"  # the values are bf16 numbers
    for a, k in ((Operand(None, None, 0, 0), 64), (Operand(torch.bfloat16, 64, 0, 0), 64),
                 (Operand(torch.bfloat16, None, 1, 0), 64), (Operand(torch.bfloat16, None, 0, 0), 63)):
        with pytest.raises(ValueError, match="quantized in the kernel"):
            gemm_upcast.constexprs(a, mx, k, 64, config, _routes()["plain"], False)


@needs_kernels
def test_backend_matmul_refuses_tokens_it_cannot_quantize(gemm_kernel, monkeypatch):
    """backend.matmul(quant=...) refuses tokens it cannot read as words (an odd row
    stride or offset, fp32) with a clear error, and a route whose kernel does not quantize tokens
    (the interpreter's own tl.dot_scaled route) instead of multiplying them unquantized."""
    from portable_mx.backends.triton.gemm import Operand

    backend, device = gemm_kernel
    monkeypatch.setattr(backend, "_devices", {})
    w = pmx.quantize(randn(70, 100, seed=160).to(device), axis=-1).rows()
    with pytest.raises(ValueError, match="readable as words"):
        # (sliced on the device: .to() of a strided CPU view makes a contiguous copy)
        backend.matmul(randn(5, 101, seed=161).to(torch.bfloat16).to(device)[:, :100], w, torch.float32, 0)
    with pytest.raises(ValueError, match="readable as words"):
        backend.matmul(randn(5, 100, seed=162).to(device), w, torch.float32, 0)
    target = backend._device(indexed(device)).target
    upcast = backend.gemm_route(target, Operand(torch.bfloat16, None, 0, 0), Operand(None, None, 0)).kernel == "upcast"
    if upcast:  # a plan for tokens at an even offset first: an odd one (the same stride) is refused all the same
        backend.matmul(randn(5, 100, seed=164).to(torch.bfloat16).to(device), w, torch.float32, 0)
    odd_offset = torch.zeros(501, dtype=torch.bfloat16, device=device)[1:].view(5, 100)
    with pytest.raises(ValueError, match="readable as words"):
        backend.matmul(odd_offset, w, torch.float32, 0)
    if not upcast:
        with pytest.raises(RuntimeError, match="upcast route"):
            backend.matmul(randn(5, 100, seed=163).to(torch.bfloat16).to(device), w, torch.float32, 0)


@needs_kernels
def test_a4w4_at_decode_in_one_launch(gemm_kernel, monkeypatch):
    """pmx.matmul A4W4 on an upcast route (the backend's device marked as one, as sm_90 and
    gfx942 are): at M <= 16 with bf16/fp16 tokens and nearest rounding the GEMM kernel
    quantizes the tokens itself (no quantized_values launch), bit for bit the two-launch
    route's result (the W4A16 GEMM on the reference's values); stochastic rounding, fp32
    tokens, an odd K, an odd row stride or M = 17 take the two launches; without the
    upcast route (the interpreter's own tl.dot_scaled route) nothing is fused."""
    backend, device = gemm_kernel
    monkeypatch.setattr(backend, "_devices", {})
    calls = values_route_spy(backend, device, monkeypatch)
    monkeypatch.setenv(registry.ENV_BACKEND, backend.name)
    w = randn(100, 70, seed=150)

    def run(x, recipe, w=w):
        calls.clear()
        w_mx = pmx.quantize(w.to(x.dtype).to(device), recipe, axis=0)
        out = pmx.matmul(x.to(device), w_mx, recipe)
        with monkeypatch.context() as ref:
            ref.setenv(registry.ENV_BACKEND, "reference")
            values = REF.quantized_values(x.reshape(-1, x.shape[-1]).cpu(), left_stream(recipe))[:, :x.shape[-1]]
        want = backend.matmul(values.to(device), w_mx.rows(), out.dtype)
        assert bitwise_equal(out.reshape(-1, out.shape[-1]), want)
        return list(calls)

    from portable_mx.backends.triton.gemm import Operand

    st = backend._device(indexed(device))
    native = backend.gemm_route(st.target, Operand(torch.bfloat16, None, 0, 0), Operand(None, None, 0)).kernel
    st.upcasts = True  # the device's own route: fused only on upcast (the interpreter's: tl.dot_scaled)
    assert run(randn(5, 100, seed=151).to(torch.bfloat16), QR()) == ([] if native == "upcast" else [(5, 100)])
    monkeypatch.setattr(backend, "gemm_route", lambda target, a, b: _upcast_route())
    monkeypatch.setattr(backend, "_devices", {})
    backend._device(indexed(device)).upcasts = True
    for dtype in (torch.bfloat16, torch.float16):
        for recipe in (QR(), QR(scale_rule="rceil"), QR(scale_rule="even")):
            assert run(randn(1, 5, 100, seed=152, scale=3.0).to(dtype), recipe) == []
    assert run(randn(16, 100, seed=153).to(torch.bfloat16), QR()) == []
    assert run(randn(5, 100, seed=154).to(torch.bfloat16), QR(rounding="stochastic", seed=3)) == [(5, 100)]
    assert run(randn(5, 100, seed=155), QR()) == [(5, 100)]  # fp32 tokens
    assert run(randn(5, 99, seed=156).to(torch.bfloat16), QR(), w=randn(99, 70, seed=157)) == [(5, 99)]
    odd = randn(5, 101, seed=158).to(torch.bfloat16).to(device)[:, :100]  # row stride 101, on the device
    assert run(odd, QR()) == [(5, 100)]
    assert run(randn(17, 100, seed=159).to(torch.bfloat16), QR()) == [(17, 100)]  # N = 70 >= 64: wide


def _upcast_route():
    from portable_mx.backends.triton.backend import GemmRoute

    return GemmRoute("upcast", upcast=_routes()["hopper"])


@needs_kernels
def test_a_strided_weight_written_in_place_is_seen(gemm_kernel, monkeypatch):
    """A prequantized weight whose codes and scales are not contiguous (column slices of
    wider buffers) is copied for the kernel and the copy kept with it: an in-place write
    of the weight after a first GEMM must reach the next one, on the backend's own route
    (whichever it is here)."""
    backend, device = gemm_kernel
    monkeypatch.setenv(registry.ENV_BACKEND, backend.name)
    recipe = QR(activations="bf16")
    x = randn(4, 128, seed=24)
    dense = pmx.quantize(randn(128, 64, seed=25, scale=0.5).to(device), recipe, axis=0)
    new = pmx.quantize(randn(128, 64, seed=26, scale=2.0).to(device), recipe, axis=0)

    def wide(t):
        buf = torch.zeros(t.shape[0], t.shape[1] + 8, dtype=t.dtype, device=t.device)
        buf[:, :t.shape[1]] = t
        return buf[:, :t.shape[1]]

    w_mx = pmx.MXTensor(qdata=wide(dense.qdata), scales=wide(dense.scales), shape=dense.shape, dtype=dense.dtype,
                        axis=0, recipe=recipe)
    assert not w_mx.qdata.is_contiguous() and not w_mx.scales.is_contiguous()
    first = pmx.matmul(x.to(device), w_mx, recipe)
    assert_accumulation_close(first, x.to(torch.bfloat16), ops._mx_rows(dense.to("cpu")), 128)
    w_mx.qdata.copy_(new.qdata)
    w_mx.scales.copy_(new.scales)
    out = pmx.matmul(x.to(device), w_mx, recipe)
    assert_accumulation_close(out, x.to(torch.bfloat16), ops._mx_rows(new.to("cpu")), 128)


@needs_kernels
def test_public_matmul_sees_an_in_place_write_of_the_weight(gemm_kernel, monkeypatch):
    """A prequantized weight written in place after a first GEMM (as load_state_dict does
    to a module's buffers): on the upcast route the backend keeps the weight's swizzled
    copies and largest scale byte; the next GEMM must multiply the new bytes, a scale byte
    raised above 128 included (the folded decode would overflow on it)."""
    from portable_mx.backends.triton.backend import GemmRoute
    from portable_mx.backends.triton.launch import GemmConfig

    backend, device = gemm_kernel
    monkeypatch.setenv(registry.ENV_BACKEND, backend.name)
    monkeypatch.setattr(backend, "_devices", {})
    monkeypatch.setattr(type(backend), "gemm_route",
                        lambda self, target, a, b: GemmRoute("upcast", upcast=_routes()["hopper"]))
    monkeypatch.setattr(type(backend), "default_gemm_config",
                        lambda self, target, m, a_format, heavy, **_: GemmConfig(16, 64, 64, split_k=1))
    recipe = QR(activations="bf16")
    x = randn(4, 128, seed=21)
    w_mx = pmx.quantize(randn(128, 64, seed=22, scale=0.5).to(device), recipe, axis=0)
    new = pmx.quantize(randn(128, 64, seed=23, scale=3000.0).to(device), recipe, axis=0)
    pmx.matmul(x.to(device), w_mx, recipe)
    w_mx.qdata.copy_(new.qdata)
    w_mx.scales.copy_(new.scales)
    out = pmx.matmul(x.to(device), w_mx, recipe)
    assert_accumulation_close(out, x.to(torch.bfloat16), ops._mx_rows(new.to("cpu")), 128)


def test_sm90_decode_is_held_only_where_it_was_measured_and_compiles_clean(monkeypatch):
    """The dense W4A16 decode on sm_90 launches held at 128 registers (8.5% faster at
    1 x 8192^2 on an H200, NOTES-gemm) exactly where cuda.HELD_DECODE says: its tile, a
    bf16 left operand (W4A16 or tokens quantized in the kernel), a bf16 output, split-K up
    to 4, a Triton of HELD_DECODE["triton"]; not at split 8 or 16, with an fp32 output,
    under another Triton (the compile matrix: spills there), on another target, for an
    MXFP4 left operand or a config that carries its own options. The plan and the launch
    the compile matrix and the tuner compile (gemm_launch_spec) agree."""
    from portable_mx.backends import cuda
    from portable_mx.backends.triton.gemm import Operand
    from portable_mx.backends.triton.launch import GemmConfig

    backend, sm90, w = cuda.CudaBackend(), TARGETS["sm_90"], Operand(None, None, 0)
    bf16, tokens = Operand(torch.bfloat16, None, 0), Operand(torch.bfloat16, None, 0, 0)
    decode = backend.default_gemm_config(sm90, 1, torch.bfloat16, False)
    assert "maxnreg" not in decode.options()  # the tile table holds nothing: the launch does

    def held(a, n=8192, kp=8192, out=torch.bfloat16, target=sm90, config=decode):
        return backend.gemm_launch_spec(target, a, w, config, m=1, n=n, kp=kp, out_dtype=out).options.get("maxnreg")

    monkeypatch.setattr(cuda, "holds_registers", lambda: True)
    assert held(bf16) == 128 and held(tokens) == 128  # split 4
    assert held(bf16, n=8192, kp=1024) == 128  # 8 K tiles: split 2
    assert held(bf16, n=4096, kp=4096) is None and held(bf16, n=2048) is None  # split 8, 16
    assert held(bf16, out=torch.float32) is None and held(Operand(torch.float16, None, 0), out=torch.float16) is None
    assert held(Operand(None, None, 0)) is None  # MXFP4 tokens: the A4W4 kernel
    assert held(bf16, target=TARGETS["sm_100"], config=GemmConfig(16, 128, 128, num_warps=4, num_stages=4)) is None
    own = GemmConfig(16, 128, 128, num_warps=4, num_stages=4, split_k=4, extra=(("maxnreg", 160),))
    assert held(bf16, config=own) == 160  # a tuned config's own cap stands
    assert held(bf16, config=GemmConfig(16, 128, 256, num_warps=4, num_stages=3, split_k=4)) is None
    monkeypatch.setattr(cuda, "holds_registers", lambda: False)
    assert held(bf16) is None
    monkeypatch.undo()
    # the grouped GEMM's decode tile is not held
    assert "maxnreg" not in backend.grouped_config(sm90, 8, 128, torch.bfloat16, False).options()


@pytest.mark.triton
def test_the_sm90_decode_plan_launches_held(monkeypatch):
    """The plan run_gemm makes asks the same rule as gemm_launch_spec: a W4A16 decode with
    bf16 tokens and output on a (simulated) sm_90 launches with maxnreg=128 where
    cuda.HELD_DECODE holds, without it for an fp32 output or where it does not. (The
    launch itself is replaced by a recorder: no GPU here; the weight is quantized by the
    reference.)"""
    from portable_mx.backends import cuda
    from portable_mx.backends.triton import launch as L

    class Simulated(cuda.CudaBackend):
        def unavailable_reason(self, device):
            return None

        def target(self, device):
            return TARGETS["sm_90"]

        def _identity(self, device, target):
            return "sm_90", "simulated sm_90"

    seen = []
    monkeypatch.setattr(L, "launch", lambda plan, args: seen.append(plan))
    w_mx = ReferenceBackend().quantize(randn(8192, 1024, seed=5).to(torch.bfloat16), QR())  # rows (N, K)
    x = randn(1, 1024, seed=6).to(torch.bfloat16)
    for holds, out, want in ((True, torch.bfloat16, 128), (True, torch.float32, None), (False, torch.bfloat16, None)):
        monkeypatch.setattr(cuda, "holds_registers", lambda holds=holds: holds)
        backend = Simulated()
        seen.clear()
        backend.matmul(x, w_mx, out)
        (plan,) = [p for p in seen if p.kernel == "gemm-upcast"]
        assert plan.options.get("maxnreg") == want, (holds, out, plan.config)
        assert plan.config.split_k <= 4 and (plan.config.block_m, plan.config.block_n) == (16, 128)
