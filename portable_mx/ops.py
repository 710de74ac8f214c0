"""The public ops: validate inputs once, move the quantized axis last, flatten to rows,
and hand the canonical 2-D problem to the backend the registry selects."""

from __future__ import annotations

import math
from dataclasses import replace
from collections.abc import Mapping
from typing import Any, Optional, Union

import torch

from . import registry
from .decompose import DEFINITIONS, Decomposition, decompose_blocks
from .format import BLOCK_SIZE
from .recipe import DEFAULT_RECIPE, QuantRecipe
from .tensor import MXTensor

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
Operand = Union[torch.Tensor, MXTensor]


# ----------------------------------------------------------------------------- validation


def _recipe(recipe: Any) -> QuantRecipe:
    if recipe is None:
        return DEFAULT_RECIPE
    if isinstance(recipe, QuantRecipe):
        return recipe
    if isinstance(recipe, Mapping):
        return QuantRecipe(**recipe)
    raise TypeError(f"recipe must be a QuantRecipe, a mapping of its fields or None; got {type(recipe).__name__}")


def _check_float_tensor(x: Any, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or an MXTensor; got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be a floating-point tensor (float32, bfloat16, float16 or float64); got {x.dtype}"
        )
    return x


def _normalize_axis(axis: int, ndim: int, name: str = "axis") -> int:
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise TypeError(f"{name} must be an int; got {type(axis).__name__}")
    if not -ndim <= axis < ndim:
        raise ValueError(f"{name}={axis} is out of range for a tensor with {ndim} dims")
    return axis % ndim


def _prepare(op: str, x: Any, recipe: Any, axis: Any) -> tuple[torch.Tensor, QuantRecipe, int]:
    """Validate the (x, recipe, axis) of quantize/decompose; return x, the recipe, axis >= 0."""
    recipe = _recipe(recipe)
    x = _check_float_tensor(x, "x")
    if x.dim() == 0:
        raise ValueError(f"{op} needs a tensor with at least one dimension; got a 0-d tensor")
    return x, recipe, _normalize_axis(axis, x.dim())


def _padded(k: int) -> int:
    return -(-k // BLOCK_SIZE) * BLOCK_SIZE


# ----------------------------------------------------------------------------- layouts


def _to_rows(x: torch.Tensor, axis: int) -> torch.Tensor:
    """x with ``axis`` moved last, flattened to [R, K] (a copy only when needed)."""
    xm = x.movedim(axis, -1)
    return xm.reshape(math.prod(xm.shape[:-1]), xm.shape[-1])


def _from_rows(t: torch.Tensor, lead: torch.Size, k: int, axis: int) -> torch.Tensor:
    """[R, Kp] rows -> crop to K, restore the lead dims and move the axis back."""
    return t[:, :k].reshape(*lead, k).movedim(-1, axis)


def _mx_rows(mx: MXTensor) -> MXTensor:
    """The (R, K), axis 1 view of an MXTensor that backends work on."""
    r = math.prod(mx.lead_shape)

    def flat(t: Optional[torch.Tensor], extra: int) -> Optional[torch.Tensor]:
        return None if t is None else t.reshape(r, *t.shape[t.dim() - extra :])

    return MXTensor(
        qdata=flat(mx.qdata, 1),
        scales=flat(mx.scales, 1),
        shape=torch.Size((r, mx.k)),
        dtype=mx.dtype,
        axis=1,
        recipe=mx.recipe,
        macro_scales=flat(mx.macro_scales, 1),
        outlier_values=flat(mx.outlier_values, 2),
        outlier_indices=flat(mx.outlier_indices, 2),
    )


def _mx_from_rows(rows: MXTensor, shape: torch.Size, axis: int) -> MXTensor:
    lead = torch.Size(shape[:axis] + shape[axis + 1 :])

    def unflat(t: Optional[torch.Tensor], extra: int) -> Optional[torch.Tensor]:
        return None if t is None else t.reshape(*lead, *t.shape[t.dim() - extra :])

    return MXTensor(
        qdata=unflat(rows.qdata, 1),
        scales=unflat(rows.scales, 1),
        shape=torch.Size(shape),
        dtype=rows.dtype,
        axis=axis,
        recipe=rows.recipe,
        macro_scales=unflat(rows.macro_scales, 1),
        outlier_values=unflat(rows.outlier_values, 2),
        outlier_indices=unflat(rows.outlier_indices, 2),
    )


def _empty_mx(x: torch.Tensor, recipe: QuantRecipe) -> MXTensor:
    """The rows-layout MXTensor of an empty x [R, K] (R = 0 or K = 0)."""
    r, k = x.shape
    kp = _padded(k)
    nb = kp // BLOCK_SIZE
    u8 = dict(dtype=torch.uint8, device=x.device)
    macro = None
    if recipe.macro_block is not None:
        macro = torch.ones(r, -(-kp // recipe.macro_block), dtype=torch.float32, device=x.device)
    ov = oi = None
    if recipe.outliers_per_block:
        ov = torch.zeros(r, nb, recipe.outliers_per_block, dtype=torch.bfloat16, device=x.device)
        oi = torch.zeros(r, nb, recipe.outliers_per_block, **u8)
    return MXTensor(
        qdata=torch.zeros(r, kp // 2, **u8),
        scales=torch.zeros(r, nb, **u8),
        shape=torch.Size((r, k)),
        dtype=x.dtype,
        axis=1,
        recipe=recipe,
        macro_scales=macro,
        outlier_values=ov,
        outlier_indices=oi,
    )


# ----------------------------------------------------------------------------- ops


def quantize(x: torch.Tensor, recipe: Optional[QuantRecipe] = None, *, axis: int = -1) -> MXTensor:
    """Quantize a float tensor to MXFP4 along ``axis`` (32-element blocks along it).

    x: float32, bfloat16, float16 or float64 (float64 is rounded to fp32 first), at least
    1-D, any device. The axis is zero-padded to a multiple of 32; NaN/Inf blocks get the
    NaN scale. Returns an :class:`MXTensor`; its bytes are identical on every backend.
    """
    x, recipe, axis = _prepare("quantize", x, recipe, axis)
    rows = _to_rows(x, axis)
    if rows.numel() == 0:
        out = _empty_mx(rows, recipe)
    else:
        out = registry.select("quantize", x.device).quantize(rows, recipe)
    return _mx_from_rows(out, x.shape, axis)


def dequantize(mx: MXTensor, *, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The values an MXTensor represents, shaped like the original tensor.

    Returned in ``dtype`` (default: the original dtype). Values are decoded in fp32,
    where every MXFP4 value is exact except those beyond fp32's range (a block whose amax
    is within 1.5x of the fp32 maximum can round up to 2**128), which become +-inf; a
    narrower dtype (bf16, fp16) rounds each value once. NaN-scale blocks decode to NaN.
    """
    if not isinstance(mx, MXTensor):
        raise TypeError(f"dequantize expects an MXTensor; got {type(mx).__name__}")
    dtype = mx.dtype if dtype is None else dtype
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be one of {FLOAT_DTYPES}; got {dtype}")
    rows = _mx_rows(mx)
    if rows.qdata.numel() == 0:
        return torch.zeros(mx.shape, dtype=dtype, device=mx.device)
    q = registry.select("dequantize", mx.device).dequantize(rows, dtype)
    return _from_rows(q, mx.lead_shape, mx.k, mx.axis)


def decompose(
    x: torch.Tensor,
    recipe: Optional[QuantRecipe] = None,
    *,
    axis: int = -1,
    definition: str = "gain",
    full: bool = True,
) -> Decomposition:
    """Split the MXFP4 error Q(x) - x into scale bias, deadzone and grid noise.

    x: float tensor (as for :func:`quantize`); ``definition`` "gain" (orthogonal,
    energy-additive) or "counterfactual" (numerics.md section 3). Q is the quantizer of
    ``recipe``, corrections included. Element tensors come back shaped like x in fp32
    (omitted when ``full=False``); per-block statistics are ``[*lead, n_blocks]``.
    Exact: scale_bias + deadzone + grid_noise == dequantized - x to fp32 rounding.
    x must be finite; checking it does not synchronise here: blocks holding NaN/Inf get
    NaN statistics, and the whole-tensor figures of the result (``totals``, ``shares``,
    ``relative_mse``, ``summary``) raise ValueError.
    """
    x, recipe, axis = _prepare("decompose", x, recipe, axis)
    if definition not in DEFINITIONS:
        raise ValueError(f"definition must be one of {DEFINITIONS}; got {definition!r}")
    rows = _to_rows(x, axis)
    lead = torch.Size(x.shape[:axis] + x.shape[axis + 1 :])
    if rows.numel() == 0:
        r, k = rows.shape
        blocks = torch.zeros(r, _padded(k) // BLOCK_SIZE, BLOCK_SIZE, device=x.device)
        stats = blocks.sum(-1)
        dec = decompose_blocks(
            blocks, blocks, definition=definition, recipe=recipe, clip_count=stats,
            rest_amax=stats, outlier_mask=None, full=full,
        )
    else:
        dec = registry.select("decompose", x.device).decompose(rows, recipe, definition, full)
    nb = _padded(x.shape[axis]) // BLOCK_SIZE
    dec = dec.map_tensors(
        block_fn=lambda t: t.reshape(*lead, nb),
        element_fn=lambda t: _from_rows(t, lead, x.shape[axis], axis),
    )
    return replace(dec, axis=axis, num_elements=x.numel())


def _operand_info(t: Operand, name: str) -> tuple[torch.dtype, torch.device, torch.Size]:
    if isinstance(t, MXTensor):
        return t.dtype, t.device, t.shape
    t = _check_float_tensor(t, name)
    return t.dtype, t.device, t.shape


def matmul(a: Operand, b: Operand, recipe: Optional[QuantRecipe] = None) -> torch.Tensor:
    """``a @ b`` on MXFP4 operands with fp32 accumulation.

    a: float ``[..., M, K]`` (leading dims are batch, flattened) or an MXTensor quantized
    along its last axis; b: float ``[K, N]`` or an MXTensor of shape (K, N) quantized along
    axis 0 (the weight). Float operands are quantized with ``recipe`` (MXTensor operands
    keep theirs); with ``recipe.activations`` "bf16"/"fp16" a float ``a`` is rounded to that
    format instead (W4A16). Returns ``[..., M, N]`` in a's (original) dtype.

    Exact up to accumulation order: the result is the fp32-accumulated product of the
    dequantized operands, rounded once to a's dtype. Under autograd the backward GEMMs
    follow ``recipe.grad_input`` / ``recipe.grad_weight`` (see :mod:`portable_mx.nn`).
    """
    recipe = _recipe(recipe)
    a_dtype, a_dev, a_shape = _operand_info(a, "a")
    b_dtype, b_dev, b_shape = _operand_info(b, "b")
    if len(a_shape) < 2:
        raise ValueError(f"a must have at least 2 dims [..., M, K]; got shape {tuple(a_shape)}")
    if len(b_shape) != 2:
        raise ValueError(f"b must be 2-D [K, N]; got shape {tuple(b_shape)}")
    if a_shape[-1] != b_shape[0]:
        raise ValueError(
            f"inner dimensions differ: a is {tuple(a_shape)} (K={a_shape[-1]}), b is {tuple(b_shape)} (K={b_shape[0]})"
        )
    if a_dtype != b_dtype:
        raise TypeError(f"a and b must have the same dtype; got {a_dtype} and {b_dtype}")
    if a_dev != b_dev:
        raise ValueError(f"a and b must be on the same device; got {a_dev} and {b_dev}")
    if isinstance(a, MXTensor) and a.axis != len(a_shape) - 1:
        raise ValueError(f"an MXTensor a must be quantized along its last axis (K); it is along axis {a.axis}")
    if isinstance(b, MXTensor) and b.axis != 0:
        raise ValueError(f"an MXTensor b must be quantized along axis 0 (K); it is along axis {b.axis}")

    needs_grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (a, b)
    )
    if needs_grad:
        from .nn import mx_matmul

        return mx_matmul(a, b, recipe)
    out_shape = (*a_shape[:-1], b_shape[1])
    return gemm(_flatten_batch(a), b, recipe).to(a_dtype).reshape(out_shape)


def _flatten_batch(a: Operand) -> Operand:
    """a [..., M, K] (tensor or MXTensor along its last axis) -> [M', K]."""
    if isinstance(a, MXTensor):
        return a if len(a.shape) == 2 else _mx_rows(a)
    return a.reshape(math.prod(a.shape[:-1]), a.shape[-1])


def _as_mx(t: Operand, recipe: QuantRecipe, axis: int) -> MXTensor:
    return t if isinstance(t, MXTensor) else quantize(t, recipe, axis=axis)


def left_operand(a: Operand, recipe: QuantRecipe) -> Union[MXTensor, torch.Tensor]:
    """The left GEMM operand as a backend takes it: an MXTensor quantized along the last
    axis, or, for a float ``a`` with 16-bit ``recipe.activations``, ``a`` rounded to
    that format (round to nearest even)."""
    if isinstance(a, MXTensor) or recipe.quantizes_activations:
        return _as_mx(a, recipe, -1)
    return a.to(torch.bfloat16 if recipe.activations == "bf16" else torch.float16)


def gemm(a: Operand, b: Operand, recipe: QuantRecipe) -> torch.Tensor:
    """The forward GEMM without autograd: fp32 ``[M, N]`` for a ``[M, K]`` (float or
    MXTensor along axis 1) and b ``[K, N]`` (float or MXTensor along axis 0), quantized
    per ``recipe`` (see :func:`matmul`). Inputs must already be validated."""
    m, k, n = a.shape[0], a.shape[-1], b.shape[1]
    if m == 0 or k == 0 or n == 0:
        return torch.zeros(m, n, dtype=torch.float32, device=b.device)
    a_op = left_operand(a, recipe)
    b_rows = _mx_rows(_as_mx(b, recipe, 0))
    if isinstance(a_op, MXTensor):
        a_op = _mx_rows(a_op)
    return registry.select("matmul", b_rows.device).matmul(a_op, b_rows)


# ----------------------------------------------------------------------------- discovery


def local_devices() -> list[torch.device]:
    """The CPU and every visible CUDA/ROCm device."""
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices += [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return devices


def backends() -> list[dict[str, Any]]:
    """Registered backends, highest priority first: name, priority, ops, and which local
    devices each serves (with the reason where it does not)."""
    out = []
    for b in registry.registered():
        serves = {}
        for d in local_devices():
            reason = b.unavailable_reason(d)
            serves[str(d)] = "yes" if reason is None else f"no: {reason}"
        out.append({"name": b.name, "priority": b.priority, "ops": sorted(b.ops), "devices": serves})
    return out
