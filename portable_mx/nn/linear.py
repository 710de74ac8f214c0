"""MXLinear: ``torch.nn.Linear`` with an MXFP4 GEMM, for training and inference.

An MXLinear forward that needs a gradient (or runs under ``torch.compile``) is the
``portable_mx::mm`` custom op with its autograd rule (:mod:`portable_mx._custom_ops`
documents the op and its backward GEMMs); one that needs none (``torch.no_grad()``,
inference) calls the dispatch layer directly: validation, the weight's quantize (or the
cached quantized weight inside :func:`~portable_mx.nn.weight_cache`), one GEMM launch
(plus the quantize of x for A4W4 recipes), the bias added in the GEMM's epilogue.

``torch.compile``: the custom ops trace without graph breaks (dynamo sees their fake
implementations, AOTAutograd traces the backward through ``grad_mm``), and a model of
:class:`MXLinear` layers compiles with ``fullgraph=True``, inductor included. CUDA
graphs: nothing on these paths synchronises with the host, so forward and backward can
be captured and replayed; a captured forward quantizes the weight inside the graph, in
or out of ``weight_cache``, so a replay after an optimizer step sees the new weight.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch import Tensor

from .. import _dispatch, ops
from .._sharding import is_dtensor
from .._transforms import refuse_func_transforms
from .._custom_ops import recipe_json
from ..recipe import QuantRecipe
from ..tensor import FLOAT_DTYPES, MXTensor
from ._autocast import any_enabled as any_autocast, autocast_dtype, cast
from ._members import member as _member
from ._takeover import carry_additions, refuse_compiled, take_hooks
from .weight_cache import WeightCache

Operand = Union[Tensor, MXTensor]
_Parameter = torch.nn.Parameter
_STRIDED = torch.strided
_FLOATS = frozenset(FLOAT_DTYPES)

__all__ = ["MXLinear", "mx_parts"]


def mx_parts(mx: MXTensor) -> list[Tensor]:
    """The tensors of a 2-D MXTensor in the order the custom ops take them
    (:meth:`MXTensor.parts`), detached."""
    if not isinstance(mx, MXTensor):
        raise TypeError(f"mx_parts expects an MXTensor; got {type(mx).__name__}")
    return [p.detach() for p in mx.parts()]


def mx_matmul(a: Any, b: Any, recipe: Any = None) -> Tensor:
    """:func:`portable_mx.matmul` (``a @ b``, MXFP4, differentiable in the float operands),
    under the name this package has exported it by: the same checks of the operands
    (shapes, dtypes, devices, an MXTensor's axis) and the recipe (a QuantRecipe, a mapping
    of its fields, or None), the same result. It exported the internal op, which took
    unchecked operands: an MXTensor quantized along the wrong axis came out wrong (audit)."""
    return ops.matmul(a, b, recipe)


_PLAIN_LINEAR_KEYS = frozenset(torch.nn.Linear(1, 1, device="meta").__dict__)
"""The instance attributes every ``nn.Linear`` has (its tables, sizes, training flag)."""


def _refuse_dtensor(w: Tensor, x: Tensor) -> None:
    """Raise for a DTensor weight, input or bias: a tensor-parallel plan
    (``torch.distributed.tensor.parallel.parallelize_module``) or an FSDP2 shard read
    outside FSDP2's forward. The layer quantizes whole local tensors; no sharding rule
    exists for its GEMMs (the no-grad path quantized the DTensor's bytes wrongly before
    a table lookup failed, audit of 2026-11-28)."""
    what = "the weight" if is_dtensor(w) else ("x" if is_dtensor(x) else "the bias")
    raise TypeError(f"MXLinear: {what} is a DTensor. Tensor parallelism (parallelize_module, DTensor inputs) is "
                    "not supported: MXLinear quantizes whole tensors. FSDP2 (fully_shard) is: it hands the "
                    "forward the unsharded weight; outside the forward gather it first (full_tensor())")


class MXLinear(torch.nn.Linear):
    """``torch.nn.Linear`` whose GEMM is MXFP4: ``y = x @ W^T + bias``.

    Same constructor arguments as ``nn.Linear`` plus ``recipe`` (a :class:`QuantRecipe`,
    a mapping of its fields, or None for the default); the same ``weight``
    ``[out_features, in_features]`` and ``bias`` ``[out_features]`` Parameters, in fp32
    or bf16 (or fp16) as the master copy the optimizer updates; the same state dict.

    Forward: x ``[..., in_features]`` in the weight's dtype (autocast: below) ->
    ``[..., out_features]`` in that dtype. ``x @ W^T`` with W quantized along
    ``in_features`` (K) and x per ``recipe.activations``, accumulated in fp32; the bias
    is added to the fp32 sum (in the GEMM's epilogue), which is rounded once to the
    output dtype. With a gradient to compute (or under ``torch.compile``) the GEMM is
    ``portable_mx::mm`` (backward: :mod:`portable_mx._custom_ops`; the bias's gradient is
    exact, dY summed over the rows); without one it is the same GEMM called directly, on
    the cached weight.

    Under ``torch.autocast`` (dtype D) x and the bias are cast to D first, as
    ``F.linear``'s autocast casts them (autocast leaves fp64 as it is: an fp64 x runs with an
    fp64 weight, and is refused with any other, as a non-float x is, where ``F.linear``
    fails too); the weight is quantized from its
    own values (fp32 master weights are not rounded to D first, as torchao's float8 and
    MX layers do), the output is D, and the weight's gradient comes back in the weight's
    dtype (computed in D, as ``nn.Linear``'s under autocast;
    :mod:`portable_mx.nn._autocast`). Outside autocast x must have the weight's
    dtype, as for ``nn.Linear``.

    The quantized weight: outside a :func:`~portable_mx.nn.weight_cache` block the
    weight is quantized on every forward, so a forward always uses the weight's current
    values, however they were changed (any optimizer, fused included; writes through
    ``weight.data`` or numpy views; FSDP2's in-place refills). Inside such a block the
    quantized weight (4.25 bits per element, plus macro factors / outliers) is kept and
    reused until an optimizer step, a version-bumping in-place update or a replaced
    weight (the exact rule, and what the block asks of the caller, are in
    :mod:`portable_mx.nn.weight_cache`): use it where one weight serves many forwards
    (generation, rollouts, inference). Compiled code quantizes inside its graph.

    Double backward (``create_graph=True`` and differentiating the gradient) is not
    supported: differentiating a gradient of the MXFP4 GEMM raises a RuntimeError.

    A weight whose type defines ``__pmx_linear__(weight, x2, layer, bias) -> y2`` (x2 and
    y2 2-D, bias None or ``[out_features]``; under autocast x2 and the bias come in the
    autocast dtype, not the weight's, and y2 is in x2's) brings its own GEMM operands and
    runs the GEMM itself, the bias added as above: the
    MXFP4-gathered weights of :func:`~portable_mx.nn.enable_fsdp_mx_all_gather`.
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
        # checked before any weight is made (torch's own errors named no argument: "Only
        # Tensors of floating point ... can require gradients", "negative dimension")
        for what, v in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"MXLinear: {what} must be an int >= 0; got {v!r}")
        if dtype is not None and dtype not in FLOAT_DTYPES:  # (float8 and complex passed, then failed)
            raise TypeError(f"MXLinear: dtype must be one of {FLOAT_DTYPES} (the float weight's); got {dtype!r}")
        recipe = ops._recipe(recipe)
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
        self._recipe_json = recipe_json(recipe)
        cache = self.__dict__.get("_pmx_weight_cache")
        if cache is None:
            self._pmx_weight_cache = WeightCache()
        else:
            cache.clear()

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, recipe: Any = None) -> "MXLinear":
        """An MXLinear that shares ``linear``'s weight and bias Parameters (no copy), its
        training mode and its hooks (forward, pre-forward, backward and state-dict hooks:
        the same hook tables, so their handles remove them from the new layer). A hook
        registered by ``linear.register_load_state_dict_pre_hook`` is handed the module it
        was registered with: :func:`~portable_mx.nn.convert` binds it to the new layer
        when it swaps the layer in; a layer swapped in by hand keeps handing it ``linear``.

        A Linear whose weight or bias is not a Parameter (computed before each forward by
        a pre-forward hook: the old ``torch.nn.utils.weight_norm`` / ``spectral_norm``)
        is refused: its Parameters are others (``weight_g``, ``weight_v``, ...), which
        this layer would not use. So is a Linear parametrized by
        ``torch.nn.utils.parametrize`` (``parametrizations.weight_norm`` ...): convert the
        plain Linear, then register the parametrization on the MXLinear (that works).
        What else a user registered or set on the Linear (Parameters, buffers, child
        modules, attributes) goes to the new layer as the same objects; a ``forward`` set
        on the instance (by a wrapper) is refused, and so is a Linear compiled in place
        (``linear.compile()``: convert first, then compile)."""
        if not isinstance(linear, torch.nn.Linear):
            raise TypeError(f"from_linear expects a torch.nn.Linear; got {type(linear).__name__}")
        if isinstance(linear, MXLinear):
            raise TypeError("from_linear: this layer is an MXLinear already (to change its recipe, set "
                            "layer.recipe = ...)")
        refuse_compiled(linear, "from_linear")
        if torch.nn.utils.parametrize.is_parametrized(linear):
            raise TypeError(
                f"from_linear: this Linear is parametrized ({', '.join(linear.parametrizations)} computed by "
                "torch.nn.utils.parametrize): convert the plain Linear first, then register the parametrization on "
                "the MXLinear (torch.nn.utils.parametrizations.weight_norm(mx_layer) ...), or leave it unconverted")
        bias = linear.bias
        if not isinstance(linear.weight, _Parameter) or not (bias is None or isinstance(bias, _Parameter)):
            raise TypeError(
                "from_linear: this Linear's weight or bias is not a Parameter but a tensor computed before each "
                "forward (the old torch.nn.utils.weight_norm / spectral_norm; its Parameters: "
                f"{sorted(linear._parameters)}): use torch.nn.utils.parametrizations.weight_norm / spectral_norm "
                "instead, or leave the layer unconverted")
        new = cls(linear.in_features, linear.out_features, bias=bias is not None,
                  device="meta", dtype=linear.weight.dtype, recipe=recipe)
        new.weight = linear.weight
        new.bias = bias
        new.train(linear.training)
        carry_additions(linear, new, "from_linear", own=("weight", "bias"), plain=_PLAIN_LINEAR_KEYS)
        take_hooks(linear, new)
        return new

    def quantized_weight(self) -> MXTensor:
        """``weight.T`` ``[in_features, out_features]`` quantized along axis 0
        (in_features, K) with the recipe: the MXTensor the forward GEMM uses (the cached
        one inside :func:`~portable_mx.nn.weight_cache`, else quantized now). Under FSDP2,
        between forwards the weight is a shard (a DTensor): refused, as the ops refuse one."""
        return self._cached_weight(self.weight)

    def _cached_weight(self, w: Tensor) -> MXTensor:
        # ``w`` read once by the caller: a parametrized weight (torch.nn.utils.parametrize)
        # is computed on each read, and a stateful parametrization (spectral_norm's power
        # iteration in training) would step once per read and give the cache another weight
        ops.refuse_distributed("MXLinear.weight", w)
        return self._pmx_weight_cache.get("weight", w, self._recipe, self._quantize_weight)

    def _quantize_weight(self, w: Tensor) -> MXTensor:
        with torch.no_grad():
            return ops.quantize(w.detach().T, self._recipe, axis=0)

    def forward(self, x: Tensor) -> Tensor:
        params = self._parameters
        w = _member(self, params, "weight")
        if not isinstance(x, Tensor):
            raise TypeError(f"MXLinear expects a torch.Tensor; got {type(x).__name__}")
        if x.layout is not _STRIDED:
            raise TypeError(f"MXLinear: {ops.dense_error('x', x)}")
        if w.dim() != 2:
            raise ValueError(f"MXLinear: the weight must be 2-D [out_features, in_features]; got {tuple(w.shape)}")
        n, k = w.shape  # (the weight's, not the attributes': a replaced weight may differ from them)
        if x.dim() == 0 or x.shape[-1] != k:
            raise ValueError(f"MXLinear: x must be [..., {k}] (the weight is {tuple(w.shape)}); got shape "
                             f"{tuple(x.shape)}")
        bias = _member(self, params, "bias")
        if is_dtensor(w) or is_dtensor(x) or is_dtensor(bias):
            _refuse_dtensor(w, x)
        if w.dtype not in _FLOATS:  # (a model cast to complex or float8: the kernels would drop or misread it)
            raise TypeError(f"MXLinear: the weight is {w.dtype}; it must be float32, bfloat16, float16 or float64")
        amp = any_autocast() and autocast_dtype(x.device)
        if amp:  # F.linear's autocast casts of x and bias (nn._autocast); the weight is quantized as it is
            x, bias = cast(x, amp), cast(bias, amp)
            if x.dtype != amp and (x.dtype != w.dtype or x.dtype is not torch.float64):
                # (autocast leaves fp64 as it is: an fp64 x runs with an fp64 weight, as F.linear's does;
                # against another weight, and for a non-float x, F.linear fails too)
                raise TypeError(f"MXLinear: x is {x.dtype}, which torch.autocast leaves as it is (it casts "
                                f"float32, float16 and bfloat16 x to {amp}), and the weight is {w.dtype}; cast x "
                                "first")
        elif x.dtype != w.dtype:
            raise TypeError(f"MXLinear: x is {x.dtype} but the weight is {w.dtype}; cast one of them, or run the "
                            "layer under torch.autocast")
        x2 = x if x.dim() == 2 else x.reshape(-1, k)
        rj = self._recipe_json
        gemm = None if type(w) is _Parameter else getattr(type(w), "__pmx_linear__", None)
        if x.device != w.device:  # (a kernel launched with the address of another device's memory faults)
            raise ValueError(f"MXLinear: x is on {x.device} but the weight is on {w.device}; move one of them")
        if bias is not None and (bias.dtype != x.dtype or bias.device != w.device or bias.dim() != 1
                                 or bias.shape[0] != n):
            if bias.dtype != x.dtype:
                raise TypeError(f"MXLinear: the bias is {bias.dtype} but {'x (autocast)' if amp else 'the weight'} is "
                                f"{x.dtype}; give both one dtype")
            if bias.device != w.device:
                raise ValueError(f"MXLinear: the bias is on {bias.device} but the weight is on {w.device}")
            raise ValueError(f"MXLinear: the bias must be [{n}] (the weight's out_features); got {tuple(bias.shape)}")
        if gemm is not None:  # a weight that holds its own MXFP4 operands (pmx.nn.enable_fsdp_mx_all_gather)
            y = gemm(w, x2, self, bias)
        elif refuse_func_transforms("MXLinear", x, w, bias) or torch.compiler.is_compiling():
            # the recipe read through its property: torch 2.11's dynamo records an assignment
            # to it inside the compiled function without running the setter (_recipe_json stale)
            y = torch.ops.portable_mx.mm(x2, w.T, [], [], recipe_json(self.recipe), "", "", bias)
        elif torch.is_grad_enabled() and (
                x.requires_grad or w.requires_grad or (bias is not None and bias.requires_grad)):
            if self._pmx_weight_cache.depth:
                parts = self._cached_weight(w).rows().parts()  # (the w this forward read)
                y = torch.ops.portable_mx.mm(x2, w.T, [], parts, rj, "", rj, bias)
            else:  # the op quantizes the weight itself
                y = torch.ops.portable_mx.mm(x2, w.T, [], [], rj, "", "", bias)
        else:  # no autograd: the dispatch layer directly (the bias in the GEMM's epilogue)
            cache = self._pmx_weight_cache
            b = cache.get("weight", w, self._recipe, self._quantize_weight) if cache.depth else w.detach().T
            y = _dispatch.gemm(x2, b, self._recipe, x.dtype, bias)
        return y if x2 is x else y.reshape(*x.shape[:-1], n)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self._recipe.describe()}"

    def __setstate__(self, state: dict) -> None:
        state.pop("_weight_cache", None)  # pickles of older versions held a weakref here
        super().__setstate__(state)
        # a cache of its own, always: copy.copy hands this the original's __dict__ as it is
        # (a shared cache would let a block entered on the copy cover the original too)
        self._pmx_weight_cache = WeightCache()
