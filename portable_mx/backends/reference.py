"""The reference backend: pure PyTorch, any device, vectorised. The oracle every other
backend is tested against (numerics.md sections 2-4).

Order of operations in one quantize (rows layout, x: [R, K] -> padded [R, Kp]):
1. zero-pad K to a multiple of 32; a block holding NaN or Inf is *special*: scale 0xFF,
   codes 0, and its values count as 0 for the macro amax;
2. outlier fallback (k = 1 or 2): per block the k largest |x| (first index on ties, NaN
   counted largest) are stored in bf16 (round to nearest even, NaN canonical) with their index and zeroed;
3. macro-block scaling: m from the amax of what remains over each macro block, and the
   block divided by m (IEEE fp32 division);
4. per 32-block E from the scale rule, y = value * 2**-E (exact), E2M1 rounding of y
   (nearest-even, or stochastic with the stream of format.uniform_u24 at element index
   row * Kp + k: one Philox4x32 call per four consecutive elements).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .. import format as fmt
from .._precision import HighestPrecision
from ..decompose import Decomposition, decompose_blocks
from ..recipe import QuantRecipe
from ..registry import Backend
from ..tensor import MXTensor

B = fmt.BLOCK_SIZE


def padded_k(k: int) -> int:
    return -(-k // B) * B


QUANTIZE_SLICE = 1 << 22
"""Elements (of the padded rows) the reference quantizes at once: 16 MiB of fp32."""


@dataclass(frozen=True)
class Encoded:
    """Everything one quantize computes, blocked as [R, n_blocks, 32] where it says so."""

    codes: torch.Tensor  # uint8 [R, nb, 32]
    scales: torch.Tensor  # uint8 [R, nb]
    macro_scales: Optional[torch.Tensor]  # fp32 [R, n_macro]
    outlier_values: Optional[torch.Tensor]  # bf16 [R, nb, k]
    outlier_indices: Optional[torch.Tensor]  # uint8 [R, nb, k]
    x: torch.Tensor  # fp32 [R, nb, 32], the padded input
    rest: torch.Tensor  # fp32 [R, nb, 32], outliers and special blocks zeroed (x units)
    y: torch.Tensor  # fp32 [R, nb, 32], the scaled values that were rounded (NaN/Inf in special blocks)


def _outliers(magnitude: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [R, nb, k] of the k largest |x| per block, from ``magnitude`` = |x|: NaN
    ranks as +Inf, and the first index wins ties (torch.argmax returns the first maximal
    index). (Not nan_to_num: it would also turn Inf into the fp32 maximum.)"""
    key = torch.where(magnitude.isnan(), float("inf"), magnitude)
    idx = []
    for _ in range(k):
        i = key.argmax(dim=-1, keepdim=True)
        idx.append(i)
        key = key.scatter(-1, i, -1.0)
    return torch.cat(idx, dim=-1)


def _expand_macro(m: torch.Tensor, macro_block: int, nb: int) -> torch.Tensor:
    """Per-macro-block factors [R, n_macro] -> per-32-block factors [R, nb]."""
    return m.repeat_interleave(macro_block // B, dim=-1)[..., :nb]


def encode(x: torch.Tensor, recipe: QuantRecipe, row0: int = 0) -> Encoded:
    """Quantize float x [R, K] with ``recipe`` (see the module doc for the steps); x's
    rows are rows ``row0`` .. of the tensor quantized (the stochastic stream's position)."""
    r, k = x.shape
    kp = padded_k(k)
    nb = kp // B
    # contiguous: rows that overlap in memory (x.unfold, as_strided) would keep their
    # strides through the element-wise steps, and the codes could not be viewed as rows
    xf = x.to(torch.float32).contiguous()
    if kp != k:
        xf = torch.nn.functional.pad(xf, (0, kp - k))
    xb = xf.view(r, nb, B)
    mag = xb.abs()
    amax = mag.amax(dim=-1)  # torch's amax propagates NaN
    special = ~torch.isfinite(amax)
    rest = xb
    if special.any() and (recipe.outliers_per_block or recipe.macro_block is not None):
        rest = torch.where(special.unsqueeze(-1), 0.0, xb)

    outlier_values = outlier_indices = None
    if recipe.outliers_per_block:
        idx = _outliers(mag, recipe.outliers_per_block)
        outlier_values = fmt.bf16_round(xb.gather(-1, idx))
        outlier_indices = idx.to(torch.uint8)
        rest = rest.scatter(-1, idx, 0.0)
        mag = rest.abs()
        amax = mag.amax(dim=-1)

    macro_scales = None
    scaled = rest
    if recipe.macro_block is not None:
        mb = recipe.macro_block
        n_macro = -(-kp // mb)
        per_block = torch.nn.functional.pad(torch.where(special, 0.0, amax), (0, n_macro * mb // B - nb))
        macro_scales = fmt.macro_factor(per_block.view(r, n_macro, mb // B).amax(dim=-1))
        scaled = rest / _expand_macro(macro_scales, mb, nb).unsqueeze(-1)
        mag = scaled.abs()
        amax = mag.amax(dim=-1)

    exponent = fmt.scale_exponent(torch.where(special, 0.0, amax), recipe.scale_rule)
    exponent = exponent.clamp(min=fmt.E8M0_MIN_EXP)
    scales = torch.where(special, fmt.E8M0_NAN, fmt.e8m0_encode(exponent))
    # y = value * 2**-E, exact but for fp32 underflow of |y| < 2**-149, which keeps the sign.
    y = scaled * fmt.exp2i((-exponent).clamp(max=fmt.E8M0_MAX_EXP)).unsqueeze(-1)
    a = y.abs()
    if recipe.rounding == "stochastic":
        rand24 = fmt.uniform_u24_range(recipe.seed, r * kp, device=x.device, start=row0 * kp).view(r, nb, B)
        codes = fmt.e2m1_round_stochastic(a, rand24)
    else:
        codes = fmt.e2m1_round_nearest(a)
    codes |= torch.signbit(y).to(torch.uint8) << 3
    if special.any():
        codes.masked_fill_(special.unsqueeze(-1), 0)
    return Encoded(codes, scales, macro_scales, outlier_values, outlier_indices, xb, rest, y)


def decode_rows(mx: MXTensor) -> torch.Tensor:
    """MXTensor (R, K) axis 1 -> fp32 [R, Kp]; exact (every product is representable)."""
    r = mx.qdata.shape[0]
    nb = mx.scales.shape[-1]
    scale = fmt.e8m0_decode(mx.scales)
    if mx.macro_scales is not None:
        scale = scale * _expand_macro(mx.macro_scales, mx.recipe.macro_block, nb)
    q = fmt.e2m1_decode_packed(mx.qdata).view(r, nb, B) * scale.unsqueeze(-1)
    if mx.outlier_values is not None:
        q = q.scatter(-1, mx.outlier_indices.long(), mx.outlier_values.to(torch.float32))
    q = torch.where((mx.scales == fmt.E8M0_NAN).unsqueeze(-1), float("nan"), q)
    return q.reshape(r, nb * B)  # (a part in any layout: the product takes the scales' strides)


def to_mxtensor(enc: Encoded, x: torch.Tensor, recipe: QuantRecipe) -> MXTensor:
    """Pack an :class:`Encoded` of x [R, K] into an MXTensor of shape (R, K), axis 1."""
    return MXTensor(
        qdata=fmt.pack_nibbles(enc.codes.view(x.shape[0], -1)),
        scales=enc.scales,
        shape=torch.Size(x.shape),
        dtype=x.dtype,
        axis=1,
        recipe=recipe,
        macro_scales=enc.macro_scales,
        outlier_values=enc.outlier_values,
        outlier_indices=enc.outlier_indices,
    )


class ReferenceBackend(Backend):
    """Every op on every device, in plain torch: the oracle."""

    name = "reference"
    priority = 0
    ops = frozenset({"quantize", "dequantize", "decompose", "matmul", "grouped_matmul"})

    def quantize(self, x: torch.Tensor, recipe: QuantRecipe) -> MXTensor:
        # in slices of rows (each row is quantized alone; the stochastic stream continues at
        # the slice's first row): the steps' full-size temporaries took about 8x an fp32 x
        # (18x a bf16 x, 14x with stochastic rounding) at once, 1.4 GB for a 4096 x 11008
        # fp32 weight, which MXLinear quantizes on every forward (audit of 2026-11-28)
        r, k = x.shape
        rows = max(1, QUANTIZE_SLICE // padded_k(max(k, 1)))
        if r <= rows:
            return to_mxtensor(encode(x, recipe), x, recipe)
        pieces = [to_mxtensor(encode(x[i:i + rows], recipe, i), x[i:i + rows], recipe) for i in range(0, r, rows)]

        def cat(name: str) -> Optional[torch.Tensor]:
            parts = [getattr(m, name) for m in pieces]
            return None if parts[0] is None else torch.cat(parts)

        return MXTensor(qdata=cat("qdata"), scales=cat("scales"), shape=torch.Size(x.shape), dtype=x.dtype, axis=1,
                        recipe=recipe, macro_scales=cat("macro_scales"), outlier_values=cat("outlier_values"),
                        outlier_indices=cat("outlier_indices"))

    def dequantize(self, mx: MXTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return fmt.cast_canonical_nan(decode_rows(mx), dtype)

    def decompose(self, x: torch.Tensor, recipe: QuantRecipe, definition: str, full: bool) -> Decomposition:
        enc = encode(x, recipe)
        mx = to_mxtensor(enc, x, recipe)
        q = decode_rows(mx).view_as(enc.x)
        outlier_mask = None
        if enc.outlier_indices is not None:
            outlier_mask = torch.zeros_like(enc.x, dtype=torch.bool).scatter(-1, enc.outlier_indices.long(), True)
        return decompose_blocks(
            enc.x,
            q,
            definition=definition,
            recipe=recipe,
            clip_count=(enc.y.abs() > fmt.E2M1_MAX).sum(-1),
            rest_amax=enc.rest.abs().amax(-1),
            outlier_mask=outlier_mask,
            full=full,
        )

    def matmul(self, a: MXTensor | torch.Tensor, b: MXTensor, out_dtype: torch.dtype = torch.float32, *,
               bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        bq = decode_rows(b)[:, : b.k]
        aq = a.to(torch.float32) if isinstance(a, torch.Tensor) else decode_rows(a)[:, : a.k]
        with HighestPrecision():
            c = aq @ bq.T
        if bias is not None:  # in fp32, before the one rounding
            c = c + bias.to(torch.float32)
        return c if out_dtype == torch.float32 else c.to(out_dtype)

    def grouped_matmul(self, a, w, num_experts, offsets, gather, bias, activation, out_dtype, schedule):
        from . import grouped_reference

        return grouped_reference.grouped_matmul(a, w, num_experts, offsets, gather, bias, activation, out_dtype,
                                                decode_rows)

    def combine(self, rows, index, weights, k, out_dtype):
        from . import grouped_reference

        return grouped_reference.combine(rows, index, weights, k, out_dtype)
