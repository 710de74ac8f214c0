"""CUDA graph capture, as the library's caches must see it.

While a stream is captured into a CUDA graph, the device work queued on it is recorded,
not run: it runs at each replay, and the memory it writes comes from the graph's pool. A
cache therefore keeps nothing built during a capture (until the graph replays, that memory
holds nothing, and an eager call would read it), and where a cached value can be replaced
or freed later (the weight cache at the end of its block or after an optimizer step), a
capture builds its own instead of reading it (the graph would replay the old value, or
freed memory, every time). A kept copy rebuilt after an in-place write of what it was
copied from is refreshed in place (:func:`refill`): a graph captured with it reads the new
data once an eager call has rebuilt it.
"""

from __future__ import annotations

import torch

__all__ = ["capturing", "refill", "stream_capturing"]


def capturing(t: torch.Tensor) -> bool:
    """Whether ``t`` is a CUDA (or ROCm) tensor and the current stream of ``t``'s device is
    being captured into a CUDA graph. Two cheap queries where ``t`` is on the current GPU,
    none elsewhere; ``t``'s device is asked under a device switch where another one is
    current (a capture on cuda:1's stream with cuda:0 made current inside it: the current
    device's answer kept memory of the graph's pool in the caches)."""
    return t.is_cuda and stream_capturing(t.get_device(), torch._C._cuda_getDevice())  # (get_device: no
    # torch.device object made on the hot path)


def stream_capturing(index, current: int) -> bool:
    """Whether the current stream of CUDA device ``index`` (None: the current one) is being
    captured, ``current`` being the current device's index."""
    if index is None or index == current:
        return torch._C._cuda_isCurrentStreamCapturing()
    with torch.cuda.device(index):
        return torch._C._cuda_isCurrentStreamCapturing()


def refill(old: tuple, new: tuple, parts: tuple) -> bool:
    """Copy a rebuilt value ``new`` into the kept value ``old`` in place, so that the kept
    one keeps its addresses (which a CUDA graph captured with it reads) and holds the new
    data: both tuples of one length whose tensors agree in shape, dtype, device and
    strides, and whose other entries are equal. A tensor of ``old`` that is ``new``'s memory
    already (a view of a part, in a layout that needs no copy) is left as it is; one that
    shares memory with any of the MXTensor's ``parts`` (``MXTensor.parts()``) otherwise is never written (False:
    the caller keeps ``new`` instead). Returns whether ``old`` now holds ``new``."""
    if not (isinstance(old, tuple) and isinstance(new, tuple)) or len(old) != len(new):
        return False
    owned = {p.untyped_storage().data_ptr() for p in parts if p is not None}
    copies = []
    for o, n in zip(old, new):
        if isinstance(o, torch.Tensor) and isinstance(n, torch.Tensor):
            if (o.shape != n.shape or o.dtype != n.dtype or o.device != n.device or o.stride() != n.stride()
                    or o.storage_offset() != n.storage_offset()):
                return False
            if o.data_ptr() == n.data_ptr():
                continue
            if o.untyped_storage().data_ptr() in owned:
                return False
            copies.append((o, n))
        elif isinstance(o, torch.Tensor) or isinstance(n, torch.Tensor) or o != n:
            return False
    for o, n in copies:
        o.copy_(n)
    return True
