"""The public ops: validate inputs once, then hand the problem down.

Eager calls that need no gradient go straight to :mod:`portable_mx._dispatch` (the rows
view and the selected backend). ``matmul`` with an input that requires a gradient goes
through the ``portable_mx::mm`` custom op and its autograd rule
(:mod:`portable_mx._custom_ops`), and under ``torch.compile`` every op is expressed as
its custom op, so that a compiled graph holds one node per call (no graph break).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, Optional, Union

import torch

from . import _custom_ops, _dispatch, registry
from ._flags import as_bool, exact_int
from ._sharding import is_dtensor
from ._transforms import refuse_func_transforms
from .decompose import DEFINITIONS, Decomposition
from .recipe import DEFAULT_RECIPE, VALIDATED, QuantRecipe, validated
from .tensor import FLOAT_DTYPES, MXTensor

Operand = Union[torch.Tensor, MXTensor]

# compatibility names for code written against the old ops module (the tuner, tests)
left_operand = _dispatch.left_operand
_mx_rows = MXTensor.rows

_is_compiling = torch.compiler.is_compiling
_Tensor = torch.Tensor


# ----------------------------------------------------------------------------- validation


def _recipe(recipe: Any) -> QuantRecipe:
    """The recipe of a public call: None -> the default, a mapping -> ``QuantRecipe(**it)``,
    a QuantRecipe -> checked once per object (:func:`portable_mx.recipe.validated`: one
    built around the constructor, e.g. by ``BaseModel.model_construct``, is refused here).
    Under ``torch.compile`` a QuantRecipe passes as it is: the custom op it reaches
    re-validates its JSON when the graph is traced."""
    if recipe is None:
        return DEFAULT_RECIPE
    if isinstance(recipe, QuantRecipe):
        return recipe if _is_compiling() else validated(recipe)
    if isinstance(recipe, Mapping):
        return QuantRecipe(**recipe)
    raise TypeError(f"recipe must be a QuantRecipe, a mapping of its fields or None; got {type(recipe).__name__}")


def _check_float_tensor(x: Any, name: str, mx_ok: bool = True) -> torch.Tensor:
    if not isinstance(x, _Tensor):
        if isinstance(x, MXTensor) and not mx_ok:
            raise TypeError(f"{name} is already an MXTensor: this op takes a float torch.Tensor "
                            "(pmx.dequantize(mx) gives its values)")
        raise TypeError(f"{name} must be a torch.Tensor{' or an MXTensor' if mx_ok else ''}; got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be a floating-point tensor (float32, bfloat16, float16 or float64); got {x.dtype}"
        )
    if x.layout is not _STRIDED:
        raise TypeError(dense_error(name, x))
    refuse_distributed(name, x)
    return x


_STRIDED = torch.strided


def refuse_distributed(name: str, x: Any) -> None:
    """Raise for a DTensor (an FSDP2-sharded parameter, a tensor-parallel activation): the
    ops work on a tensor's local bytes, and torch's DTensor drops some of the integer ops
    the scale and code arithmetic is made of (``<<`` returned its input, torch 2.13), so its
    quantized bytes were wrong without an error. Other subclasses pass."""
    if is_dtensor(x):
        raise TypeError(f"{name} is a DTensor (sharded or replicated by torch.distributed): pass "
                        f"{name}.full_tensor() (or the module's state dict gathered with torch.distributed."
                        "checkpoint.state_dict.get_model_state_dict(..., options=StateDictOptions("
                        "full_state_dict=True))), or call the op on the unsharded module inside its forward")


def dense_error(name: str, x: torch.Tensor) -> str:
    """The message refusing a sparse (or other non-strided) tensor ``x``."""
    return f"{name} must be a dense (strided) tensor; got layout {x.layout} ({name}.to_dense() gives one)"


def _normalize_axis(axis: int, ndim: int, name: str = "axis") -> int:
    if axis.__class__ is not int:  # numpy's integers too, never a bool or a tensor
        index = exact_int(axis)
        if index is None:
            raise TypeError(f"{name} must be an int; got {type(axis).__name__}")
        axis = index
    if not -ndim <= axis < ndim:
        raise ValueError(f"{name}={axis} is out of range for a tensor with {ndim} dims")
    return axis % ndim


def _prepare(op: str, x: Any, recipe: Any, axis: Any, compiling: bool) -> tuple[torch.Tensor, QuantRecipe, int]:
    """Validate the (x, recipe, axis) of quantize/decompose; return x, the recipe, axis >= 0."""
    if recipe is None:
        recipe = DEFAULT_RECIPE
    elif compiling or id(recipe) not in VALIDATED:  # a recipe checked before costs one lookup
        recipe = _recipe(recipe)
    x = _check_float_tensor(x, "x", mx_ok=False)
    nd = x.dim()
    if nd == 0:
        raise ValueError(f"{op} needs a tensor with at least one dimension; got a 0-d tensor")
    return x, recipe, _normalize_axis(axis, nd)


# ----------------------------------------------------------------------------- ops


def quantize(x: torch.Tensor, recipe: Optional[QuantRecipe] = None, *, axis: int = -1) -> MXTensor:
    """Quantize a float tensor to MXFP4 along ``axis`` (32-element blocks along it).

    x: float32, bfloat16, float16 or float64 (float64 is rounded to fp32 first), at least
    1-D, any device. The axis is zero-padded to a multiple of 32; NaN/Inf blocks get the
    NaN scale. Returns an :class:`MXTensor`; its bytes are identical on every backend.
    Not differentiable: the MXTensor holds bytes, no autograd history (x's gradient does
    not flow through it; :func:`matmul` and ``nn.MXLinear`` quantize with a
    straight-through gradient).
    """
    compiling = _is_compiling()
    x, recipe, axis = _prepare("quantize", x, recipe, axis, compiling)
    refuse_func_transforms("quantize", x)  # (compiled too: dynamo traces the check, no graph break)
    if compiling:
        if not x.numel():
            return MXTensor.zeros(x.shape, x.dtype, axis, recipe, x.device)
        return _custom_ops.quantize(x, recipe, axis)
    if not x.numel():
        return MXTensor.zeros(x.shape, x.dtype, axis, recipe, x.device)
    return _dispatch.quantize(x, recipe, axis)


def dequantize(mx: MXTensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The values an MXTensor represents, shaped like the original tensor.

    Returned in ``dtype`` (default: the original dtype). Values are decoded in fp32,
    where every MXFP4 value is exact except those beyond fp32's range (a block whose amax
    is within 1.5x of the fp32 maximum can round up to 2**128), which become +-inf; a
    narrower dtype (bf16, fp16) rounds each value once, and a value past its maximum
    becomes +-inf there: fp16 input quantized under rceil, even or ceil (which round the
    scale up) dequantizes to inf in fp16 from |x| of about 57344 (60000 -> 65536; floor
    gives 49152). NaN-scale blocks decode to NaN.
    The result requires no gradient (see :func:`quantize`).
    """
    if not isinstance(mx, MXTensor):
        raise TypeError(f"dequantize expects an MXTensor; got {type(mx).__name__}")
    if _is_compiling():
        refuse_func_transforms("dequantize")  # (eager: MXTensor.dequantize below refuses)
        dtype = mx.dtype if dtype is None else dtype
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype must be one of {FLOAT_DTYPES}; got {dtype}")
        if mx.qdata.numel() == 0:
            return torch.zeros(mx.shape, dtype=dtype, device=mx.device)
        return _custom_ops.dequantize(mx, dtype)
    return mx.dequantize(dtype)  # (refuses torch.func transforms)


def decompose(
    x: torch.Tensor,
    recipe: Optional[QuantRecipe] = None,
    *,
    axis: int = -1,
    definition: str = "gain",
    full: bool = True,
) -> Decomposition:
    """Split the MXFP4 error Q(x) - x into scale bias, deadzone and grid noise.

    x: float tensor (as for :func:`quantize`), blocked along ``axis`` (an int, any of x's
    dims); ``definition`` "gain" (orthogonal, energy-additive) or "counterfactual"
    (numerics.md section 3; its Q* rounds to nearest, so with stochastic rounding its
    scale bias holds that rounding's noise too: a warning says so). Q is the quantizer of
    ``recipe``, corrections included. Element tensors come back shaped like x in fp32
    (omitted when ``full=False``, a bool); per-block statistics are ``[*lead, n_blocks]``,
    ``lead`` being x's shape without ``axis`` and the blocks last whatever the axis.
    Identical on every backend: Q, the deadzone and the counts; beta, the energies and
    the element tensors to fp32 rounding (a Triton kernel's statistics can differ in
    their last bits between ``full=True`` and ``False``).
    Exact: scale_bias + deadzone + grid_noise == dequantized - x to fp32 rounding.
    x must be finite; checking it does not synchronise here: blocks holding NaN/Inf get
    NaN statistics, and the whole-tensor figures of the result (``totals``, ``shares``,
    ``relative_mse``, ``summary``) raise ValueError. The statistics are right for every
    finite x from the subnormals up (per-block energies are float64), save blocks whose Q
    is inf (rceil/even/ceil scales round a largest |x| >= 3.5 * 2**126 to 2**128, and
    stochastic rounding can from 3 * 2**126; macro blocks whose largest |x| is at least
    about 3.39e38 give inf from about 2.84e38; see :mod:`portable_mx.decompose`). float64
    x is decomposed as the fp32 values it rounds to, as it is quantized: a value below
    fp32's range (|x| <= 2**-150) counts as 0 (no signal, no error, not deadzoned), one
    that rounds past it (|x| >= 2**128 - 2**103, half an ulp above fp32's maximum) is Inf
    there (the whole-tensor figures raise).
    Under ``torch.compile`` (``fullgraph=True`` too) the
    call traces as one ``portable_mx::decompose`` op; the whole-tensor figures read the
    device, so call them outside the compiled function. A measurement, not a
    differentiable op: x is detached, and no result requires grad on any backend.
    """
    x, recipe, axis = _prepare("decompose", x, recipe, axis, _is_compiling())
    if definition not in DEFINITIONS:
        raise ValueError(f"definition must be one of {DEFINITIONS}; got {definition!r}")
    full = as_bool(full, "full")  # (numpy's bool too: its type's name is 'bool' in numpy 2, 'bool_' before)
    if definition == "counterfactual" and recipe.rounding == "stochastic" and not _is_compiling():
        warnings.warn("decompose(definition='counterfactual') rounds Q* = s* g(x / s*) to nearest, so under "
                      "stochastic rounding scale_bias (Q - Q*) also holds the rounding's noise (with s = s* it is "
                      "all of it); definition='gain' separates them", UserWarning, stacklevel=2)
    refuse_func_transforms("decompose", x)
    x = x.detach()  # (the reference's torch ops carried x's graph; the kernels' and the compiled op's did not)
    if _is_compiling():
        return _custom_ops.decompose(x, recipe, axis, definition, full)
    return _dispatch.decompose(x, recipe, axis, definition, full)


def _linear_layout_hint(b: MXTensor) -> str:
    """The hint for a 2-D MXTensor b along axis 1: nn.Linear's weight layout [N, K]
    quantized along K holds the bytes of its transpose [K, N] along axis 0."""
    n, k = b.shape
    return (f". A weight in nn.Linear's layout [N, K] quantized along K holds the bytes of its transpose [K, N] "
            f"quantized along axis 0: pass dataclasses.replace(b, shape=torch.Size(({k}, {n})), axis=0)")


def matmul(a: Operand, b: Operand, recipe: Optional[QuantRecipe] = None) -> torch.Tensor:
    """``a @ b`` on MXFP4 operands with fp32 accumulation.

    a: float ``[..., M, K]`` (leading dims are batch, flattened) or an MXTensor quantized
    along its last axis; b: float ``[K, N]`` or an MXTensor of shape (K, N) quantized along
    axis 0 (the weight). Float operands are quantized with ``recipe`` (MXTensor operands
    keep theirs); with ``recipe.activations`` "bf16"/"fp16" a float ``a`` is rounded to that
    format instead (W4A16; a float64 ``a`` is rounded to fp32 first, as everywhere, which
    can differ from one rounding by one 16-bit ulp at a tie). Returns ``[..., M, N]`` in
    a's (original) dtype. b's dtype may differ from a's (fp32 master weights against bf16
    activations): b is quantized from its own values, and its gradient comes back in its
    dtype, computed in a's (``X^T dY`` in a's dtype, then widened, as ``nn.Linear``'s under
    autocast). ``torch.autocast`` does not apply here (the MX layers apply its casts).

    Exact up to accumulation order: the result is the fp32-accumulated product of the
    dequantized operands, rounded once to a's dtype. One exception: W4A16 with fp16
    activations multiplies the weight as fp16 numbers on every GPU target (the upcast
    kernel's decode on sm_90 and gfx942; Triton's lowering of ``tl.dot_scaled`` to an fp16
    MMA on sm_100, sm_120 and gfx950), exact for block scales 2**-23 .. 2**13 (a block's
    largest |w| from about 5e-7 to 6e4); a block below loses its smallest values (all of
    them below 2**-24 on the native targets, where the scale is cast to fp16 first), one
    above overflows (inf/NaN). bf16 activations and A4W4 have no such limit. Under autograd the backward GEMMs
    follow ``recipe.grad_input`` / ``recipe.grad_weight`` (see :mod:`portable_mx._custom_ops`).
    """
    compiling = _is_compiling()
    if recipe is None:
        recipe = DEFAULT_RECIPE
    elif compiling:
        if recipe.__class__ is not QuantRecipe:
            recipe = _recipe(recipe)
    elif id(recipe) not in VALIDATED:  # a recipe checked before costs one lookup
        recipe = _recipe(recipe)
    a_mx, b_mx = isinstance(a, MXTensor), isinstance(b, MXTensor)
    if not a_mx and (a.__class__ is not _Tensor or a.layout is not _STRIDED or a.dtype not in FLOAT_DTYPES):
        _check_float_tensor(a, "a")  # (a plain dense float tensor, the hot path's, passes without the call)
    if not b_mx:
        _check_float_tensor(b, "b")
    a_dtype, a_dev, a_shape = a.dtype, a.device, a.shape
    b_dev, b_shape = b.device, b.shape
    if len(a_shape) < 2:
        raise ValueError(f"a must have at least 2 dims [..., M, K]; got shape {tuple(a_shape)}")
    if len(b_shape) != 2:
        raise ValueError(f"b must be 2-D [K, N]; got shape {tuple(b_shape)}")
    if a_shape[-1] != b_shape[0]:
        raise ValueError(
            f"inner dimensions differ: a is {tuple(a_shape)} (K={a_shape[-1]}), b is {tuple(b_shape)} (K={b_shape[0]})"
            + (_linear_layout_hint(b) if b_mx and b.axis == 1 and b_shape[1] == a_shape[-1] else "")
        )
    if a_dev != b_dev:
        raise ValueError(f"a and b must be on the same device; got {a_dev} and {b_dev}")
    if a_mx and a.axis != len(a_shape) - 1:
        raise ValueError(f"an MXTensor a must be quantized along its last axis (K); it is along axis {a.axis}")
    if b_mx and b.axis != 0:
        raise ValueError(f"an MXTensor b must be quantized along axis 0 (K); it is along axis {b.axis}"
                         + (_linear_layout_hint(b) if b.axis == 1 else ""))

    if a_mx and not compiling and a.recipe.rounding == "stochastic":
        _warn_one_stream(a.recipe, b.recipe if b_mx else recipe)
    refuse_func_transforms("matmul", a, b)
    if compiling:
        return _custom_ops.mx_matmul(a, b, recipe)
    if torch.is_grad_enabled() and ((not a_mx and a.requires_grad) or (not b_mx and b.requires_grad)):
        return _custom_ops.mx_matmul(a, b, recipe)
    return _dispatch.matmul(a, b, recipe)


def _warn_one_stream(a_recipe: QuantRecipe, b_recipe: QuantRecipe) -> None:
    """Warn when a quantized left operand and the right one were rounded stochastically on
    one key: a[i, k] and b[k, i] then drew the same number (the same counter i * Kp + k in
    both rows views), and a product of correlated operands is biased on its diagonal (the
    GEMM keeps a float left operand on a stream of its own, :func:`_dispatch.left_recipe`;
    one the caller quantized keeps the seed it was given)."""
    if b_recipe.rounding == "stochastic" and b_recipe.seed == a_recipe.seed:
        warnings.warn(
            f"pmx.matmul: a and b were rounded stochastically on one stream (seed {a_recipe.seed}), so a[i, k] "
            "and b[k, i] drew the same random numbers: a product of correlated operands (X @ X.T, a Gram "
            "matrix) comes out biased on its diagonal (+2.7% under rceil). Quantize a on another stream, as "
            "matmul does for a float a: pmx.quantize(x, recipe.model_copy(update={'seed': recipe.seed ^ "
            "pmx.format.LEFT_STREAM}))", UserWarning, stacklevel=3)


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
            reason = registry._asked(b.unavailable_reason, d)  # (a probe that raises: a refusal)
            serves[str(d)] = "yes" if reason is None else f"no: {reason}"
        out.append({"name": b.name, "priority": b.priority, "ops": sorted(b.ops), "devices": serves})
    return out
