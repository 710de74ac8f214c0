"""portable_mx MXTensor <-> torchao's MXTensor (``torchao.prototype.mx_formats``), without a copy.

torchao 0.18's FP4 MXTensor holds the same bytes as portable_mx's: ``qdata`` uint8
[..., K/2] packed by ``pack_uint4`` (element 2j in the low nibble), ``scale`` the E8M0
bytes [..., K/32] typed ``torch.float8_e8m0fnu``, 32 elements per block along the last
axis (torchao ``prototype/mx_formats/mx_tensor.py``, ``kernels.py``). So the conversion
is a dtype view of the scales: both objects share storage, and dequantizing either gives
the same values bit for bit in fp32 and bf16, for every scale byte and code. In fp16 too,
but where torchao casts the scale to fp16 before multiplying and the scale leaves fp16's
range: scale bytes 100-102 (torchao's values 0, portable_mx's the fp16 subnormals), 143
(+-0.5 gives +-inf in torchao, +-32768 in portable_mx) and 143-254 (code 0 gives NaN in
torchao: 0 * inf). torchao's ``to_mx`` writes portable_mx's
bytes for each of its four scale rules (FLOOR, RCEIL, EVEN, CEIL = portable_mx's floor,
rceil, even, ceil; the tests check it), except the codes inside a NaN block (scale
0xFF), which torchao leaves as junk and portable_mx writes as 0 (both decode to NaN), a
block holding an infinity, which torchao gives a finite scale (253 under FLOOR, 254
under RCEIL) where portable_mx writes a NaN block (numerics.md), and a block of scale
byte 0 (largest magnitude below about 2**-124), whose elements torchao divides by
2**-126 (the byte's 2**-127, clamped) and so writes codes for half the values.

What does not map: portable_mx's macro-block factors and outliers (torchao has neither),
a quantized axis other than the last, K not a multiple of 32 (torchao does not pad), and
torchao's MXFP8 element types or swizzled scales; each raises a ValueError saying so.

Needs the optional ``torchao`` package (``pip install "portable_mx[hf]"``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..format import BLOCK_SIZE
from ..ops import _recipe
from ..recipe import QuantRecipe
from ..tensor import MXTensor
from ._optional import require

__all__ = ["from_torchao", "to_torchao"]


def _mx_tensor_class() -> Any:
    require("torchao", "converting to or from torchao's MXTensor")
    from torchao.prototype.mx_formats.mx_tensor import MXTensor as AOMXTensor

    return AOMXTensor


def to_torchao(mx: MXTensor, *, kernel_preference: Any = None) -> Any:
    """``mx`` as a torchao ``MXTensor`` sharing its storage (no copy).

    ``mx``: a plain MXFP4 MXTensor (no macro-block factors, no outliers) quantized along
    its last axis, whose length K is a multiple of 32, with contiguous parts (a strided
    view, e.g. of every other row, raises: torchao's kernels index its bytes as
    contiguous). Returns torchao's
    ``MXTensor(qdata=mx.qdata, scale=mx.scales.view(torch.float8_e8m0fnu),
    elem_dtype=torch.float4_e2m1fn_x2, block_size=32, orig_dtype=mx.dtype, ...)`` with
    unswizzled scales, built with its constructor (``from_qdata_and_scales`` rejects
    packed uint8 data); its shape is ``mx.shape``. ``kernel_preference``: torchao's
    ``KernelPreference`` (default ``EMULATED``: dequantize + matmul, on any device).
    """
    cls = _mx_tensor_class()
    if not isinstance(mx, MXTensor):
        raise TypeError(f"to_torchao expects a portable_mx MXTensor; got {type(mx).__name__}")
    if mx.macro_scales is not None or mx.outlier_values is not None:
        raise ValueError(f"torchao's MXTensor holds plain MXFP4 only; this one has "
                         f"{'macro-block factors' if mx.macro_scales is not None else 'outliers'} "
                         f"({mx.recipe.describe()})")
    if mx.axis != len(mx.shape) - 1:
        raise ValueError(f"torchao's MXTensor blocks along the last dimension; this one is quantized along axis "
                         f"{mx.axis} of shape {tuple(mx.shape)} (quantize with axis=-1)")
    if mx.k % BLOCK_SIZE:
        raise ValueError(f"torchao's MXTensor has no padding: the last dimension ({mx.k}) must be a multiple of "
                         f"{BLOCK_SIZE}")
    if not (mx.qdata.is_contiguous() and mx.scales.is_contiguous()):
        raise ValueError(f"torchao's MXTensor needs contiguous qdata and scales; this MXTensor's are strided "
                         f"(qdata strides {tuple(mx.qdata.stride())}, scales {tuple(mx.scales.stride())}: a view "
                         "of another one); quantize a contiguous copy of the float tensor, or rebuild the MXTensor "
                         "from contiguous copies of its parts")
    if kernel_preference is None:
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

        kernel_preference = KernelPreference.EMULATED
    return cls(mx.qdata, mx.scales.view(torch.float8_e8m0fnu), torch.float4_e2m1fn_x2, BLOCK_SIZE, mx.dtype,
               kernel_preference, None, False)


def from_torchao(t: Any, *, recipe: Optional[QuantRecipe] = None) -> MXTensor:
    """A torchao FP4 ``MXTensor`` as a portable_mx MXTensor sharing its storage (no copy).

    ``t``: torchao's MXTensor with ``elem_dtype`` ``torch.float4_e2m1fn_x2``, block size
    32, unswizzled scales and contiguous qdata [..., K/2]. Returns
    ``MXTensor(qdata=t.qdata, scales=t.scale.view(torch.uint8), shape=t.shape,
    dtype=t.orig_dtype, axis=-1 (as a non-negative index), recipe)``; ``recipe`` is
    metadata only (default ``QuantRecipe()``: the bytes do not record a scale rule).
    """
    cls = _mx_tensor_class()
    if not isinstance(t, cls):
        raise TypeError(f"from_torchao expects torchao's MXTensor; got {type(t).__name__}")
    if t.elem_dtype != torch.float4_e2m1fn_x2:
        raise ValueError(f"portable_mx holds MXFP4 (torch.float4_e2m1fn_x2) only; this torchao MXTensor is "
                         f"{t.elem_dtype}")
    if t.block_size != BLOCK_SIZE:
        raise ValueError(f"portable_mx blocks are {BLOCK_SIZE} elements; this torchao MXTensor has {t.block_size}")
    if t.is_swizzled_scales:
        raise ValueError("this torchao MXTensor's scales are swizzled (the cuBLAS blocked layout); portable_mx "
                         "takes the plain [..., K/32] layout")
    qdata, scale = t.qdata, t.scale
    if qdata.dtype != torch.uint8 or not qdata.is_contiguous():
        raise ValueError(f"expected contiguous packed uint8 qdata [..., K/2]; got {qdata.dtype} with strides "
                         f"{tuple(qdata.stride())} (a transposed or sliced torchao MXTensor: make it contiguous "
                         "first)")
    if not scale.is_contiguous():
        raise ValueError(f"expected contiguous scales [..., K/32]; got strides {tuple(scale.stride())}")
    shape = torch.Size(t.shape)
    if tuple(scale.shape) != tuple(shape[:-1]) + (shape[-1] // BLOCK_SIZE,):
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match data shape {tuple(shape)} "
                         f"(expected [..., {shape[-1] // BLOCK_SIZE}])")
    recipe = _recipe(recipe)  # (a mapping of fields, as the ops take, or a QuantRecipe)
    if recipe.macro_block is not None or recipe.outliers_per_block:
        raise ValueError(f"recipe {recipe.describe()} has macro-block factors or outliers, which torchao's bytes lack")
    return MXTensor(qdata=qdata, scales=scale.view(torch.uint8), shape=shape, dtype=t.orig_dtype,
                    axis=len(shape) - 1, recipe=recipe)
