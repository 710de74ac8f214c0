"""The one dispatch layer: validated problems -> the rows view -> the selected backend.

Everything above this module (the public ops in :mod:`portable_mx.ops`, the custom ops
in :mod:`portable_mx._custom_ops`, :class:`~portable_mx.tensor.MXTensor`'s methods)
validates its input once and calls down into these functions; nothing here checks
arguments again. Each function moves the quantized axis last, flattens to the canonical
``(R, K)`` rows problem of :mod:`portable_mx.registry`, asks the registry for the
backend (memoised per op and device) and maps the result back to the caller's layout.
Views are made only where the layout needs them: a 2-D tensor quantized along its last
axis goes to the backend as it is.

MXTensors are handled through their own layout methods (``rows``, ``unrows``), so this
module needs no import of :mod:`portable_mx.tensor` (which imports it): an operand is an
MXTensor exactly when it is not a ``torch.Tensor``.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Optional, Union

import torch

from . import registry
from .decompose import Decomposition, zeros_decomposition
from .format import BLOCK_SIZE, LEFT_STREAM
from .recipe import QuantRecipe

if TYPE_CHECKING:
    from .tensor import MXTensor

Operand = Union[torch.Tensor, "MXTensor"]

_select = registry.select
_Tensor = torch.Tensor


def _padded(k: int) -> int:
    return -(-k // BLOCK_SIZE) * BLOCK_SIZE


def to_rows(x: torch.Tensor, axis: int) -> torch.Tensor:
    """x with ``axis`` (>= 0) moved last, flattened to [R, K]: x itself when it is 2-D
    with ``axis`` 1, else a view (a copy only when the layout needs one)."""
    nd = x.dim()
    if axis == nd - 1:  # (the row count spelled out: reshape(-1, 0) of an empty tensor is ambiguous)
        return x if nd == 2 else x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    xm = x.movedim(axis, -1)
    return xm.reshape(math.prod(xm.shape[:-1]), xm.shape[-1])


def from_rows(t: torch.Tensor, lead: torch.Size, k: int, axis: int) -> torch.Tensor:
    """[R, Kp] rows -> crop to K, restore the lead dims and move the axis back."""
    return t[:, :k].reshape(*lead, k).movedim(-1, axis)


# ----------------------------------------------------------------------------- element-wise ops


def quantize_rows(rows: torch.Tensor, recipe: QuantRecipe) -> "MXTensor":
    """float [R, K] (R, K > 0) -> MXTensor (R, K), axis 1."""
    return _select("quantize", rows.device).quantize(rows, recipe)


def quantize(x: torch.Tensor, recipe: QuantRecipe, axis: int) -> "MXTensor":
    """A non-empty float tensor quantized along ``axis`` (>= 0)."""
    rows = to_rows(x, axis)
    out = _select("quantize", x.device).quantize(rows, recipe)
    return out if rows is x else out.unrows(x.shape, axis)


def dequantize(mx: "MXTensor", dtype: torch.dtype) -> torch.Tensor:
    """The values of ``mx`` in its original layout, in ``dtype``."""
    rows = mx.rows()
    if rows.qdata.numel() == 0:
        return torch.zeros(mx.shape, dtype=dtype, device=mx.device)
    q = _select("dequantize", mx.device).dequantize(rows, dtype)
    if rows is mx:
        k = mx.shape[1]
        return q if q.shape[1] == k else q[:, :k]
    return from_rows(q, mx.lead_shape, mx.k, mx.axis)


def decompose_rows(rows: torch.Tensor, recipe: QuantRecipe, definition: str, full: bool) -> Decomposition:
    """The decomposition of float rows [R, K] quantized along K, in the rows layout."""
    if rows.numel() == 0:
        return zeros_decomposition(*rows.shape, recipe, definition, full, rows.device)
    return _select("decompose", rows.device).decompose(rows, recipe, definition, full)


def decomposition_layout(dec: Decomposition, shape: torch.Size, axis: int) -> Decomposition:
    """A rows-layout Decomposition of a tensor of ``shape`` quantized along ``axis``
    (>= 0), moved to that tensor's layout."""
    lead = torch.Size(shape[:axis] + shape[axis + 1:])
    k = shape[axis]
    nb = _padded(k) // BLOCK_SIZE
    dec = dec.map_tensors(
        block_fn=lambda t: t.reshape(*lead, nb),
        element_fn=lambda t: from_rows(t, lead, k, axis),
    )
    return replace(dec, axis=axis, num_elements=math.prod(shape))


def decompose(x: torch.Tensor, recipe: QuantRecipe, axis: int, definition: str, full: bool) -> Decomposition:
    """The decomposition of quantizing ``x`` along ``axis`` (>= 0), in x's layout."""
    return decomposition_layout(decompose_rows(to_rows(x, axis), recipe, definition, full), x.shape, axis)


# ----------------------------------------------------------------------------- GEMM


_LEFT: dict = {}


def left_recipe(recipe: QuantRecipe) -> QuantRecipe:
    """The recipe with which a GEMM quantizes its float left operand: ``recipe`` itself
    with nearest rounding; with stochastic rounding the same recipe on the left stream,
    seed ``recipe.seed ^`` :data:`~portable_mx.format.LEFT_STREAM`, so that the rounding
    of a[i, k] is independent of that of b[k, i] (on one key both draw the uniform of the
    same counter, i * Kp + k, and their errors correlate: the product's diagonal is
    biased: +2.7% on the diagonal of a Gram matrix of N(0, 1) rows 4096 long under rceil;
    independent draws, none)."""
    if recipe.rounding != "stochastic":
        return recipe
    left = _LEFT.get(recipe)
    if left is None:
        left = recipe.model_copy(update={"seed": recipe.seed ^ LEFT_STREAM})
        if len(_LEFT) >= _LEFT_MAX:  # recipes made per step (a seed each) stay bounded; cleared, not
            _LEFT.clear()  # closed: once full it kept the first 256 and copied every later one per call
        _LEFT[recipe] = left
    return left


_LEFT_MAX = 256


def left_operand(a: Operand, recipe: QuantRecipe) -> Operand:
    """The left GEMM operand ``a`` [M, K] as a backend takes it: an MXTensor in the rows
    layout (quantized along K with :func:`left_recipe` of ``recipe`` when ``a`` is a float
    tensor), or, with 16-bit ``recipe.activations``, ``a`` rounded to that format (round to
    nearest even)."""
    if not isinstance(a, _Tensor):
        return a.rows()
    if recipe.activations == "mxfp4":
        return _select("quantize", a.device).quantize(a, left_recipe(recipe))
    half = torch.bfloat16 if recipe.activations == "bf16" else torch.float16
    return a if a.dtype is half else a.to(half)


def right_operand(b: Operand, recipe: QuantRecipe) -> "MXTensor":
    """The weight ``b`` [K, N] as a backend takes it: an MXTensor (N, K), axis 1 (b
    quantized along K, axis 0, with ``recipe`` when it is a float tensor)."""
    if isinstance(b, _Tensor):
        rows = b.T
        return _select("quantize", b.device).quantize(rows, recipe)
    return b.rows()


def gemm(a: Operand, b: Operand, recipe: QuantRecipe, out_dtype: torch.dtype,
         bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``a @ b`` (+ ``bias``) in ``out_dtype``: a [M, K] (float, or an MXTensor along
    axis 1), b [K, N] (float, or an MXTensor along axis 0), quantized per ``recipe`` (see
    :func:`portable_mx.matmul`); bias None or a float [N] on b's device, added in fp32
    to the fp32 accumulation, which is rounded once to ``out_dtype``."""
    m, k = a.shape
    n = b.shape[1]
    if m == 0 or k == 0 or n == 0:
        out = torch.zeros(m, n, dtype=out_dtype, device=b.device)
        return out if bias is None or m == 0 or n == 0 else out.copy_(bias.to(torch.float32).expand(m, n))
    b_rows = right_operand(b, recipe) if isinstance(b, _Tensor) else b.rows()  # (right_operand's, inline)
    backend = _select("matmul", b_rows.device)
    if recipe.activations == "mxfp4" and isinstance(a, _Tensor) and backend.left_values(m, n, recipe, a.device):
        # (the W4A16 GEMM on a's values)
        if bias is None:
            return backend.matmul_on_values(a, left_recipe(recipe), b_rows, out_dtype)
        return backend.matmul_on_values(a, left_recipe(recipe), b_rows, out_dtype, bias=bias)
    if bias is None:
        return backend.matmul(left_operand(a, recipe), b_rows, out_dtype)
    return backend.matmul(left_operand(a, recipe), b_rows, out_dtype, bias=bias)


def backend_left_operand(backend, a: Operand, recipe: QuantRecipe, m: int, n: int) -> Operand:
    """The left operand a [X, K] as ``backend``'s GEMM takes it (:func:`left_operand`),
    or, where the backend runs an A4W4 GEMM of M (mean) rows by an N-column weight as the
    W4A16 GEMM on a's quantized values (:meth:`Backend.left_values`), those values: bf16
    [X, K], the same products."""
    if isinstance(a, _Tensor) and recipe.activations == "mxfp4" and backend.left_values(m, n, recipe, a.device):
        return backend.token_values(a, left_recipe(recipe))
    return left_operand(a, recipe)


def flatten_batch(a: Operand) -> Operand:
    """a [..., M, K] (a float tensor, or an MXTensor along its last axis) -> [M', K]."""
    if isinstance(a, _Tensor):
        return a if a.dim() == 2 else a.reshape(math.prod(a.shape[:-1]), a.shape[-1])
    return a.rows()


def matmul(a: Operand, b: Operand, recipe: QuantRecipe) -> torch.Tensor:
    """``a @ b`` without autograd: a [..., M, K], b [K, N] -> [..., M, N] in a's dtype."""
    if a.__class__ is _Tensor and len(a.shape) == 2:  # (flatten_batch's first case, inline: the hot path)
        return gemm(a, b, recipe, a.dtype)
    a2 = flatten_batch(a)
    out = gemm(a2, b, recipe, a.dtype)
    return out if a2 is a else out.reshape(*a.shape[:-1], b.shape[1])
