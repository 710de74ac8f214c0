"""QuantRecipe: every choice that changes the bytes an MXFP4 quantizer writes, and which
operands of a GEMM (forward and backward) are quantized at all.

Every way of obtaining a recipe validates it: the constructor, ``model_validate`` /
``model_validate_json`` (which call the constructor), ``model_copy(update=...)`` and
``model_construct`` (both rebuilt through the constructor here), unpickling. A recipe
made by going around all of them (``object.__new__``, pydantic's own
``BaseModel.model_construct``) is caught where it enters the library:
:func:`validated`, which the public ops and the nn layers call, checks each recipe object
once and remembers it by identity (so a valid recipe changed in place afterwards with
``object.__setattr__``, which a frozen model forbids, is not checked again).

The constructor interns: equal keyword arguments give the same object
(``QuantRecipe(activations="bf16") is QuantRecipe(activations="bf16")``), so that a
recipe built per call costs a dictionary lookup and hits every identity-keyed memo. The
one exception is ``QuantRecipe()`` with no argument: pydantic's own copies and unpickling
come through that call too, filling the blank object it returns, so it cannot hand out a
shared one; each makes a new default recipe (``recipe.DEFAULT_RECIPE`` is the shared one). Under
``torch.compile`` the same lookup makes a recipe built inside the compiled function a
constant of the graph (no graph break, no recompilation).
"""

from __future__ import annotations

import hashlib
import operator
from typing import Any, Literal, Optional

import torch
import torch.utils._pytree
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .format import BLOCK_SIZE

ScaleRuleName = Literal["floor", "rceil", "even", "ceil"]
RoundingName = Literal["nearest", "stochastic"]
ActivationsName = Literal["mxfp4", "bf16", "fp16"]
GradGemmName = Literal["mxfp4", "high"]

MAX_MACRO_BLOCK = 1 << 16
"""The longest macro block (65,536 elements): the macro factor of a longer one costs the
backends work and memory in proportion to its length, whatever K is."""

_is_compiling = torch.compiler.is_compiling


class _RecipeMeta(type(BaseModel)):
    """``QuantRecipe()`` with no arguments is the interned default recipe too. ``__new__``
    cannot tell that call from pydantic's own blank instances (copies, validation,
    unpickling fill ``cls.__new__(cls)`` in place), which the class call never makes: a
    fresh default per call compiled once per object under torch 2.13 (dynamo guards on a
    recipe's identity there: ten blocks converted with ``QuantRecipe()`` each and compiled
    one by one gave 8 graphs, then eager; audit of 2026-11-28)."""

    def __call__(cls, /, **data: Any):
        if not data and not _is_compiling():
            return _interned(cls, data)
        return super().__call__(**data)


class QuantRecipe(BaseModel, metaclass=_RecipeMeta):
    """How to quantize to MXFP4 (numerics.md sections 2 and 4). Immutable and hashable.

    Fields
    - ``scale_rule``: "floor" (OCP default), "rceil", "even" or "ceil". With macro-block
      scaling the per-32 scales always use "rceil" (numerics.md section 4): leaving
      ``scale_rule`` unset then selects it, and any other explicit rule is rejected.
    - ``rounding``: "nearest" (ties to the even code) or "stochastic".
    - ``seed``: key of the counter-based generator used by stochastic rounding, in
      [0, 2**63). The counter of an element is its flat index in the [rows, K_padded] view.
    - ``macro_block``: None, or the macro-block length along K, a multiple of 32 up to
      :data:`MAX_MACRO_BLOCK` (65,536): numerics.md names 64, 128, 256, ...; 32 (a
      factor per block, on top of its E8M0 scale) is allowed too. A macro block as long as the padded K or
      longer holds the whole row: one macro factor per row, the same bytes whatever its
      length beyond that (``macro_scales`` is then ``[*lead, 1]``).
    - ``outliers_per_block``: 0, 1 or 2 elements per 32-block kept exactly in bf16.
    - ``activations``: the left operand of :func:`portable_mx.matmul` (activations, and the
      output gradient in the backward dX GEMM): "mxfp4" (A4W4, the default) or "bf16" /
      "fp16" (W4A16: rounded once to that 16-bit format, float64 through fp32, never
      quantized; the weight-only recipe). The right operand (the weight) is always MXFP4.
    - ``grad_input``: the backward GEMM dX = dY @ W^T: "mxfp4" quantizes dY and the
      high-precision W along N (their reduction axis); "high" multiplies them unquantized.
    - ``grad_weight``: the backward GEMM dW = X^T @ dY: "mxfp4" quantizes X and dY along M;
      "high" multiplies them unquantized. With 16-bit ``activations`` it is always "high"
      (weight-only quantization quantizes no activation).

    Construction: ``QuantRecipe(**fields)`` validates and interns (equal arguments, same
    object; ``QuantRecipe()`` is one object too). ``model_copy(update=...)`` is ``QuantRecipe(**fields, **update)`` with the
    recipe's non-default values as ``fields`` (a macro block's implied "rceil" left out),
    validated like the constructor: so ``QuantRecipe().model_copy(update={"macro_block":
    64})`` selects "rceil", ``QuantRecipe(macro_block=64).model_copy(update={"macro_block":
    None})`` equals ``QuantRecipe()`` again (floor), and an update asking for a macro block
    with "floor" is rejected; ``model_construct(**fields)`` validates too. Inside ``torch.compile`` a recipe built
    from constant arguments is a constant of the graph.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    scale_rule: ScaleRuleName = "floor"
    rounding: RoundingName = "nearest"
    seed: int = Field(default=0, ge=0, lt=2**63)
    macro_block: Optional[int] = None
    outliers_per_block: Literal[0, 1, 2] = 0
    activations: ActivationsName = "mxfp4"
    grad_input: GradGemmName = "mxfp4"
    grad_weight: GradGemmName = "mxfp4"

    # ------------------------------------------------------------------- construction

    def __new__(cls, /, **data: Any) -> "QuantRecipe":
        if not _is_compiling():
            if not data:
                # a blank instance: pydantic's own paths (copies, unpickling) fill it;
                # QuantRecipe() fills it in __init__
                return super().__new__(cls)
            return _interned(cls, data)
        # torch.compile: the fields must be constants of the trace (an int argument that
        # changes between calls turns symbolic: build that recipe outside, or compile with
        # dynamic=False, one graph per value)
        name = _intern(cls, data)  # QuantRecipe(...) under torch.compile: its fields must be constants
        return getattr(_Interned, name)

    def __init__(self, /, **data: Any) -> None:
        # an interned recipe from __new__ (always so while dynamo traces: the compile test
        # comes first, so that dynamo never branches on ``__dict__``), validated when it was made
        if _is_compiling() or self.__dict__:
            return
        super().__init__(**data)
        _remember(self)

    @classmethod
    def model_construct(cls, _fields_set: Optional[set[str]] = None, **values: Any) -> "QuantRecipe":
        """``QuantRecipe(**values)``: validated (a recipe is never built unchecked)."""
        return cls(**values)

    def model_copy(self, *, update: Optional[dict[str, Any]] = None, deep: bool = False) -> "QuantRecipe":
        """``QuantRecipe(**fields, **update)``, validated like the constructor: ``fields``
        are this recipe's values that differ from the defaults, less the "rceil" that a
        macro block implies. Equal recipes give equal copies, however they were made (the
        constructor, JSON, a checkpoint's metadata: pydantic counts every field of those as
        set), and the scale rule follows the copy's macro block. Without an update, the
        recipe itself (it is immutable)."""
        if not update:
            return self
        fields = {k: v for k, v in self.__dict__.items() if v != _DEFAULTS[k]}
        if self.macro_block is not None:
            fields.pop("scale_rule", None)  # "rceil", implied by the macro block
        return type(self)(**{**fields, **update})

    def __copy__(self) -> "QuantRecipe":
        return self

    def __deepcopy__(self, memo: Optional[dict] = None) -> "QuantRecipe":
        return self

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        _check_fields(self)
        _remember(self)

    # ------------------------------------------------------------------- validation

    @model_validator(mode="before")
    @classmethod
    def _macro_block_selects_rceil(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("macro_block") is not None:
            if data.get("scale_rule") is None:
                data = {**data, "scale_rule": "rceil"}
        return data

    @field_validator("seed", "macro_block", "outliers_per_block", mode="before")
    @classmethod
    def _integers_only(cls, v: Any, info: Any) -> Any:
        # pydantic's lax mode would read True as 1, "3" as 3 and 5.0 as 5: seed=True (meant
        # as "stochastic, please") silently gave seed 1 with nearest rounding
        if v is None and info.field_name == "macro_block":
            return v
        if isinstance(v, (bool, str, bytes, float)):
            raise ValueError(f"{info.field_name} must be an integer; got {type(v).__name__} {v!r}")
        try:
            return operator.index(v)  # int, numpy and torch integers
        except TypeError:
            raise ValueError(f"{info.field_name} must be an integer; got {type(v).__name__} {v!r}") from None

    @field_validator("macro_block")
    @classmethod
    def _check_macro_block(cls, v: Optional[int]) -> Optional[int]:
        if v is not None and (isinstance(v, bool) or v <= 0 or v % BLOCK_SIZE):
            raise ValueError(
                f"macro_block must be None or a positive multiple of {BLOCK_SIZE} "
                f"(32, 64, 128, 256, ...); got {v!r}"
            )
        if v is not None and v > MAX_MACRO_BLOCK:
            raise ValueError(
                f"macro_block must be at most {MAX_MACRO_BLOCK} (2**16); got {v!r}. A macro "
                "block as long as the padded K or longer holds the whole row (one macro "
                f"factor per row): for longer rows use {MAX_MACRO_BLOCK}"
            )
        return v

    @model_validator(mode="after")
    def _check_rule_with_macro_block(self) -> "QuantRecipe":
        if self.macro_block is not None and self.scale_rule != "rceil":
            raise ValueError(
                "scale_rule must be 'rceil' when macro_block is set (macro-block scaling "
                f"quantizes each 32-block with rceil); got scale_rule={self.scale_rule!r}"
            )
        return self

    # ------------------------------------------------------------------- derived

    @property
    def quantizes_activations(self) -> bool:
        """Whether the left GEMM operand is MXFP4 (A4W4) rather than 16-bit (W4A16)."""
        return self.activations == "mxfp4"

    def describe(self) -> str:
        """A short human-readable tag, e.g. ``floor/nearest``, ``rceil/MBS-128/OF-1`` or
        ``floor/nearest/W4A16-bf16``."""
        parts = [self.scale_rule, self.rounding]
        if self.rounding == "stochastic":
            parts[-1] += f"(seed={self.seed})"
        if self.macro_block is not None:
            parts.append(f"MBS-{self.macro_block}")
        if self.outliers_per_block:
            parts.append(f"OF-{self.outliers_per_block}")
        if not self.quantizes_activations:
            parts.append(f"W4A16-{self.activations}")
        for name in ("grad_input", "grad_weight"):
            if getattr(self, name) == "high":
                parts.append(f"{name}=high")
        return "/".join(parts)


# torch.compile: dynamo hands a recipe to the function marked assume_constant_result
# (``_custom_ops._constant_json``) as the object itself. torch 2.13 does so for any object,
# guarding on its identity; torch 2.9 to 2.12 only for a registered pytree constant, guarded
# by equality (a recipe is immutable, and equal recipes write the same bytes).
_register_constant = getattr(torch.utils._pytree, "register_constant", None)
if _register_constant is not None:
    _register_constant(QuantRecipe)


# ----------------------------------------------------------------------------- interning


class _Interned:
    """The interned recipes, as attributes named ``r_<digest of the arguments>``: dynamo
    reads a class attribute afresh at each lookup and guards on it, which makes a recipe
    built inside a compiled function a constant of its graph."""


_NAMES: dict[str, str] = {}  # repr of the sorted arguments -> attribute of _Interned
_PINNED: set[str] = set()  # attributes interned while dynamo traced: never evicted
_MAX_INTERNED = 4096


def _key(cls: type, data: dict[str, Any]) -> str:
    """The interning key of ``cls(**data)``: exact for the plain types (True, 1 and 1.0
    differ, as they may to the validator)."""
    return repr((cls.__module__, cls.__qualname__, sorted((k, type(v).__qualname__, v) for k, v in data.items())))


def _interned(cls: type, data: dict[str, Any]) -> "QuantRecipe":
    """The interned recipe ``cls(**data)``, built (validated) on first use."""
    key = _key(cls, data)
    name = _NAMES.get(key)
    if name is not None:
        obj = getattr(_Interned, name, None)
        if obj is not None:
            return obj
    obj = BaseModel.__new__(cls)
    BaseModel.__init__(obj, **data)  # raises pydantic.ValidationError for bad fields
    if len(_NAMES) >= _MAX_INTERNED:  # recipes made per call (a seed per step): stay bounded
        for k, n in list(_NAMES.items()):
            if n not in _PINNED:
                _NAMES.pop(k, None)
                if hasattr(_Interned, n):
                    delattr(_Interned, n)
    name = "r_" + hashlib.sha1(key.encode()).hexdigest()[:20]
    setattr(_Interned, name, obj)
    _NAMES[key] = name
    _remember(obj)
    return obj


@torch.compiler.assume_constant_result
def _intern(cls: type, data: dict[str, Any]) -> str:
    """The attribute of :class:`_Interned` holding ``cls(**data)``. Runs eagerly even
    under ``torch.compile`` (dynamo keeps its result as a constant of the graph)."""
    _interned(cls, data)
    name = _NAMES[_key(cls, data)]
    _PINNED.add(name)  # a compiled graph guards on this attribute: never evicted
    return name


# ----------------------------------------------------------------------------- validated


VALIDATED: dict[int, QuantRecipe] = {}
"""id -> recipe, for every recipe object known to be valid. The references are strong, so
an id here is the id of that very object (no other live object can have it): the hot
path's whole check is ``id(r) in VALIDATED``. Cleared (in place) when it grows large."""


def _remember(recipe: QuantRecipe) -> None:
    if len(VALIDATED) >= 4 * _MAX_INTERNED:
        VALIDATED.clear()
    VALIDATED[id(recipe)] = recipe


def _check_fields(recipe: QuantRecipe) -> QuantRecipe:
    """The recipe the constructor makes of ``recipe``'s fields (raises if invalid)."""
    fields = dict(recipe.__dict__)
    names = set(QuantRecipe.model_fields)
    if set(fields) != names:
        missing, extra = sorted(names - set(fields)), sorted(set(fields) - names)
        raise ValueError(
            f"this QuantRecipe was not built by QuantRecipe(...): fields missing {missing}, "
            f"unknown {extra}. Build recipes with QuantRecipe(**fields) or model_copy(update=...)"
        )
    return QuantRecipe(**fields)


def validated(recipe: Any) -> QuantRecipe:
    """``recipe`` when it is a valid :class:`QuantRecipe` (checked once per object, then
    remembered by identity), else the recipe its fields make when the constructor only
    converts them (e.g. a string seed); raises ``pydantic.ValidationError`` (a
    ``ValueError``) naming the field for an invalid one and ``TypeError`` for a
    non-recipe. What the public ops and nn layers call on every recipe they receive."""
    if id(recipe) in VALIDATED:
        return recipe
    if not isinstance(recipe, QuantRecipe):
        raise TypeError(f"expected a QuantRecipe; got {type(recipe).__name__}")
    good = _check_fields(recipe)
    if good.__dict__ == recipe.__dict__ and all(type(v) is type(good.__dict__[k]) for k, v in recipe.__dict__.items()):
        _remember(recipe)
        return recipe
    return good


DEFAULT_RECIPE = QuantRecipe()
_PINNED.add(_NAMES[_key(QuantRecipe, {})])  # (QuantRecipe() stays this object: never evicted)
_DEFAULTS = {name: field.default for name, field in QuantRecipe.model_fields.items()}
