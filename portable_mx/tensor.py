"""MXTensor: the MXFP4 representation of one tensor, quantized along one axis, and its
rows view (the canonical (R, K), axis 1 layout the backends work on)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch

from . import _dispatch, _graphs
from ._transforms import refuse_func_transforms
from .format import BLOCK_SIZE
from .recipe import QuantRecipe, validated

_is_compiling = torch.compiler.is_compiling

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
"""The dtypes portable_mx quantizes from and dequantizes to."""


def materialized(t: torch.Tensor) -> torch.Tensor:
    """``t`` as memory a kernel can read through its address: a negative view
    (``t.is_neg()``: the memory holds ``-t``; the imaginary part of a conjugated complex
    tensor is one) resolved into a tensor that holds ``t``'s values; any other tensor
    itself (~0.15 us). torch ops see such a tensor's values, a Triton kernel its memory:
    the kernel backends take the float tensors they launch on through this."""
    return t.resolve_neg() if t.is_neg() else t


def part_specs(recipe: QuantRecipe, rows: Any, k: Any) -> list[tuple[str, torch.dtype, tuple]]:
    """(name, dtype, shape) of each part of a rows-layout MXTensor (``rows`` x ``k``
    quantized along k with ``recipe``), in :meth:`MXTensor.parts` order."""
    kp = -(-k // BLOCK_SIZE) * BLOCK_SIZE
    nb = kp // BLOCK_SIZE
    spec = [("qdata", torch.uint8, (rows, kp // 2)), ("scales", torch.uint8, (rows, nb))]
    if recipe.macro_block is not None:
        spec.append(("macro_scales", torch.float32, (rows, -(-kp // recipe.macro_block))))
    if recipe.outliers_per_block:
        o = recipe.outliers_per_block
        spec += [("outlier_values", torch.bfloat16, (rows, nb, o)), ("outlier_indices", torch.uint8, (rows, nb, o))]
    return spec


def _is_copy(out: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether ``out`` (a reshape of ``t``) holds a copy of t's data rather than a view;
    True where the storages cannot be compared (a wrapper subclass), which only makes the
    kept rows check t's version counter on reuse."""
    try:
        return out.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return True


def version_of(t: torch.Tensor) -> Optional[int]:
    """``t``'s version counter, or None for an inference tensor (made under
    ``torch.inference_mode``: it has none, and reading it raises): whoever keeps a value
    derived from ``t`` keeps it only while the version is a number and unchanged."""
    try:
        return t._version
    except RuntimeError:
        return None


def part_versions(mx: "MXTensor") -> Optional[tuple]:
    """The version counters of ``mx``'s parts, None where they are inference tensors
    (no counter): what a value computed from the parts (a backend's swizzled weight, a
    copy) is kept under, and built again when it changes (:meth:`MXTensor.memo`'s
    ``copies``; the GEMM's weight storage). Inline: it runs on every GEMM of a weight on
    the GPU targets."""
    d = mx.__dict__
    ms, ov = d["macro_scales"], d["outlier_values"]
    try:
        if ms is None and ov is None:
            return d["qdata"]._version, d["scales"]._version
        return (d["qdata"]._version, d["scales"]._version, None if ms is None else ms._version,
                None if ov is None else ov._version, d["outlier_indices"]._version if ov is not None else None)
    except RuntimeError:
        return None


def _rows_fresh(kept: tuple) -> bool:
    """Whether a kept :meth:`MXTensor.rows` value still holds its parts' values: no part
    it copied was written in place since (a copied inference tensor: never known, so no)."""
    return kept[1] is None or all(v is not None and version_of(t) == v for t, v in kept[1])


# eq=False: equality and hash by identity, as torch.Tensor's hash (the generated field-wise
# == compared tensors and raised)
@dataclass(frozen=True, eq=False)
class MXTensor:
    """An MXFP4 tensor in the plain (unswizzled) layout.

    The quantized axis is moved last: with ``lead = shape[:axis] + shape[axis+1:]`` and
    ``K = shape[axis]`` zero-padded to ``Kp = 32 * ceil(K / 32)``,

    - ``qdata``: uint8 ``[*lead, Kp/2]``, two E2M1 codes per byte (element 2j low nibble).
    - ``scales``: uint8 ``[*lead, Kp/32]``, E8M0 bytes (0xFF = NaN block).
    - ``macro_scales``: fp32 ``[*lead, ceil(Kp/macro_block)]`` or None: the macro-block
      factors m (each exactly a bf16 value in [1, 2]).
    - ``outlier_values``: bf16 ``[*lead, Kp/32, k]`` or None: outliers kept exactly in bf16.
    - ``outlier_indices``: uint8 ``[*lead, Kp/32, k]`` or None: their positions in the block.
    - ``shape``, ``dtype``: the original tensor's; ``axis``: the quantized axis (>= 0).

    Element (lead, k) decodes to ``code * 2**(scale-127) * m`` except at outlier
    positions, which hold the stored bf16 value; all of it is exact in fp32.

    ``MXTensor(...)`` and ``dataclasses.replace`` check that the parts agree with
    ``shape``, ``axis`` and ``recipe`` (dtypes and shapes above, macro factors exactly when
    ``recipe.macro_block``, outliers exactly when ``recipe.outliers_per_block``, every
    part on qdata's device) and raise ValueError / TypeError naming the part; the bytes
    themselves are not read (no device synchronisation), so bytes built by hand must hold
    what the quantizer writes: zeros past K in the last block (a ``replace`` to a smaller
    K keeps non-zero codes there, which the Triton GEMMs sum and the reference does not),
    outlier positions within their block, and code 0 at each outlier's position (the
    GEMMs and dequantize read a non-zero code there differently: audit of 2026-11-28).
    :mod:`portable_mx.serialization` checks the first two when it loads. The library's own constructor,
    :meth:`_make`, builds from parts that agree by construction and checks nothing.
    """

    qdata: torch.Tensor
    scales: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    axis: int
    recipe: QuantRecipe
    macro_scales: Optional[torch.Tensor] = None
    outlier_values: Optional[torch.Tensor] = None
    outlier_indices: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        _check_consistent(self)

    @property
    def device(self) -> torch.device:
        return self.qdata.device

    @property
    def k(self) -> int:
        """Length of the quantized axis before padding."""
        return self.shape[self.axis]

    @property
    def k_padded(self) -> int:
        return self.qdata.shape[-1] * 2

    @property
    def lead_shape(self) -> torch.Size:
        """The original shape without the quantized axis."""
        return torch.Size(self.shape[: self.axis] + self.shape[self.axis + 1 :])

    @property
    def num_blocks(self) -> int:
        return self.k_padded // BLOCK_SIZE

    def nbytes(self) -> int:
        """Bytes of storage (codes, scales, macro factors, outliers)."""
        parts = (self.qdata, self.scales, self.macro_scales, self.outlier_values, self.outlier_indices)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def to(self, device: torch.device | str) -> "MXTensor":
        """The same MXTensor with every tensor moved to ``device`` (a device only: its
        bytes are MXFP4; :meth:`dequantize` gives values in a float dtype)."""
        if isinstance(device, torch.dtype):
            values = (f"mx.dequantize({device}) gives the values in {device}" if device in FLOAT_DTYPES
                      else "mx.dequantize(dtype) gives the values in a float dtype")
            raise TypeError(f"MXTensor.to takes a device, not a dtype ({device}): the parts are MXFP4 bytes; {values}")
        if not isinstance(device, (torch.device, str, int)) or isinstance(device, bool):
            # (Tensor.to(other) would cast every part to other's dtype: the check then called the
            # MXTensor corrupt, or a uint8 other went through)
            raise TypeError(f"MXTensor.to takes a device (torch.device, str or int); got {type(device).__name__}. "
                            "For another tensor's device pass other.device")

        def mv(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if t is None else t.to(device)

        return replace(
            self,
            qdata=mv(self.qdata),
            scales=mv(self.scales),
            macro_scales=mv(self.macro_scales),
            outlier_values=mv(self.outlier_values),
            outlier_indices=mv(self.outlier_indices),
        )

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The represented values, shaped like the original, in ``dtype`` (default: the
        original dtype). Exact in fp32; a narrower dtype rounds each value once. Eager;
        under ``torch.compile`` call :func:`portable_mx.dequantize`, which traces as one op."""
        dtype = self.dtype if dtype is None else dtype
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype must be one of {FLOAT_DTYPES}; got {dtype}")
        refuse_func_transforms("dequantize")
        return _dispatch.dequantize(self, dtype)

    # ------------------------------------------------------------------- layouts

    def parts(self) -> list[torch.Tensor]:
        """Its tensors in a fixed order: ``qdata``, ``scales``, then ``macro_scales`` if
        ``recipe.macro_block``, then ``outlier_values`` and ``outlier_indices`` if
        ``recipe.outliers_per_block`` (the order the ``portable_mx::`` custom ops take)."""
        parts = [self.qdata, self.scales]
        if self.recipe.macro_block is not None:
            parts.append(self.macro_scales)
        if self.recipe.outliers_per_block:
            parts += [self.outlier_values, self.outlier_indices]
        return parts

    @classmethod
    def from_parts(cls, parts: list[torch.Tensor], shape: tuple, dtype: torch.dtype, axis: int,
                   recipe: QuantRecipe) -> "MXTensor":
        """The inverse of :meth:`parts` (no checks: ``parts`` must match the recipe)."""
        it = iter(parts[2:])
        macro = next(it) if recipe.macro_block is not None else None
        ov, oi = (next(it), next(it)) if recipe.outliers_per_block else (None, None)
        return cls._make(parts[0], parts[1], torch.Size(shape), dtype, axis, recipe, macro, ov, oi)

    def rows(self) -> "MXTensor":
        """The (R, K), axis 1 view backends work on, R = prod(lead_shape): this MXTensor
        when it is one already, else views of its tensors, made once per MXTensor. A part
        whose layout allows no such view (e.g. a slice of a wider buffer along a lead
        dimension) is copied, and the copy made again after an in-place write of that
        part (its version counter)."""
        if self.axis == 1 and len(self.shape) == 2:
            return self
        kept = self.__dict__.get("_memo")  # (memo's lookup inlined for the GEMM's weight: a kept view
        if kept is not None and not _is_compiling():  # that copied nothing is valid while it lives)
            kept = kept.get("rows")
            if kept is not None and kept[1] is None:
                return kept[0]
        return self.memo("rows", MXTensor._rows, valid=_rows_fresh)[0]

    def _rows(self) -> tuple["MXTensor", Optional[tuple]]:
        """(the rows MXTensor, None or the (part, version) pairs of the parts it copied)."""
        r = math.prod(self.lead_shape)
        copied = []

        def flat(t: Optional[torch.Tensor], extra: int) -> Optional[torch.Tensor]:
            if t is None or t.dim() == extra + 1:  # one lead dim: already rows
                return t
            out = t.reshape(r, *t.shape[t.dim() - extra:])
            if not _is_compiling() and _is_copy(out, t):
                copied.append((t, version_of(t)))
            return out

        rows = MXTensor._make(flat(self.qdata, 1), flat(self.scales, 1), torch.Size((r, self.k)), self.dtype, 1,
                              self.recipe, flat(self.macro_scales, 1), flat(self.outlier_values, 2),
                              flat(self.outlier_indices, 2))
        return rows, tuple(copied) or None

    def unrows(self, shape: torch.Size, axis: int) -> "MXTensor":
        """This rows-layout MXTensor (R, K), axis 1, as the MXTensor of a tensor of
        ``shape`` quantized along ``axis`` (the inverse of :meth:`rows`; views)."""
        if axis == 1 and len(shape) == 2:
            return self
        lead = torch.Size(shape[:axis] + shape[axis + 1:])

        def unflat(t: Optional[torch.Tensor], extra: int) -> Optional[torch.Tensor]:
            return None if t is None else t.reshape(*lead, *t.shape[t.dim() - extra:])

        return MXTensor._make(unflat(self.qdata, 1), unflat(self.scales, 1), torch.Size(shape), self.dtype, axis,
                              self.recipe, unflat(self.macro_scales, 1), unflat(self.outlier_values, 2),
                              unflat(self.outlier_indices, 2))

    @classmethod
    def zeros(cls, shape: torch.Size, dtype: torch.dtype, axis: int, recipe: QuantRecipe,
              device: torch.device) -> "MXTensor":
        """The MXTensor of an empty tensor of ``shape`` (a zero-size dimension), quantized
        along ``axis`` >= 0 with ``recipe``: every part zero-size or zero-filled."""
        r, k = math.prod(shape[:axis] + shape[axis + 1:]), shape[axis]
        kp = -(-k // BLOCK_SIZE) * BLOCK_SIZE
        nb = kp // BLOCK_SIZE
        u8 = dict(dtype=torch.uint8, device=device)
        macro = None
        if recipe.macro_block is not None:
            macro = torch.ones(r, -(-kp // recipe.macro_block), dtype=torch.float32, device=device)
        ov = oi = None
        if recipe.outliers_per_block:
            ov = torch.zeros(r, nb, recipe.outliers_per_block, dtype=torch.bfloat16, device=device)
            oi = torch.zeros(r, nb, recipe.outliers_per_block, **u8)
        rows = cls._make(torch.zeros(r, kp // 2, **u8), torch.zeros(r, nb, **u8), torch.Size((r, k)), dtype, 1,
                         recipe, macro, ov, oi)
        return rows.unrows(torch.Size(shape), axis)

    @classmethod
    def empty(cls, shape: tuple, dtype: torch.dtype, recipe: QuantRecipe, device: torch.device) -> "MXTensor":
        """A rows-layout MXTensor of ``shape`` (R, K), axis 1, with uninitialised parts
        (``torch.empty``): what shape propagation (the meta device) returns."""
        parts = [torch.empty(s, dtype=d, device=device) for _, d, s in part_specs(recipe, *shape)]
        return cls.from_parts(parts, shape, dtype, 1, recipe)

    # ------------------------------------------------------------------- derived data

    def memo(self, key: str, build: Callable[["MXTensor"], Any], copies: bool = False,
             valid: Optional[Callable[[Any], bool]] = None) -> Any:
        """``build(self)``, computed once per MXTensor and kept with it: derived views and
        backend-prepared operands (the GEMM's weight side). Never part of equality, copies
        or pickles. The MXTensor's tensors are its identity: a memo of views stays valid
        while they live. ``copies``: the value holds data computed from the parts (a
        backend's swizzled weight, its largest scale byte, copies of its macro factors or
        outliers), so it is built again after an in-place write of any part
        (``load_state_dict`` into a module's buffers writes so), found by their version
        counters (which views share; writes that bypass them, through ``.data`` or numpy,
        are not seen); parts made under ``torch.inference_mode`` have none, and such a
        value is built on every call. ``valid``: a check of a kept value (e.g. that the
        parts it copied were not written since); the value is built again when it
        returns False. A value built while the stream is captured into a CUDA graph is
        not kept (:mod:`portable_mx._graphs`): the next eager call builds its own."""
        if _is_compiling():  # traced: the graph holds the views (torch 2.9's dynamo
            return build(self)  # cannot write a new key into a frozen dataclass's __dict__)
        memo = self.__dict__.get("_memo")
        if memo is None:
            memo = self.__dict__["_memo"] = {}
        value = memo.get(key)
        if copies:
            versions = part_versions(self)
            if versions is None:  # inference tensors: no version counter, nothing kept
                memo.pop(key, None)
                return build(self)
            if value is None or value[0] != versions:
                value = (versions, build(self))
                if not _graphs.capturing(self.qdata):
                    memo[key] = value
            return value[1]
        if value is None or (valid is not None and not valid(value)):
            value = build(self)
            if not _graphs.capturing(self.qdata):
                memo[key] = value
        return value

    @classmethod
    def _make(cls, qdata: torch.Tensor, scales: torch.Tensor, shape: torch.Size, dtype: torch.dtype, axis: int,
              recipe: QuantRecipe, macro_scales: Optional[torch.Tensor] = None,
              outlier_values: Optional[torch.Tensor] = None,
              outlier_indices: Optional[torch.Tensor] = None) -> "MXTensor":
        """The constructor for the hot path: the same object as ``MXTensor(...)`` without
        the frozen dataclass's per-field ``object.__setattr__`` (at about a third of the
        cost) and without the consistency checks: only for parts that agree with the
        other fields by construction (the library's own outputs and views)."""
        if torch.compiler.is_compiling():  # torch 2.11's dynamo traces no __dict__.update of a new object
            return cls(qdata, scales, shape, dtype, axis, recipe, macro_scales, outlier_values, outlier_indices)
        obj = object.__new__(cls)
        obj.__dict__.update(qdata=qdata, scales=scales, shape=shape, dtype=dtype, axis=axis, recipe=recipe,
                            macro_scales=macro_scales, outlier_values=outlier_values,
                            outlier_indices=outlier_indices)
        return obj

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_memo"}

    def __setstate__(self, state: dict) -> None:
        # an unpickled MXTensor (pickle, torch.load) is checked as the constructor checks
        # one: parts that disagree with the shape (a truncated or edited file) would
        # otherwise fail later inside a kernel, or read past a part on a GPU
        self.__dict__.update(state)
        _check_consistent(self)

    # Not a torch.Tensor: what would treat it as one refuses, saying what to call instead
    # (Python's defaults: bool() was always True, np.asarray made a 0-d object array).
    _NOT_A_TENSOR = ("an MXTensor is not a torch.Tensor (it holds MXFP4 bytes): pmx.dequantize(mx) gives its "
                     "values as a tensor, pmx.matmul(a, mx) multiplies by it")

    def __bool__(self) -> bool:
        raise TypeError(f"bool() of an MXTensor: {self._NOT_A_TENSOR}; test `mx is None` for presence")

    def __getitem__(self, index: Any):
        raise TypeError(f"indexing an MXTensor: {self._NOT_A_TENSOR}")

    def __array__(self, *args: Any, **kwargs: Any):
        raise TypeError(f"numpy of an MXTensor: {self._NOT_A_TENSOR}")

    def __repr__(self) -> str:
        return (
            f"MXTensor(shape={tuple(self.shape)}, axis={self.axis}, dtype={self.dtype}, "
            f"recipe={self.recipe.describe()}, device={self.device})"
        )


# ----------------------------------------------------------------------------- consistency

_SymInt = torch.SymInt
"""A symbolic size (torch.export's default, non-strict tracing passes them through Python
code as they are; dynamo turns them into ints): a size by construction, never negative."""


def part_layout(shape: torch.Size, axis: int, recipe: QuantRecipe) -> dict[str, Optional[tuple[torch.dtype, tuple]]]:
    """(dtype, shape) of each part of the MXTensor of a tensor of ``shape`` quantized along
    ``axis`` with ``recipe``: :func:`part_specs` with the lead dims ``shape[:axis] +
    shape[axis+1:]`` in place of the rows; None for a part the recipe has no use for."""
    lead = tuple(shape[:axis]) + tuple(shape[axis + 1:])
    layout: dict[str, Optional[tuple[torch.dtype, tuple]]] = dict.fromkeys(
        ("qdata", "scales", "macro_scales", "outlier_values", "outlier_indices"))
    for name, dtype, rows_shape in part_specs(recipe, 1, shape[axis]):
        layout[name] = (dtype, lead + tuple(rows_shape[1:]))
    return layout


def _check_consistent(mx: MXTensor) -> None:
    """What ``MXTensor(...)`` checks (see the class doc); normalises ``shape`` to a
    torch.Size and ``recipe`` to its validated form."""
    shape = mx.shape
    if not isinstance(shape, (tuple, list, torch.Size)) or not all(
            _SymInt is d.__class__ or (isinstance(d, int) and not isinstance(d, bool) and d >= 0) for d in shape):
        if torch.jit.is_tracing() and any(isinstance(d, torch.Tensor) for d in shape):
            raise TypeError("portable_mx does not support torch.jit.trace of quantized tensors (it traces their "
                            "sizes as tensors): use torch.export.export or torch.compile")
        raise TypeError(f"MXTensor: shape must be a tuple of non-negative ints; got {shape!r}")
    if not isinstance(mx.axis, int) or isinstance(mx.axis, bool) or not 0 <= mx.axis < len(shape):
        raise ValueError(f"MXTensor: axis must be an int in [0, {len(shape)}) for shape {tuple(shape)}; got {mx.axis!r}")
    if mx.dtype not in FLOAT_DTYPES:
        raise TypeError(f"MXTensor: dtype (the original tensor's) must be one of {FLOAT_DTYPES}; got {mx.dtype!r}")
    recipe = mx.recipe
    compiling = torch.compiler.is_compiling()
    if compiling:  # traced: the custom ops re-validate the recipe's JSON
        if not isinstance(recipe, QuantRecipe):
            raise TypeError(f"MXTensor: recipe must be a QuantRecipe; got {type(recipe).__name__}")
    else:
        recipe = validated(recipe)
    if not isinstance(shape, torch.Size):
        object.__setattr__(mx, "shape", torch.Size(shape))
    if recipe is not mx.recipe:
        object.__setattr__(mx, "recipe", recipe)
    if not isinstance(mx.qdata, torch.Tensor):
        raise TypeError(f"MXTensor: qdata must be a torch.Tensor; got {type(mx.qdata).__name__}")
    device = mx.qdata.device
    for name, want in part_layout(mx.shape, mx.axis, recipe).items():
        part = getattr(mx, name)
        if want is None:
            if part is not None:
                raise ValueError(
                    f"MXTensor: {name} is set but the recipe {recipe.describe()} has no "
                    f"{'macro_block' if name == 'macro_scales' else 'outliers_per_block'}: it would be ignored"
                )
            continue
        dtype, part_shape = want
        if part is None:
            raise ValueError(
                f"MXTensor: {name} is missing: shape {tuple(mx.shape)}, axis {mx.axis} and recipe "
                f"{recipe.describe()} need a {dtype} tensor {part_shape}"
            )
        if not isinstance(part, torch.Tensor):
            raise TypeError(f"MXTensor: {name} must be a torch.Tensor; got {type(part).__name__}")
        if part.dtype != dtype or tuple(part.shape) != part_shape or part.device != device:
            raise ValueError(
                f"MXTensor: {name} must be {dtype} {part_shape} on {device} (qdata's device) for shape "
                f"{tuple(mx.shape)}, axis {mx.axis} and recipe {recipe.describe()}; got {part.dtype} "
                f"{tuple(part.shape)} on {part.device}"
            )
        if not compiling:  # (traced: the custom ops' dispatcher resolves negative views)
            resolved = materialized(part)
            if resolved is not part:  # a negative view: the kernels read the memory
                object.__setattr__(mx, name, resolved)
