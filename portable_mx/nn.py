"""Training and inference with MXFP4 GEMMs: :class:`MXLinear` and :func:`convert`.

The layers above :mod:`portable_mx.ops`: an MXLinear forward that needs a gradient (or
runs under ``torch.compile``) is the ``portable_mx::mm`` custom op with its autograd rule
(:mod:`portable_mx._custom_ops` documents the op and its backward GEMMs); one that needs
none (``torch.no_grad()``, inference) calls the dispatch layer directly with the cached,
prepared weight: validation, one GEMM launch (plus the quantize of x for A4W4 recipes)
and the bias add.

``torch.compile``: the custom ops trace without graph breaks (dynamo sees their fake
implementations, AOTAutograd traces the backward through ``grad_mm``), and a model of
:class:`MXLinear` layers compiles with ``fullgraph=True``, inductor included; compiled
code skips the MXLinear weight cache (see there). CUDA graphs: nothing on these paths
synchronises with the host, so forward and backward can be captured and replayed.
"""

from __future__ import annotations

import fnmatch
import weakref
from collections.abc import Callable
from typing import Any, Optional, Union

import torch
from torch import Tensor

from . import _dispatch, ops
from ._custom_ops import mx_matmul, recipe_json
from .recipe import QuantRecipe
from .tensor import MXTensor

Operand = Union[Tensor, MXTensor]
SkipRule = Union[str, Callable[[str, torch.nn.Module], bool]]

__all__ = ["MXLinear", "convert", "mx_matmul", "mx_parts"]


def mx_parts(mx: MXTensor) -> list[Tensor]:
    """The tensors of a 2-D MXTensor in the order the custom ops take them
    (:meth:`MXTensor.parts`), detached."""
    if not isinstance(mx, MXTensor):
        raise TypeError(f"mx_parts expects an MXTensor; got {type(mx).__name__}")
    return [p.detach() for p in mx.parts()]


# ----------------------------------------------------------------------------- MXLinear


class MXLinear(torch.nn.Linear):
    """``torch.nn.Linear`` whose GEMM is MXFP4: ``y = x @ W^T + bias``.

    Same constructor arguments as ``nn.Linear`` plus ``recipe`` (a :class:`QuantRecipe`,
    a mapping of its fields, or None for the default); the same ``weight``
    ``[out_features, in_features]`` and ``bias`` ``[out_features]`` Parameters, in fp32
    or bf16 (or fp16) as the master copy the optimizer updates; the same state dict.

    Forward: x ``[..., in_features]`` in the weight's dtype -> ``[..., out_features]``
    in that dtype. ``x @ W^T`` with W quantized along ``in_features`` (K) and x per
    ``recipe.activations``; the bias is added afterwards in the output dtype. With a
    gradient to compute (or under ``torch.compile``) the GEMM is ``portable_mx::mm``
    (backward: :mod:`portable_mx._custom_ops`; bias: exact, by autograd); without one it
    is the same GEMM called directly, on the cached weight.

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
        self._recipe_json = recipe_json(recipe)
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

    def _weight_key(self, w: Tensor) -> Optional[tuple]:
        try:
            version = w._version
        except RuntimeError:  # an inference tensor has no version counter: no caching
            return None
        return (version, w.data_ptr(), w.shape, w.dtype, w.device, self._recipe)

    def quantized_weight(self) -> MXTensor:
        """``weight.T`` ``[in_features, out_features]`` quantized along axis 0
        (in_features, K) with the recipe: the MXTensor the forward GEMM uses, cached
        (see the class doc)."""
        return self._quantized(self.weight)

    def _quantized(self, w: Tensor) -> MXTensor:
        key = self._weight_key(w)
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
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        bias = self.bias
        if torch.compiler.is_compiling():
            y = torch.ops.portable_mx.mm(x2, w.T, [], [], self._recipe_json, "", "")
        elif torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or
                                          (bias is not None and bias.requires_grad)):
            parts = self._quantized(w).rows().parts()
            y = torch.ops.portable_mx.mm(x2, w.T, [], parts, self._recipe_json, "", self._recipe_json)
        else:  # no autograd: the dispatch layer directly, the bias added in place
            y = _dispatch.gemm(x2, self._quantized(w), self._recipe, x.dtype)
            if bias is not None:
                y.add_(bias)
                bias = None
        if x2 is not x:
            y = y.reshape(*x.shape[:-1], self.out_features)
        return y if bias is None else y + bias

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

