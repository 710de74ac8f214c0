"""Whether a tensor or module belongs to torch.distributed's sharding (DTensor, FSDP2), in
one place: the ops refuse a DTensor, convert refuses an FSDP2-managed layer, the weight
cache leaves one alone. Plain checks that torch.compile traces (no graph break, also for
a tensor subclass); on a torch without distributed support nothing is sharded."""

from __future__ import annotations

from typing import Any

import torch

try:  # (torch imports it already: free here)
    from torch.distributed.tensor import DTensor
except Exception:  # noqa: BLE001  (a torch built without distributed support)
    DTensor = None

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def is_dtensor(x: Any) -> bool:
    """True for a DTensor (a shard, or a replicated or partial tensor of a device mesh)."""
    cls = type(x)
    if cls is _PLAIN[0] or cls is _PLAIN[1]:  # (the hot path: two identity tests)
        return False
    return DTensor is not None and isinstance(x, DTensor)


def is_fsdp_module(module: torch.nn.Module) -> bool:
    """True for a module ``fully_shard`` made its own (FSDP2 gives it the class
    ``FSDP<its class>``, a subclass of FSDPModule and of its class), sharded or not now."""
    return any(c.__name__ == "FSDPModule" and c.__module__.startswith("torch.distributed")
               for c in type(module).__mro__)


def has_dtensor_parameters(module: torch.nn.Module) -> bool:
    """Whether a parameter of ``module`` itself is a DTensor (FSDP2 manages it: sharded
    between forwards)."""
    return DTensor is not None and any(isinstance(p, DTensor) for p in module.parameters(recurse=False))
