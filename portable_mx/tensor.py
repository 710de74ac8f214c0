"""MXTensor: the MXFP4 representation of one tensor, quantized along one axis, and its
rows view (the canonical (R, K), axis 1 layout the backends work on)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch

from . import _dispatch
from ._transforms import refuse_func_transforms
from .format import BLOCK_SIZE
from .recipe import QuantRecipe

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
"""The dtypes portable_mx quantizes from and dequantizes to."""


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


@dataclass(frozen=True)
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
        """The same MXTensor with every tensor moved to ``device``."""

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
        return cls(qdata=parts[0], scales=parts[1], shape=torch.Size(shape), dtype=dtype, axis=axis,
                   recipe=recipe, macro_scales=macro, outlier_values=ov, outlier_indices=oi)

    def rows(self) -> "MXTensor":
        """The (R, K), axis 1 view backends work on, R = prod(lead_shape): this MXTensor
        when it is one already, else views of its tensors, made once per MXTensor."""
        if self.axis == 1 and len(self.shape) == 2:
            return self
        return self.memo("rows", MXTensor._rows)

    def _rows(self) -> "MXTensor":
        r = math.prod(self.lead_shape)

        def flat(t: Optional[torch.Tensor], extra: int) -> Optional[torch.Tensor]:
            if t is None or t.dim() == extra + 1:  # one lead dim: already rows
                return t
            return t.reshape(r, *t.shape[t.dim() - extra:])

        return MXTensor(qdata=flat(self.qdata, 1), scales=flat(self.scales, 1), shape=torch.Size((r, self.k)),
                        dtype=self.dtype, axis=1, recipe=self.recipe, macro_scales=flat(self.macro_scales, 1),
                        outlier_values=flat(self.outlier_values, 2), outlier_indices=flat(self.outlier_indices, 2))

    def unrows(self, shape: torch.Size, axis: int) -> "MXTensor":
        """This rows-layout MXTensor (R, K), axis 1, as the MXTensor of a tensor of
        ``shape`` quantized along ``axis`` (the inverse of :meth:`rows`; views)."""
        if axis == 1 and len(shape) == 2:
            return self
        lead = torch.Size(shape[:axis] + shape[axis + 1:])

        def unflat(t: Optional[torch.Tensor], extra: int) -> Optional[torch.Tensor]:
            return None if t is None else t.reshape(*lead, *t.shape[t.dim() - extra:])

        return MXTensor(qdata=unflat(self.qdata, 1), scales=unflat(self.scales, 1), shape=torch.Size(shape),
                        dtype=self.dtype, axis=axis, recipe=self.recipe, macro_scales=unflat(self.macro_scales, 1),
                        outlier_values=unflat(self.outlier_values, 2),
                        outlier_indices=unflat(self.outlier_indices, 2))

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
        rows = cls(qdata=torch.zeros(r, kp // 2, **u8), scales=torch.zeros(r, nb, **u8), shape=torch.Size((r, k)),
                   dtype=dtype, axis=1, recipe=recipe, macro_scales=macro, outlier_values=ov, outlier_indices=oi)
        return rows.unrows(torch.Size(shape), axis)

    @classmethod
    def empty(cls, shape: tuple, dtype: torch.dtype, recipe: QuantRecipe, device: torch.device) -> "MXTensor":
        """A rows-layout MXTensor of ``shape`` (R, K), axis 1, with uninitialised parts
        (``torch.empty``): what shape propagation (the meta device) returns."""
        parts = [torch.empty(s, dtype=d, device=device) for _, d, s in part_specs(recipe, *shape)]
        return cls.from_parts(parts, shape, dtype, 1, recipe)

    # ------------------------------------------------------------------- derived data

    def memo(self, key: str, build: Callable[["MXTensor"], Any]) -> Any:
        """``build(self)``, computed once per MXTensor and kept with it: derived views and
        backend-prepared operands (the GEMM's weight side). Never part of equality, copies
        or pickles. The MXTensor's tensors are its identity: a memo stays valid while they
        are not modified in place."""
        memo = self.__dict__.get("_memo")
        if memo is None:
            memo = self.__dict__["_memo"] = {}
        value = memo.get(key)
        if value is None:
            value = memo[key] = build(self)
        return value

    @classmethod
    def _make(cls, qdata: torch.Tensor, scales: torch.Tensor, shape: torch.Size, dtype: torch.dtype, axis: int,
              recipe: QuantRecipe, macro_scales: Optional[torch.Tensor] = None,
              outlier_values: Optional[torch.Tensor] = None,
              outlier_indices: Optional[torch.Tensor] = None) -> "MXTensor":
        """The constructor for the hot path: the same object as ``MXTensor(...)`` without
        the frozen dataclass's per-field ``object.__setattr__`` (at about a third of the cost)."""
        obj = object.__new__(cls)
        obj.__dict__.update(qdata=qdata, scales=scales, shape=shape, dtype=dtype, axis=axis, recipe=recipe,
                            macro_scales=macro_scales, outlier_values=outlier_values,
                            outlier_indices=outlier_indices)
        return obj

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_memo"}

    def __repr__(self) -> str:
        return (
            f"MXTensor(shape={tuple(self.shape)}, axis={self.axis}, dtype={self.dtype}, "
            f"recipe={self.recipe.describe()}, device={self.device})"
        )
