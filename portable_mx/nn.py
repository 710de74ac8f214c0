"""Training with MXFP4 GEMMs: torch custom ops with autograd, :class:`MXLinear` and
:func:`convert`.

The GEMM is a pair of torch custom ops (registered when this module is imported, which
``import portable_mx`` does), each with a fake (meta) implementation, so that autograd,
``torch.compile`` (dynamo, AOTAutograd, inductor) and ``torch.library.opcheck`` compose
with them:

``portable_mx::mm(Tensor a, Tensor b, Tensor[] a_parts, Tensor[] b_parts, str recipe,
str a_recipe, str b_recipe) -> Tensor``
    The forward GEMM ``a @ b``: a float ``[M, K]``, b float ``[K, N]``, same dtype
    (fp32, bf16, fp16 or fp64) and device; returns ``[M, N]`` in that dtype. ``recipe`` is
    ``QuantRecipe.model_dump_json()``. An operand with empty parts is quantized inside
    with ``recipe`` (a along K, its last axis, or rounded to 16 bits for W4A16 recipes; b
    along K, axis 0). Non-empty parts are the tensors of that operand's MXTensor,
    quantized along K in the rows layout (a: ``[M, ...]``, b: ``[N, ...]``): ``qdata``,
    ``scales``, then ``macro_scales`` if its recipe has ``macro_block``, then
    ``outlier_values`` and ``outlier_indices`` if it has ``outliers_per_block``
    (:func:`mx_parts`), with ``a_recipe`` / ``b_recipe`` the JSON of that MXTensor's
    recipe; the forward then uses those bytes and ignores the operand's values, which
    only serve the backward as its high-precision copy. Exact up to fp32 accumulation
    order: the fp32 product of the dequantized operands, rounded once to the dtype.
    Differentiable in a and b (never in the parts).

``portable_mx::grad_mm(Tensor a, Tensor b, str recipe, bool quantized) -> Tensor``
    One backward GEMM ``a @ b`` (a ``[M, K]``, b ``[K, N]``, same dtype and device) in
    a's dtype. ``quantized``: :func:`portable_mx.ops.gemm` with ``recipe``, i.e. a
    quantized along its last axis (or rounded to 16 bits for W4A16) and b along axis 0,
    each along the reduction axis; exact up to fp32 accumulation order. Otherwise high
    precision: on the CPU an fp32 matmul (fp64 for fp64 tensors) under
    ``float32_matmul_precision("highest")`` (no TF32/bf16 internals), rounded once to a's
    dtype; on a GPU ``a @ b`` in the tensors' dtype under torch's CUDA matmul settings
    (TF32 for fp32 only where the user allowed it). It has no autograd formula: double
    backward is not supported.

Backward of ``mm`` (straight-through: the quantizer's derivative is taken as 1), with
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
An MXTensor ``a`` cannot require a gradient; when b does, ``a`` is dequantized (in its
original dtype) for dW. An MXTensor ``b`` is dequantized likewise for dX.

``torch.compile``: both ops trace without graph breaks (dynamo sees their fake
implementations, AOTAutograd traces the backward through ``grad_mm``), and a model of
:class:`MXLinear` layers compiles with ``fullgraph=True``, inductor included; compiled
code skips the MXLinear weight cache (see there).
"""

from __future__ import annotations

import fnmatch
import functools
import weakref
from collections.abc import Callable
from typing import Any, Optional, Union

import torch
from torch import Tensor

from . import ops
from .format import BLOCK_SIZE
from .recipe import QuantRecipe
from .backends.reference import HighestPrecision
from .tensor import MXTensor

Operand = Union[Tensor, MXTensor]
SkipRule = Union[str, Callable[[str, torch.nn.Module], bool]]

__all__ = ["MXLinear", "convert", "mx_matmul", "mx_parts"]


# ----------------------------------------------------------------------------- helpers


@functools.lru_cache(maxsize=256)
def _recipe_from_json(text: str) -> QuantRecipe:
    if not isinstance(text, str) or not text:
        raise ValueError("a recipe argument must be the JSON of a QuantRecipe (QuantRecipe.model_dump_json())")
    return QuantRecipe.model_validate_json(text)


@functools.lru_cache(maxsize=256)
def _recipe_json(recipe: QuantRecipe) -> str:
    return recipe.model_dump_json()


def mx_parts(mx: MXTensor) -> list[Tensor]:
    """The tensors of a 2-D MXTensor in the order the custom ops take them: ``qdata``,
    ``scales``, then ``macro_scales`` (if ``recipe.macro_block``), then
    ``outlier_values`` and ``outlier_indices`` (if ``recipe.outliers_per_block``);
    detached."""
    if not isinstance(mx, MXTensor):
        raise TypeError(f"mx_parts expects an MXTensor; got {type(mx).__name__}")
    parts = [mx.qdata, mx.scales]
    if mx.recipe.macro_block is not None:
        parts.append(mx.macro_scales)
    if mx.recipe.outliers_per_block:
        parts += [mx.outlier_values, mx.outlier_indices]
    return [p.detach() for p in parts]


def _check_pair(a: Tensor, b: Tensor, op: str) -> None:
    """a [M, K] and b [K, N]: float, same dtype and device."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor; got {type(t).__name__}")
        if t.dtype not in ops.FLOAT_DTYPES:
            raise TypeError(f"{op}: {name} must be float32, bfloat16, float16 or float64; got {t.dtype}")
        if t.dim() != 2:
            raise ValueError(f"{op}: {name} must be 2-D; got shape {tuple(t.shape)}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"{op}: inner dimensions differ: a is {tuple(a.shape)}, b is {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise TypeError(f"{op}: a and b must have the same dtype; got {a.dtype} and {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"{op}: a and b must be on the same device; got {a.device} and {b.device}")


def _expected_parts(recipe: QuantRecipe, rows: int, k: int) -> list[tuple[str, torch.dtype, tuple]]:
    kp = -(-k // BLOCK_SIZE) * BLOCK_SIZE
    nb = kp // BLOCK_SIZE
    spec = [("qdata", torch.uint8, (rows, kp // 2)), ("scales", torch.uint8, (rows, nb))]
    if recipe.macro_block is not None:
        spec.append(("macro_scales", torch.float32, (rows, -(-kp // recipe.macro_block))))
    if recipe.outliers_per_block:
        o = recipe.outliers_per_block
        spec += [("outlier_values", torch.bfloat16, (rows, nb, o)), ("outlier_indices", torch.uint8, (rows, nb, o))]
    return spec


def _check_parts(parts: list[Tensor], recipe_json: str, rows: int, k: int, device: torch.device, name: str) -> None:
    """Parts of the MXTensor of operand ``name`` (``rows`` x ``k``, quantized along k)."""
    if not parts:
        if recipe_json:
            raise ValueError(f"mm: {name}_recipe is set but {name}_parts is empty")
        return
    recipe = _recipe_from_json(recipe_json)
    spec = _expected_parts(recipe, rows, k)
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


def _mx_from_parts(parts: list[Tensor], recipe_json: str, shape: tuple, dtype: torch.dtype, axis: int) -> MXTensor:
    recipe = _recipe_from_json(recipe_json)
    it = iter(parts[2:])
    macro = next(it) if recipe.macro_block is not None else None
    ov, oi = (next(it), next(it)) if recipe.outliers_per_block else (None, None)
    return MXTensor(
        qdata=parts[0], scales=parts[1], shape=torch.Size(shape), dtype=dtype, axis=axis, recipe=recipe,
        macro_scales=macro, outlier_values=ov, outlier_indices=oi,
    )


def _high_precision_mm(a: Tensor, b: Tensor) -> Tensor:
    """CPU: fp32 (fp64 for fp64 tensors) at the highest matmul precision, rounded once to
    a's dtype; GPU: ``a @ b`` in the tensors' dtype."""
    if a.device.type == "cpu":
        dtype = torch.float64 if a.dtype == torch.float64 else torch.float32
        with HighestPrecision():
            return (a.to(dtype) @ b.to(dtype)).to(a.dtype)
    return a @ b


# ----------------------------------------------------------------------------- custom ops


@torch.library.custom_op("portable_mx::mm", mutates_args=())
def _mm(
    a: Tensor, b: Tensor, a_parts: list[Tensor], b_parts: list[Tensor], recipe: str, a_recipe: str, b_recipe: str
) -> Tensor:
    _check_mm(a, b, a_parts, b_parts, recipe, a_recipe, b_recipe)
    (m, k), n = a.shape, b.shape[1]
    if m == 0 or n == 0 or k == 0:
        return a.new_zeros(m, n)
    a_op = _mx_from_parts(a_parts, a_recipe, (m, k), a.dtype, 1) if a_parts else a
    b_op = _mx_from_parts(b_parts, b_recipe, (k, n), b.dtype, 0) if b_parts else b
    return ops.gemm(a_op, b_op, _recipe_from_json(recipe)).to(a.dtype).contiguous()


def _check_mm(a, b, a_parts, b_parts, recipe, a_recipe, b_recipe) -> None:
    _check_pair(a, b, "mm")
    _recipe_from_json(recipe)
    _check_parts(a_parts, a_recipe, a.shape[0], a.shape[1], a.device, "a")
    _check_parts(b_parts, b_recipe, b.shape[1], b.shape[0], b.device, "b")


@_mm.register_fake
def _mm_fake(a, b, a_parts, b_parts, recipe, a_recipe, b_recipe):
    _check_mm(a, b, a_parts, b_parts, recipe, a_recipe, b_recipe)
    return a.new_empty(a.shape[0], b.shape[1])


@torch.library.custom_op("portable_mx::grad_mm", mutates_args=())
def _grad_mm(a: Tensor, b: Tensor, recipe: str, quantized: bool) -> Tensor:
    _check_pair(a, b, "grad_mm")
    r = _recipe_from_json(recipe)
    (m, k), n = a.shape, b.shape[1]
    if m == 0 or n == 0 or k == 0:
        return a.new_zeros(m, n)
    if quantized:
        return ops.gemm(a, b, r).to(a.dtype).contiguous()
    return _high_precision_mm(a, b).contiguous()


@_grad_mm.register_fake
def _grad_mm_fake(a, b, recipe, quantized):
    _check_pair(a, b, "grad_mm")
    _recipe_from_json(recipe)
    return a.new_empty(a.shape[0], b.shape[1])


def _mm_setup_context(ctx, inputs, output) -> None:
    a, b, a_parts, b_parts, recipe, _, _ = inputs
    ctx.save_for_backward(a, b)
    ctx.recipe = recipe
    ctx.num_parts = (len(a_parts), len(b_parts))


def _mm_backward(ctx, grad: Tensor):
    a, b = ctx.saved_tensors
    recipe = _recipe_from_json(ctx.recipe)
    grad_a = grad_b = None
    if ctx.needs_input_grad[0]:
        grad_a = torch.ops.portable_mx.grad_mm(grad, b.T, ctx.recipe, recipe.grad_input == "mxfp4")
    if ctx.needs_input_grad[1]:
        quantized = recipe.grad_weight == "mxfp4" and recipe.quantizes_activations
        grad_b = torch.ops.portable_mx.grad_mm(a.T, grad, ctx.recipe, quantized)
    no_grads = [[None] * n for n in ctx.num_parts]  # the parts are never differentiated
    return grad_a, grad_b, *no_grads, None, None, None


torch.library.register_autograd("portable_mx::mm", _mm_backward, setup_context=_mm_setup_context)


# ----------------------------------------------------------------------------- functional


def _op_operand(t: Operand) -> tuple[Tensor, list[Tensor], str]:
    """(high-precision values, parts, recipe JSON) of one mm operand."""
    if isinstance(t, MXTensor):
        return ops.dequantize(t).detach(), mx_parts(t), _recipe_json(t.recipe)
    return t, [], ""


def mx_matmul(a: Operand, b: Operand, recipe: QuantRecipe) -> Tensor:
    """MXFP4 ``a @ b`` through the ``portable_mx::mm`` custom op, differentiable in the
    float operands (see the module doc for the backward GEMMs).

    This is what :func:`portable_mx.matmul` calls when a gradient is needed; it expects
    inputs that function has validated. a: float ``[..., M, K]`` (leading dims flattened;
    the gradient comes back in a's shape and dtype) or an MXTensor along its last axis;
    b: float ``[K, N]`` or an MXTensor along axis 0. Returns ``[..., M, N]`` in a's dtype.
    An MXTensor operand is dequantized once per call as its high-precision copy.
    """
    recipe = ops._recipe(recipe)
    lead = tuple(a.shape[:-1])
    a_hp, a_parts, a_json = _op_operand(ops._flatten_batch(a))
    b_hp, b_parts, b_json = _op_operand(b)
    out = torch.ops.portable_mx.mm(a_hp, b_hp, a_parts, b_parts, _recipe_json(recipe), a_json, b_json)
    return out.reshape(*lead, b.shape[1])


# ----------------------------------------------------------------------------- MXLinear


class MXLinear(torch.nn.Linear):
    """``torch.nn.Linear`` whose GEMM is MXFP4: ``y = x @ W^T + bias``.

    Same constructor arguments as ``nn.Linear`` plus ``recipe`` (a :class:`QuantRecipe`,
    a mapping of its fields, or None for the default); the same ``weight``
    ``[out_features, in_features]`` and ``bias`` ``[out_features]`` Parameters, in fp32
    or bf16 (or fp16) as the master copy the optimizer updates; the same state dict.

    Forward: x ``[..., in_features]`` in the weight's dtype -> ``[..., out_features]``
    in that dtype. ``x @ W^T`` is ``portable_mx::mm`` with W quantized along
    ``in_features`` (K) and x per ``recipe.activations``; the bias is added afterwards
    in the output dtype. Backward: see :mod:`portable_mx.nn` (bias: exact, by autograd).

    Weight cache: in eager mode the quantized weight (:meth:`quantized_weight`) is kept
    between calls and reused until the weight changes, keyed on the weight object, its
    ``_version`` (bumped by every in-place update: ``optimizer.step()``,
    ``load_state_dict``, ``weight.data.copy_``), data_ptr, shape, dtype, device and the
    recipe; it holds 4.25 bits (plus macro factors / outliers) per weight. Under
    ``torch.compile`` the cache is not consulted (dynamo cannot branch on
    ``_version``): the compiled graph quantizes the weight inside ``portable_mx::mm`` on
    every call, with the same bytes, and stays one graph (``fullgraph=True`` works).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: Any = None,
        dtype: Optional[torch.dtype] = None,
        recipe: Any = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = recipe

    @property
    def recipe(self) -> QuantRecipe:
        """The :class:`QuantRecipe` of the forward and backward GEMMs (assignable)."""
        return self._recipe

    @recipe.setter
    def recipe(self, recipe: Any) -> None:
        recipe = ops._recipe(recipe)
        self._recipe = recipe
        self._recipe_json = _recipe_json(recipe)
        self._weight_cache: Optional[tuple] = None

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, recipe: Any = None) -> "MXLinear":
        """An MXLinear that shares ``linear``'s weight and bias Parameters (no copy) and
        its training mode."""
        if not isinstance(linear, torch.nn.Linear):
            raise TypeError(f"from_linear expects a torch.nn.Linear; got {type(linear).__name__}")
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                  device="meta", dtype=linear.weight.dtype, recipe=recipe)
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        return new

    def _weight_key(self) -> Optional[tuple]:
        w = self.weight
        try:
            version = w._version
        except RuntimeError:  # an inference tensor has no version counter: no caching
            return None
        return (version, w.data_ptr(), tuple(w.shape), w.dtype, w.device, self._recipe)

    def quantized_weight(self) -> MXTensor:
        """``weight.T`` ``[in_features, out_features]`` quantized along axis 0
        (in_features, K) with the recipe: the MXTensor the forward GEMM uses, cached
        (see the class doc)."""
        w = self.weight
        key = self._weight_key()
        cache = self._weight_cache
        if key is not None and cache is not None and cache[0] == key and cache[1]() is w:
            return cache[2]
        with torch.no_grad():
            mx = ops.quantize(w.detach().T, self._recipe, axis=0)
        self._weight_cache = None if key is None else (key, weakref.ref(w), mx)
        return mx

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        if not isinstance(x, Tensor):
            raise TypeError(f"MXLinear expects a torch.Tensor; got {type(x).__name__}")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"MXLinear: x must be [..., {self.in_features}]; got shape {tuple(x.shape)}")
        if x.dtype != w.dtype:
            raise TypeError(
                f"MXLinear: x is {x.dtype} but the weight is {w.dtype}; cast one of them "
                "(autocast does not apply to the MXFP4 GEMM)"
            )
        if torch.compiler.is_compiling():
            parts, b_json = [], ""
        else:
            parts, b_json = mx_parts(self.quantized_weight()), self._recipe_json
        y = torch.ops.portable_mx.mm(x.reshape(-1, self.in_features), w.T, [], parts, self._recipe_json, "", b_json)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self._recipe.describe()}"

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_weight_cache"] = None  # holds a weakref; rebuilt on the next forward
        return state


# ----------------------------------------------------------------------------- convert


def _skip_rules(skip: Any) -> list[SkipRule]:
    if skip is None:
        return []
    rules = [skip] if isinstance(skip, str) or callable(skip) else skip
    try:
        rules = list(rules)
    except TypeError:
        raise TypeError(f"skip must be a pattern, a predicate or an iterable of them; got {type(skip).__name__}") from None
    for r in rules:
        if not (isinstance(r, str) or callable(r)):
            raise TypeError(f"skip entries must be fnmatch patterns (str) or predicates (name, module) -> bool; got {r!r}")
    return rules


def convert(model: torch.nn.Module, recipe: Any = None, *, skip: Any = ()) -> torch.nn.Module:
    """Swap every ``torch.nn.Linear`` of ``model`` for an :class:`MXLinear` sharing its
    Parameters, in place, and return the model.

    Only modules whose type is exactly ``nn.Linear`` are swapped (a subclass may override
    ``forward``; existing MXLinear layers are left as they are, so converting twice is a
    no-op). Embeddings, norms etc. are not Linear and stay. ``skip`` excludes layers: a
    fnmatch pattern matched against the qualified module name (as in
    ``model.named_modules()``, e.g. ``"lm_head"``, ``"*.embed*"``, ``"layers.0.*"``), a
    predicate ``(name, module) -> bool``, or an iterable of both; a layer matching any
    rule is kept. A Linear shared by several parents becomes one shared MXLinear. When
    ``model`` itself is an ``nn.Linear`` a new MXLinear is returned (use the return
    value). Count the converted layers with
    ``sum(isinstance(m, MXLinear) for m in model.modules())``.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"convert expects a torch.nn.Module; got {type(model).__name__}")
    recipe = ops._recipe(recipe)
    rules = _skip_rules(skip)

    def keep(name: str, module: torch.nn.Module) -> bool:
        if type(module) is not torch.nn.Linear:
            return True
        return any(fnmatch.fnmatchcase(name, r) if isinstance(r, str) else bool(r(name, module)) for r in rules)

    if not keep("", model):
        return MXLinear.from_linear(model, recipe)
    swapped: dict[int, MXLinear] = {}
    for parent_name, parent in list(model.named_modules()):
        # _modules, not named_children(): that skips a child registered twice in one parent
        for child_name, child in list(parent._modules.items()):
            if child is None:
                continue
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            if id(child) in swapped:
                setattr(parent, child_name, swapped[id(child)])
            elif not keep(name, child):
                swapped[id(child)] = MXLinear.from_linear(child, recipe)
                setattr(parent, child_name, swapped[id(child)])
    return model

