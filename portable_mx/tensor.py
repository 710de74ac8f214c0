"""MXTensor: the MXFP4 representation of one tensor, quantized along one axis."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from .format import BLOCK_SIZE
from .recipe import QuantRecipe


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
        original dtype). Exact in fp32; a narrower dtype rounds once at the end."""
        from .ops import dequantize

        return dequantize(self, dtype=dtype)

    def __repr__(self) -> str:
        return (
            f"MXTensor(shape={tuple(self.shape)}, axis={self.axis}, dtype={self.dtype}, "
            f"recipe={self.recipe.describe()}, device={self.device})"
        )
