"""QuantRecipe: every choice that changes the bytes an MXFP4 quantizer writes, and which
operands of a GEMM (forward and backward) are quantized at all."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .format import BLOCK_SIZE

ScaleRuleName = Literal["floor", "rceil", "even", "ceil"]
RoundingName = Literal["nearest", "stochastic"]
ActivationsName = Literal["mxfp4", "bf16", "fp16"]
GradGemmName = Literal["mxfp4", "high"]


class QuantRecipe(BaseModel):
    """How to quantize to MXFP4 (numerics.md sections 2 and 4). Immutable and hashable.

    Fields
    - ``scale_rule``: "floor" (OCP default), "rceil", "even" or "ceil". With macro-block
      scaling the per-32 scales always use "rceil" (numerics.md section 4): leaving
      ``scale_rule`` unset then selects it, and any other explicit rule is rejected.
    - ``rounding``: "nearest" (ties to the even code) or "stochastic".
    - ``seed``: key of the counter-based generator used by stochastic rounding, in
      [0, 2**63). The counter of an element is its flat index in the [rows, K_padded] view.
    - ``macro_block``: None, or the macro-block length along K, a positive multiple of 32.
    - ``outliers_per_block``: 0, 1 or 2 elements per 32-block kept exactly in bf16.
    - ``activations``: the left operand of :func:`portable_mx.matmul` (activations, and the
      output gradient in the backward dX GEMM): "mxfp4" (A4W4, the default) or "bf16" /
      "fp16" (W4A16: rounded once to that 16-bit format, never quantized; the weight-only
      recipe). The right operand (the weight) is always MXFP4.
    - ``grad_input``: the backward GEMM dX = dY @ W^T: "mxfp4" quantizes dY and the
      high-precision W along N (their reduction axis); "high" multiplies them unquantized.
    - ``grad_weight``: the backward GEMM dW = X^T @ dY: "mxfp4" quantizes X and dY along M;
      "high" multiplies them unquantized. With 16-bit ``activations`` it is always "high"
      (weight-only quantization quantizes no activation).
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

    @model_validator(mode="before")
    @classmethod
    def _macro_block_selects_rceil(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("macro_block") is not None:
            if data.get("scale_rule") is None:
                data = {**data, "scale_rule": "rceil"}
        return data

    @field_validator("macro_block")
    @classmethod
    def _check_macro_block(cls, v: Optional[int]) -> Optional[int]:
        if v is not None and (isinstance(v, bool) or v <= 0 or v % BLOCK_SIZE):
            raise ValueError(
                f"macro_block must be None or a positive multiple of {BLOCK_SIZE} "
                f"(64, 128, 256, ...); got {v!r}"
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


DEFAULT_RECIPE = QuantRecipe()
