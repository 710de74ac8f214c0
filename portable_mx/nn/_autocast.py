"""``torch.autocast`` for the MX layers: the casts that autocast applies to ``F.linear``.

Inside an autocast region torch casts ``F.linear``'s input, weight and bias to the
region's dtype D (bf16 or fp16) before the GEMM: every floating tensor but fp64, so fp32
master weights meet bf16 activations and a ``Linear`` returns D. A custom GEMM is not on
autocast's list, so the MX layers apply the casts themselves, to x and the bias. The
weight is not cast: the GEMMs quantize it from its own values (an fp32 master weight is
not rounded to D before its 4-bit rounding; torchao's float8 and MX linears cast only
their input likewise), and its gradient comes back in its own dtype. So under autocast an
MX layer returns D and computes what it computes for x and bias in D; the MXFP4
all-gather of FSDP2 (whose codes are quantized from the shards' own dtype) gives the
same bits. Outside a region the check costs one C call.
"""

from __future__ import annotations

from typing import Optional

import torch

any_enabled = getattr(torch._C, "_is_any_autocast_enabled", None) or (lambda: True)
"""``any_enabled()``: False outside every autocast region (one C call, ~70 ns; where this
torch lacks it, True: :func:`autocast_dtype` then decides)."""


def autocast_dtype(device: torch.device) -> Optional[torch.dtype]:
    """The dtype autocast casts ``F.linear``'s operands to on ``device``'s type, or None
    outside an autocast region for it, and for a device type autocast does not know (the
    meta device: torch raises there; ``nn.Linear`` on meta tensors is not autocast)."""
    kind = device.type
    try:
        if not torch.is_autocast_enabled(kind):
            return None
    except RuntimeError:  # "unknown device type for autocast"
        return None
    return torch.get_autocast_dtype(kind)


def cast(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """``t`` cast to ``dtype`` as autocast casts an operand: floating tensors other than
    fp64 (and not already ``dtype``) only; None stays None."""
    if t is None or t.dtype is dtype or t.dtype is torch.float64 or not t.is_floating_point():
        return t
    return t.to(dtype)
