"""The ``portable_mx::`` torch custom ops: the GEMM with its autograd rule, and the
rows-level quantize, dequantize and decompose that ``torch.compile`` traces as single ops.

Registered with ``torch.library.Library.define``/``impl`` (cheaper to call than
``@torch.library.custom_op``), each with a fake implementation, so that autograd,
``torch.compile`` (dynamo, AOTAutograd, inductor) and ``torch.library.opcheck`` compose
with them. Eager calls that need no gradient do not come here: the public ops and
:class:`~portable_mx.nn.MXLinear` call :mod:`portable_mx._dispatch` directly. A recipe
travels as its JSON (``QuantRecipe.model_dump_json()``), computed once per recipe object
by :func:`recipe_json`, which dynamo treats as a constant.

``portable_mx::mm(Tensor a, Tensor b, Tensor[] a_parts, Tensor[] b_parts, str recipe,
str a_recipe, str b_recipe, Tensor? bias=None) -> Tensor``
    The forward GEMM ``a @ b`` (+ ``bias``): a float ``[M, K]``, b float ``[K, N]``
    (fp32, bf16, fp16 or fp64; b's dtype may differ from a's: it is quantized from its
    own values), bias None or ``[N]`` in a's dtype, one device; returns ``[M, N]`` in
    a's dtype (b's gradient in b's). An operand with empty parts is quantized inside
    with ``recipe`` (a along K, its last axis, or rounded to 16 bits for W4A16 recipes;
    b along K, axis 0). Non-empty parts are the tensors of that operand's MXTensor
    quantized along K (:meth:`MXTensor.parts`; rows layout, a: ``[M, ...]``, b:
    ``[N, ...]``) with ``a_recipe`` / ``b_recipe`` the JSON of its recipe; the forward
    then uses those bytes and ignores the operand's values, which only serve the
    backward as its high-precision copy. Exact up to fp32 accumulation order: the fp32
    product of the dequantized operands plus the bias (added in fp32, in the GEMM's
    epilogue where the backend has one), rounded once to a's dtype.
    Differentiable in a, b and bias (never in the parts).

``portable_mx::grad_mm(Tensor a, Tensor b, str recipe, bool quantized) -> Tensor``
    One backward GEMM ``a @ b`` (a ``[M, K]``, b ``[K, N]``, float, one device) in
    a's dtype. ``quantized``: the GEMM of ``recipe``, a quantized along its last axis (or
    rounded to 16 bits for W4A16) and b along axis 0, each along the reduction axis;
    exact up to fp32 accumulation order. Otherwise high precision: on the CPU an fp32
    matmul (fp64 for fp64 tensors) under ``float32_matmul_precision("highest")``,
    rounded once to a's dtype; on a GPU ``a @ b`` in a's dtype (b cast to it) under
    torch's CUDA matmul settings. Its own backward raises: double backward is not
    supported (``create_graph=True`` works; differentiating the resulting gradient
    raises).

``portable_mx::quantize(Tensor x, str recipe) -> Tensor[]``
    x float ``[R, K]`` quantized along K: the parts of the MXTensor (rows layout).

``portable_mx::dequantize(Tensor[] parts, str recipe, SymInt k, ScalarType dtype) -> Tensor``
    The rows-layout MXTensor of those parts (K = ``k``) -> ``[R, k]`` in ``dtype``.

``portable_mx::decompose(Tensor x, str recipe, str definition, bool full) -> Tensor[]``
    x float ``[R, K]`` quantized along K and decomposed (:func:`portable_mx.decompose`),
    the rows-layout Decomposition as [beta fp32 ``[R, Kp/32]``, the counts int32
    ``[2, R, Kp/32]`` (:data:`DECOMPOSE_COUNTS`), the energies float64 ``[5, R, Kp/32]``
    (:data:`DECOMPOSE_ENERGIES`), non_finite int64 0-d] and, when ``full``, the element
    tensors fp32 ``[4, R, Kp]`` (:data:`DECOMPOSE_ELEMENTS`).

Backward of ``mm`` (straight-through: the quantizer's derivative is taken as 1; the bias's
gradient is ``dY.sum(0)``, as for ``y + bias``), with
``W`` = b ``[K, N]``, ``X`` = a ``[M, K]``, ``dY`` ``[M, N]``, and the operands' float
values (for an MXTensor operand: its dequantized values) as the high-precision copies
that MX training recipes re-quantize from:

- ``dX = dY @ W^T``: ``recipe.grad_input == "mxfp4"``: ``grad_mm(dY, W^T, quantized)``,
  which quantizes dY along N and W^T along N (each operand along its own reduction axis;
  with 16-bit ``activations`` dY is rounded to that format instead of quantized);
  ``"high"``: the high-precision matmul.
- ``dW = X^T @ dY``: quantized (X^T and dY along M) when ``recipe.grad_weight ==
  "mxfp4"`` and ``recipe.activations == "mxfp4"``, high precision otherwise (a W4A16
  recipe quantizes no activation).

The backward GEMMs use the call's ``recipe``, never an MXTensor operand's own recipe.
An MXTensor operand cannot require a gradient; it enters as its parts, its values stood
in for by a zero-stride placeholder of its shape; the backward dequantizes the parts (in
the operand's original dtype) where the other operand needs a gradient (dW needs a's
values, dX needs b's), so no dequantized copy is held from the forward to the backward.
"""

from __future__ import annotations

import functools
from typing import Union

import torch
from torch import Tensor

from . import _compile, _dispatch
from ._precision import HighestPrecision
from ._transforms import refuse_func_transforms
from .decompose import DEFINITIONS, Decomposition
from .format import BLOCK_SIZE
from .recipe import QuantRecipe
from .tensor import FLOAT_DTYPES, MXTensor, part_specs

Operand = Union[Tensor, MXTensor]
_is_compiling = torch.compiler.is_compiling

# ----------------------------------------------------------------------------- recipes as strings

_JSON: dict[int, tuple[QuantRecipe, str]] = {}


def recipe_json(recipe: QuantRecipe) -> str:
    """``recipe.model_dump_json()``, computed once per recipe object. While dynamo traces,
    it evaluates the JSON at trace time and keeps the string as a constant (no graph
    break); on a torch too old to trace portable_mx it raises, saying so (:mod:`._compile`)."""
    if _is_compiling():
        _compile.refuse_old_torch()
        return _constant_json(recipe)
    return _json_of(recipe)


def _json_of(recipe: QuantRecipe) -> str:
    hit = _JSON.get(id(recipe))
    if hit is not None and hit[0] is recipe:
        return hit[1]
    if len(_JSON) > 1024:  # recipes made per call: keep the memo bounded
        _JSON.clear()
    text = recipe.model_dump_json()
    _JSON[id(recipe)] = (recipe, text)
    return text


_constant_json = torch.compiler.assume_constant_result(_json_of)


@functools.lru_cache(maxsize=256)
def recipe_from_json(text: str) -> QuantRecipe:
    if not isinstance(text, str) or not text:
        raise ValueError("a recipe argument must be the JSON of a QuantRecipe (QuantRecipe.model_dump_json())")
    return QuantRecipe.model_validate_json(text)


# ----------------------------------------------------------------------------- checks


def _check_pair(a: Tensor, b: Tensor, op: str) -> None:
    """a [M, K] and b [K, N]: float, one device (b's dtype may differ from a's)."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor; got {type(t).__name__}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{op}: {name} must be float32, bfloat16, float16 or float64; got {t.dtype}")
        if t.dim() != 2:
            raise ValueError(f"{op}: {name} must be 2-D; got shape {tuple(t.shape)}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"{op}: inner dimensions differ: a is {tuple(a.shape)}, b is {tuple(b.shape)}")
    if a.device != b.device:
        raise ValueError(f"{op}: a and b must be on the same device; got {a.device} and {b.device}")


def _check_parts(parts: list[Tensor], recipe_text: str, rows: int, k: int, device: torch.device, name: str) -> None:
    """Parts of the MXTensor of operand ``name`` (``rows`` x ``k``, quantized along k)."""
    if not parts:
        if recipe_text:
            raise ValueError(f"mm: {name}_recipe is set but {name}_parts is empty")
        return
    recipe = recipe_from_json(recipe_text)
    spec = part_specs(recipe, rows, k)
    if len(parts) != len(spec):
        raise ValueError(
            f"mm: {name}_parts must be [{', '.join(s[0] for s in spec)}] for recipe "
            f"{recipe.describe()}; got {len(parts)} tensor(s)"
        )
    for p, (what, dtype, shape) in zip(parts, spec):
        if p.dtype != dtype or tuple(p.shape) != shape or p.device != device:
            raise ValueError(
                f"mm: {name}_parts {what} must be {dtype} {shape} on {device}; "
                f"got {p.dtype} {tuple(p.shape)} on {p.device}"
            )


def _check_mm(a, b, a_parts, b_parts, recipe, a_recipe, b_recipe, bias) -> None:
    _check_pair(a, b, "mm")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != b.shape[1] or bias.dtype != a.dtype
                             or bias.device != a.device):
        raise ValueError(f"mm: bias must be a {a.dtype} [{b.shape[1]}] on {a.device} (the output's columns, "
                         f"dtype and device); got {bias.dtype} {tuple(bias.shape)} on {bias.device}")
    recipe_from_json(recipe)
    _check_parts(a_parts, a_recipe, a.shape[0], a.shape[1], a.device, "a")
    _check_parts(b_parts, b_recipe, b.shape[1], b.shape[0], b.device, "b")


def _high_precision_mm(a: Tensor, b: Tensor) -> Tensor:
    """CPU: fp32 (fp64 for fp64 a) at the highest matmul precision, rounded once to a's
    dtype; GPU: ``a @ b`` in a's dtype (b cast to it). Never narrowed by the caller's
    autocast (the op's output is in a's dtype)."""
    if a.device.type == "cpu":
        dtype = torch.float64 if a.dtype == torch.float64 else torch.float32
        with HighestPrecision():
            return (a.to(dtype) @ b.to(dtype)).to(a.dtype)
    if b.dtype != a.dtype:  # (an autocast layer's fp32 weight against its bf16 dY)
        b = b.to(a.dtype)
    if torch.is_autocast_enabled(a.device.type):
        with torch.autocast(a.device.type, enabled=False):
            return a @ b
    return a @ b


# ----------------------------------------------------------------------------- the ops

_LIB = torch.library.Library("portable_mx", "DEF")
_LIB.define("mm(Tensor a, Tensor b, Tensor[] a_parts, Tensor[] b_parts, str recipe, str a_recipe, "
            "str b_recipe, Tensor? bias=None) -> Tensor")
_LIB.define("grad_mm(Tensor a, Tensor b, str recipe, bool quantized) -> Tensor")
_LIB.define("quantize(Tensor x, str recipe) -> Tensor[]")
_LIB.define("dequantize(Tensor[] parts, str recipe, SymInt k, ScalarType dtype) -> Tensor")
_LIB.define("decompose(Tensor x, str recipe, str definition, bool full) -> Tensor[]")


def _mm(a, b, a_parts, b_parts, recipe, a_recipe, b_recipe, bias=None):
    _check_mm(a, b, a_parts, b_parts, recipe, a_recipe, b_recipe, bias)
    (m, k), n = a.shape, b.shape[1]
    if m == 0 or n == 0 or k == 0:  # no product: zeros, or the bias's rows
        return _dispatch.gemm(a, b, recipe_from_json(recipe), a.dtype, bias)
    a_op = MXTensor.from_parts(a_parts, (m, k), a.dtype, 1, recipe_from_json(a_recipe)) if a_parts else a
    b_op = MXTensor.from_parts(b_parts, (k, n), b.dtype, 0, recipe_from_json(b_recipe)) if b_parts else b
    return _dispatch.gemm(a_op, b_op, recipe_from_json(recipe), a.dtype, bias)


def _mm_fake(a, b, a_parts, b_parts, recipe, a_recipe, b_recipe, bias=None):
    _check_mm(a, b, a_parts, b_parts, recipe, a_recipe, b_recipe, bias)
    return a.new_empty(a.shape[0], b.shape[1])


def _grad_mm(a, b, recipe, quantized):
    _check_pair(a, b, "grad_mm")
    r = recipe_from_json(recipe)
    (m, k), n = a.shape, b.shape[1]
    if m == 0 or n == 0 or k == 0:
        return a.new_zeros(m, n)
    if quantized:
        return _dispatch.gemm(a, b, r, a.dtype)
    return _high_precision_mm(a, b).contiguous()


def _grad_mm_fake(a, b, recipe, quantized):
    _check_pair(a, b, "grad_mm")
    recipe_from_json(recipe)
    return a.new_empty(a.shape[0], b.shape[1])


def _check_rows(x: Tensor) -> None:
    if not isinstance(x, Tensor) or x.dtype not in FLOAT_DTYPES or x.dim() != 2:
        raise ValueError(f"quantize: x must be a 2-D float tensor [R, K]; got {getattr(x, 'shape', x)!r}")


def _quantize(x, recipe):
    _check_rows(x)
    r = recipe_from_json(recipe)
    if x.numel() == 0:
        return MXTensor.zeros(x.shape, x.dtype, 1, r, x.device).parts()
    return _dispatch.quantize_rows(x, r).parts()


def _quantize_fake(x, recipe):
    _check_rows(x)
    return [x.new_empty(shape, dtype=dtype) for _, dtype, shape in part_specs(recipe_from_json(recipe), *x.shape)]


def _dequantize(parts, recipe, k, dtype):
    r = recipe_from_json(recipe)
    mx = MXTensor.from_parts(parts, (parts[0].shape[0], k), torch.float32, 1, r)
    return _dispatch.dequantize(mx, dtype).contiguous()


def _dequantize_fake(parts, recipe, k, dtype):
    recipe_from_json(recipe)
    return parts[0].new_empty(parts[0].shape[0], k, dtype=dtype)


DECOMPOSE_COUNTS = ("dead_count", "clip_count")
DECOMPOSE_ENERGIES = ("energy_scale", "energy_dead", "energy_grid", "energy_error", "energy_signal")
DECOMPOSE_ELEMENTS = ("dequantized", "scale_bias", "deadzone", "grid_noise")
"""The planes of the stacked tensors ``portable_mx::decompose`` returns, in order."""


def _stacked(ts: list[Tensor]) -> Tensor:
    """``torch.stack(ts)``, or the tensor ``ts`` are the planes of when a backend wrote them
    stacked (the Triton kernel does): no copy, and no output aliases another."""
    base = ts[0]._base
    if (base is not None and base.is_contiguous() and tuple(base.shape) == (len(ts), *ts[0].shape)
            and all(t._base is base and t.data_ptr() == base[i].data_ptr() for i, t in enumerate(ts))):
        return base
    return torch.stack(ts)


def _check_decompose(x, definition) -> None:
    if not isinstance(x, Tensor) or x.dtype not in FLOAT_DTYPES or x.dim() != 2:
        raise ValueError(f"decompose: x must be a 2-D float tensor [R, K]; got {getattr(x, 'shape', x)!r}")
    if definition not in DEFINITIONS:
        raise ValueError(f"decompose: definition must be one of {DEFINITIONS}; got {definition!r}")


def _decompose(x, recipe, definition, full):
    _check_decompose(x, definition)
    dec = _dispatch.decompose_rows(x, recipe_from_json(recipe), definition, full)
    out = [dec.beta.contiguous(), _stacked([getattr(dec, n) for n in DECOMPOSE_COUNTS]),
           _stacked([getattr(dec, n) for n in DECOMPOSE_ENERGIES]), dec.non_finite.reshape(()).to(torch.int64)]
    if full:
        out.append(_stacked([getattr(dec, n) for n in DECOMPOSE_ELEMENTS]))
    return out


def _decompose_fake(x, recipe, definition, full):
    _check_decompose(x, definition)
    recipe_from_json(recipe)
    r, k = x.shape
    kp = (k + BLOCK_SIZE - 1) // BLOCK_SIZE * BLOCK_SIZE
    nb = kp // BLOCK_SIZE
    out = [x.new_empty((r, nb), dtype=torch.float32), x.new_empty((len(DECOMPOSE_COUNTS), r, nb), dtype=torch.int32),
           x.new_empty((len(DECOMPOSE_ENERGIES), r, nb), dtype=torch.float64), x.new_empty((), dtype=torch.int64)]
    if full:
        out.append(x.new_empty((len(DECOMPOSE_ELEMENTS), r, kp), dtype=torch.float32))
    return out


for _name, _impl, _fake in (("mm", _mm, _mm_fake), ("grad_mm", _grad_mm, _grad_mm_fake),
                            ("quantize", _quantize, _quantize_fake),
                            ("dequantize", _dequantize, _dequantize_fake),
                            ("decompose", _decompose, _decompose_fake)):
    _LIB.impl(_name, _impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"portable_mx::{_name}", _fake, lib=_LIB)


def _is_placeholder(t: Tensor, parts: list) -> bool:
    """Whether ``t`` is an MXTensor operand's :func:`placeholder` (its parts hold its
    values), not high-precision values given beside parts (MXLinear's cached weight)."""
    return bool(parts) and all(stride == 0 for stride in t.stride())


def _mm_setup_context(ctx, inputs, output) -> None:
    a, b, a_parts, b_parts, recipe, a_json, b_json = inputs[:7]
    # each operand only for the other's gradient (dA = dY B^T, dB = A^T dY): a frozen
    # layer whose input needs a gradient keeps its weight, not its input, as nn.Linear does.
    # An MXTensor operand (a placeholder beside its parts) keeps its parts, dequantized in
    # the backward: its dequantized copy was made in the forward and held until then
    # (172 MB for a 4096 x 11008 fp32 weight, against 23 MB of parts; audit of 2026-11-28)
    keep = (ctx.needs_input_grad[1], ctx.needs_input_grad[0])
    ctx.mx = tuple((t.shape, t.dtype, js, len(parts)) if k and _is_placeholder(t, parts) else None
                   for t, parts, js, k in ((a, a_parts, a_json, keep[0]), (b, b_parts, b_json, keep[1])))
    ctx.save_for_backward(a if keep[0] and ctx.mx[0] is None else None, b if keep[1] and ctx.mx[1] is None else None,
                          *(a_parts if ctx.mx[0] else ()), *(b_parts if ctx.mx[1] else ()))
    ctx.recipe = recipe
    ctx.num_parts = (len(a_parts), len(b_parts))
    # the dispatcher drops a bias of None from the arguments autograd sees (it is the
    # schema's default): the backward returns a gradient for the bias only when there is one
    ctx.biased = inputs[7] is not None


def _mm_backward(ctx, grad: Tensor):
    a, b, *parts = ctx.saved_tensors
    if ctx.mx[0] is not None:  # a [M, K] along K: its rows
        shape, dtype, js, n = ctx.mx[0]
        a, parts = torch.ops.portable_mx.dequantize(parts[:n], js, shape[1], dtype), parts[n:]
    if ctx.mx[1] is not None:  # b [K, N] along K: rows [N, K]
        shape, dtype, js, n = ctx.mx[1]
        b = torch.ops.portable_mx.dequantize(parts[:n], js, shape[0], dtype).T
    recipe = recipe_from_json(ctx.recipe)
    grad_a = grad_b = None
    if ctx.needs_input_grad[0]:
        grad_a = torch.ops.portable_mx.grad_mm(grad, b.T, ctx.recipe, recipe.grad_input == "mxfp4")
    if ctx.needs_input_grad[1]:
        quantized = recipe.grad_weight == "mxfp4" and recipe.quantizes_activations
        grad_b = torch.ops.portable_mx.grad_mm(a.T, grad, ctx.recipe, quantized)
    no_grads = [[None] * n for n in ctx.num_parts]  # the parts are never differentiated
    if not ctx.biased:
        return grad_a, grad_b, *no_grads, None, None, None
    return grad_a, grad_b, *no_grads, None, None, None, grad.sum(0) if ctx.needs_input_grad[-1] else None


torch.library.register_autograd("portable_mx::mm", _mm_backward, setup_context=_mm_setup_context, lib=_LIB)


def _grad_mm_setup_context(ctx, inputs, output) -> None:
    pass


def _grad_mm_double_backward(ctx, grad: Tensor):
    raise RuntimeError(
        "double backward through the MXFP4 GEMM is not supported: portable_mx::mm has a "
        "straight-through first derivative only (a gradient of a gradient, e.g. a gradient "
        "penalty, through pmx.matmul or MXLinear). Compute that term with a high-precision "
        "model, or detach it."
    )


torch.library.register_autograd("portable_mx::grad_mm", _grad_mm_double_backward,
                                setup_context=_grad_mm_setup_context, lib=_LIB)


# ----------------------------------------------------------------------------- the op paths


def quantize(x: Tensor, recipe: QuantRecipe, axis: int) -> MXTensor:
    """:func:`portable_mx.quantize` as one ``portable_mx::quantize`` op (what a compiled
    graph holds): x non-empty, validated, ``axis`` >= 0."""
    rows = _dispatch.to_rows(x, axis)
    parts = torch.ops.portable_mx.quantize(rows, recipe_json(recipe))
    out = MXTensor.from_parts(parts, rows.shape, x.dtype, 1, recipe)
    return out if rows is x else out.unrows(x.shape, axis)


def dequantize(mx: MXTensor, dtype: torch.dtype) -> Tensor:
    """:func:`portable_mx.dequantize` as one ``portable_mx::dequantize`` op: [*shape] in dtype."""
    rows = mx.rows()
    q = torch.ops.portable_mx.dequantize(rows.parts(), recipe_json(mx.recipe), mx.k, dtype)
    return q if rows is mx else q.reshape(*mx.lead_shape, mx.k).movedim(-1, mx.axis)


def decompose(x: Tensor, recipe: QuantRecipe, axis: int, definition: str, full: bool) -> Decomposition:
    """:func:`portable_mx.decompose` as one ``portable_mx::decompose`` op (what a compiled
    graph holds): x validated, ``axis`` >= 0; the Decomposition in x's layout."""
    rows = _dispatch.to_rows(x, axis)
    parts = torch.ops.portable_mx.decompose(rows, recipe_json(recipe), definition, full)
    tensors = {"beta": parts[0], **dict(zip(DECOMPOSE_COUNTS, parts[1].unbind(0))),
               **dict(zip(DECOMPOSE_ENERGIES, parts[2].unbind(0)))}
    if full:
        tensors.update(zip(DECOMPOSE_ELEMENTS, parts[4].unbind(0)))
    dec = Decomposition(definition=definition, recipe=recipe, axis=1, non_finite=parts[3], **tensors)
    return _dispatch.decomposition_layout(dec, x.shape, axis)


def _op_operand(t: Operand) -> tuple[Tensor, list[Tensor], str]:
    """(values, parts, recipe JSON) of one ``mm`` or ``grouped_mm`` operand. An MXTensor's
    values are a placeholder of its shape and dtype that the forward never reads (its
    parts hold them; the backward dequantizes them where it needs them)."""
    if isinstance(t, Tensor):
        return t, [], ""
    rows = t.rows()
    parts = [p.detach() if p.requires_grad else p for p in rows.parts()]
    return placeholder(t.shape, t.dtype, t.device), parts, recipe_json(t.recipe)


def placeholder(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A tensor of ``shape`` and ``dtype`` that nothing reads (an MXTensor operand's
    values where its parts hold them), one element of memory."""
    return torch.zeros((), dtype=dtype, device=device).expand(shape)


def mx_matmul(a: Operand, b: Operand, recipe: QuantRecipe) -> Tensor:
    """MXFP4 ``a @ b`` through the ``portable_mx::mm`` op, differentiable in the float
    operands (see the module doc for the backward GEMMs): what :func:`portable_mx.matmul`
    runs when a gradient is needed or when compiled. Inputs must be validated: a float
    ``[..., M, K]`` (leading dims flattened; the gradient comes back in a's shape and
    dtype) or an MXTensor along its last axis; b float ``[K, N]`` or an MXTensor along
    axis 0. Returns ``[..., M, N]`` in a's dtype. An MXTensor operand enters as its parts
    (its values a placeholder); the backward dequantizes them as the high-precision copy
    when the other operand needs a gradient."""
    if not torch.compiler.is_compiling():
        refuse_func_transforms("matmul")
    a2 = _dispatch.flatten_batch(a)
    a_hp, a_parts, a_json = _op_operand(a2)
    b_hp, b_parts, b_json = _op_operand(b)
    out = torch.ops.portable_mx.mm(a_hp, b_hp, a_parts, b_parts, recipe_json(recipe), a_json, b_json)
    return out if a2 is a else out.reshape(*a.shape[:-1], b.shape[1])
