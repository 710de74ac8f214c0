"""What portable_mx says under ``torch.func`` transforms (grad, vmap, jacrev, jvp, ...).

The ops are torch custom ops whose autograd rule is registered with
``torch.library.register_autograd``; in torch 2.4-2.13 such a rule does not compose with
functorch's transforms (they need an ``autograd.Function`` with ``setup_context`` and a
vmap rule), and the kernels take plain tensors, not vmap's batched ones. Rather than the
errors torch raises from deep inside (or, under vmap, an answer computed on the wrong
view), every public op refuses a transform up front with one message saying what to use.
``torch.func.functional_call`` alone is not a transform and works.
"""

from __future__ import annotations

import torch

try:
    _transforms_active = torch._C._are_functorch_transforms_active
except AttributeError:  # a torch without the query: nothing to detect
    def _transforms_active() -> bool:
        return False


try:
    from torch._C._functorch import is_batchedtensor as _is_batched, is_legacy_batchedtensor as _is_legacy_batched
except ImportError:  # a torch without them: nothing to detect
    def _is_batched(t) -> bool:
        return False

    _is_legacy_batched = _is_batched


def batched(t) -> bool:
    """True for a tensor vmap batches: functorch's, or the legacy kind that
    ``torch.autograd.grad(is_grads_batched=True)`` and
    ``torch.autograd.functional.jacobian(vectorize=True)`` pass to a backward."""
    return isinstance(t, torch.Tensor) and (_is_batched(t) or _is_legacy_batched(t))


from torch.autograd import forward_ad as _forward_ad  # noqa: E402

if not hasattr(_forward_ad, "_current_level"):  # a torch that keeps the level elsewhere: nothing to detect
    _forward_ad = type("_NoLevel", (), {"_current_level": -1})


def refuse_func_transforms(op: str, *tensors) -> None:
    """Raise when called under a ``torch.func`` transform, or inside a
    ``torch.autograd.forward_ad.dual_level`` with a dual tensor among ``tensors`` (forward-
    mode AD: the ops have no jvp rule, and without this check an op took the path without
    autograd and returned a result with no tangent, silently). About 0.1 us otherwise."""
    if _transforms_active():
        raise RuntimeError(
            f"portable_mx {op} does not support torch.func transforms (grad, vmap, jacrev, jvp, "
            "hessian): use torch.autograd.grad (or .backward()) for gradients and a loop or a "
            "batch dimension for vmap; torch.func.functional_call without a transform works"
        )
    if _forward_ad._current_level >= 0 and any(
            isinstance(t, torch.Tensor) and _forward_ad.unpack_dual(t).tangent is not None for t in tensors):
        raise RuntimeError(
            f"portable_mx {op} does not support forward-mode AD (torch.autograd.forward_ad dual tensors; "
            "it has no jvp rule): use reverse mode, torch.autograd.grad or .backward()"
        )
