"""Reusing a layer's quantized weight between forwards, where that is safe by promise.

Quantizing a weight reads all of it (4 bytes per element in fp32, 2 in bf16) and writes
4.25 bits per element; a decode-size W4A16 GEMM reads only the 4.25 bits. Re-quantizing
the weight on every forward therefore costs more than the GEMM itself when the batch is
small (generation, RL rollouts), and reusing the quantized copy is what makes MXFP4
inference fast. Reusing it is only correct while the weight's values have not changed,
and no cheap test can see every change: ``optimizer.step()`` with ``fused=True``, writes
through ``weight.data`` (``.data.copy_``, ``.data.mul_``, ``.data[:] = ...``), numpy views
and FSDP2's refill of its unsharded weights all leave the version counter as it was, and
the allocator hands a freed address to the next tensor of the same size.

So the rule is: **outside** a :func:`weight_cache` block, MX layers quantize their weight
on every forward (always correct, whoever changed it). **Inside** one, each layer keeps
its quantized weight and reuses it until one of these happens, each of which it sees:

- any ``torch.optim`` optimizer steps (foreach, fused or single-tensor; a global step
  hook counts the steps),
- an in-place update that bumps the weight's version counter (``with torch.no_grad():
  weight.mul_(...)``, ``weight.copy_(...)``, ``load_state_dict``),
- the weight is replaced by another Parameter or tensor (another object, address, shape,
  dtype or device), or the layer's recipe changes.

By entering the block the caller promises that nothing else changes the weights inside
it: no writes through ``.data``, numpy views, the storage itself
(``weight.untyped_storage().copy_(...)``) or any other tensor that shares a weight's
storage with a version counter of its own (after
``torch.nn.utils.vector_to_parameters(vec, params)`` the weights are views of ``vec``
made through ``.data``: an in-place write to ``vec`` is not seen), no code running under
``torch.autograd._unsafe_preserve_version_counter``, and no ``torch.distributed``
collective into a weight (``broadcast``, ``all_reduce``, ``recv``, ...: they write in
place without a version bump, so a rollout model that receives the trainer's weights
that way keeps its old quantized ones), and no peft ``merge_adapter`` /
``unmerge_adapter`` / ``merge_and_unload`` (they add the adapters to the base weights
through ``.data``: rollouts ran without the adapter). After such a write, call
``torch.autograd.graph.increment_version(p)`` for each written weight ``p`` before the
next forward (or leave the block). Layers managed by FSDP2's ``fully_shard`` never
cache, in or out of the block, wherever it was applied: FSDP refills their unsharded
weights in place without a version bump. Under FSDP1 (``FullyShardedDataParallel``) the
same holds for the layers of a model given to the block that contains the FSDP1 wrapper
(or is it); a child of an FSDP1 wrapper given alone cannot see the wrapper above it and
caches (its weights are views of FSDP1's flat parameter, which shares their version
counter: a version-bumping in-place update, as an optimizer makes, was seen in an
audit's probe on 2 gloo ranks, not in the suite), so give the block the wrapper. ``torch.compile``d code never consults the
cache (it quantizes inside its graph), and neither does a forward captured into a CUDA
graph: a graph replays the addresses it captured, and a cached weight is freed when the
block ends and replaced after an optimizer step, so a graph that read it would replay
freed memory or the old weight; quantized inside the graph, every replay reads the weight
as it is then.

Typical use: around rollout generation or an inference loop, where one weight version
serves many forwards::

    with pmx.nn.weight_cache(policy):
        tokens = generate(policy, prompts)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, Callable, Optional

import torch

from .. import _graphs
from .._sharding import has_dtensor_parameters as sharded
from ..tensor import version_of

__all__ = ["WeightCache", "weight_cache"]

_get_ident = threading.get_ident

_STEPS = [0]  # optimizer steps taken since the hook was installed (any optimizer)
_HOOK: list[Any] = []


def _count_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    _STEPS[0] += 1


def _install_step_hook() -> None:
    """Count every ``Optimizer.step()`` in the process (once; the hook is global)."""
    if not _HOOK:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _HOOK.append(register_optimizer_step_post_hook(_count_step))


class WeightCache:
    """The quantized weights of one layer, kept only while a :func:`weight_cache` block
    covers the layer (``active``). Entries are keyed by a name (a layer may quantize
    several weights, or one weight along two axes) and validated on every lookup against
    the weight object, its version counter, address, shape, dtype, device, the recipe
    and the process-wide optimizer step count. Copies and pickles of a layer get an
    empty, inactive cache."""

    __slots__ = ("depths", "entries", "__weakref__")

    def __init__(self) -> None:
        self.depths: dict[int, int] = {}  # thread id -> blocks of that thread covering the layer
        self.entries: dict[str, tuple] = {}

    @property
    def depth(self) -> int:
        """How many :func:`weight_cache` blocks of the calling thread cover the layer: a
        block covers the thread that entered it (another thread's forward, which made no
        promise, quantizes as outside any block)."""
        return self.depths.get(_get_ident(), 0)

    @property
    def active(self) -> bool:
        return self.depth > 0

    def enter(self, t: int) -> None:
        """A block of thread ``t`` (the thread that enters it) begins."""
        self.depths[t] = self.depths.get(t, 0) + 1

    def leave(self, t: int) -> None:
        """A block of thread ``t`` ends (the thread that entered it: a block may be
        closed from another, as a generator finalized elsewhere is); the last block of
        every thread frees the cached weights."""
        left = self.depths.get(t, 0) - 1
        if left > 0:
            self.depths[t] = left
        else:
            self.depths.pop(t, None)
        if not self.depths:
            self.clear()

    def get(self, name: str, w: torch.Tensor, recipe: Any, build: Callable[[torch.Tensor], Any]) -> Any:
        """``build(w)``, or the value built for this same ``(w, recipe)`` earlier in the
        block when nothing the cache can see has changed since. In a CUDA graph capture,
        ``build(w)`` and nothing kept or read: the graph quantizes at every replay."""
        if self.depth <= 0 or _graphs.capturing(w):
            return build(w)
        key = _key(w, recipe)
        hit = self.entries.get(name)
        if key is not None and hit is not None and hit[0] == key and hit[1] is w and _versions(hit[2]) == hit[4]:
            return hit[2]
        if torch.is_inference_mode_enabled() and not w.is_inference():
            # (the usual serving context) a value built here would be inference tensors, which
            # have no version counters, so the entry was dropped and every forward quantized
            # the weight again; built outside it (and without grad, as inside) it is kept
            with torch.inference_mode(False), torch.no_grad():
                value = build(w)
        else:
            value = build(w)
        versions = _versions(value)
        if key is None or (versions is not None and None in versions):
            self.entries.pop(name, None)
        else:
            # the weight itself and its storage (through an alias), held until the entry is
            # replaced or the block ends: a weakref made torch.utils.swap_tensors
            # (module.half(), load_state_dict under
            # torch.__future__.set_swap_module_params_on_conversion) refuse the weight;
            # holding the object keeps its id from being reused, and holding the storage its
            # address: ``w.data = other`` or a swap frees the weight's old storage, and
            # the allocator handed that address to the next tensor of the same size, whose
            # fresh version counter then matched the key (a stale weight, in the audit).
            # The value's own parts' versions too: a caller who wrote into the cached value
            # (quantized_weight() hands it out) made every later forward use its bytes.
            self.entries[name] = (key, w, value, w.detach(), versions)
        return value

    def clear(self) -> None:
        self.entries.clear()

    # a copy of a layer (copy.deepcopy, pickle) starts with nothing cached and no block
    def __deepcopy__(self, memo: dict) -> "WeightCache":
        return WeightCache()

    def __copy__(self) -> "WeightCache":
        return WeightCache()

    def __reduce__(self) -> tuple:
        return (WeightCache, ())


def _versions(value: Any) -> Optional[tuple]:
    """The version counters of a cached value's tensors (an MXTensor's parts), or None
    for a value of another kind."""
    parts = getattr(value, "parts", None)
    return None if parts is None else tuple(version_of(p) for p in parts())


def _key(w: torch.Tensor, recipe: Any) -> Optional[tuple]:
    version = version_of(w)
    if version is None:  # an inference tensor has no version counter: no caching
        return None
    return (version, _STEPS[0], w.data_ptr(), w.shape, w.stride(), w.dtype, w.device, recipe)


def _fsdp_types() -> tuple[type, ...]:
    types: list[type] = []
    try:
        from torch.distributed.fsdp import FSDPModule

        types.append(FSDPModule)
    except Exception:  # a torch without distributed support
        pass
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        types.append(FullyShardedDataParallel)
    except Exception:
        pass
    return tuple(types)


def _fsdp2_managed() -> set[int]:
    """The ids of every module whose parameters an FSDP2 ``fully_shard`` manages, wherever
    it was applied: on the module, on one of its parents, or on an ancestor of the model
    given to :func:`weight_cache` (which cannot see above itself). Read from FSDP2's
    states (private structures, read defensively: a torch that lays them out otherwise
    gives none, and the parents' check below still holds)."""
    out: set[int] = set()
    try:
        from torch.distributed import _composable_state

        states = [ref() for ref in list(_composable_state._module_state_mapping.values())]
    except Exception:  # noqa: BLE001  (no torch.distributed, or another layout)
        return out
    for state in states:
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            group = getattr(state, "_fsdp_param_group", None)
            groups = [group] if group is not None else []
        for group in groups:
            for param in getattr(group, "fsdp_params", ()) or ():
                info = getattr(param, "_module_info", None)
                for module in [getattr(info, "module", None), *(getattr(info, "shared_modules", None) or [])]:
                    if module is not None:
                        out.add(id(module))
    return out


def layer_caches(model: torch.nn.Module) -> list[tuple[str, WeightCache]]:
    """(qualified name, cache) of every MX layer in ``model`` that may cache: those with
    a ``_pmx_weight_cache`` that no FSDP manages (no FSDP module among them or their
    parents within ``model``, no FSDP2 state anywhere holding their parameters, no
    sharded parameter)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"weight_cache expects a torch.nn.Module; got {type(model).__name__}")
    fsdp = _fsdp_types()
    fsdp2 = _fsdp2_managed()
    managed: set[str] = set()
    out = []
    for name, module in model.named_modules():
        if fsdp and isinstance(module, fsdp):
            managed.add(name)
        if any(name == p or name.startswith(p + ".") or p == "" for p in managed):
            continue
        if id(module) in fsdp2 or sharded(module):
            continue
        cache = getattr(module, "_pmx_weight_cache", None)
        if isinstance(cache, WeightCache):
            out.append((name, cache))
    return out


@contextlib.contextmanager
def weight_cache(model: torch.nn.Module) -> Iterator[int]:
    """Inside this block, every MX layer of ``model`` (MXLinear and the other
    ``portable_mx.nn`` layers) quantizes its weight once and reuses it until an
    optimizer step, a version-bumping in-place update or a replaced weight (see the
    module doc for the exact rule, and what the caller promises). Yields the number of
    layers that cache (FSDP-managed layers do not). Blocks nest; leaving the outermost
    block frees the cached weights. A block covers the thread that entered it: a forward
    in another thread (which made no promise) quantizes as outside any block."""
    caches = [c for _, c in layer_caches(model)]
    _install_step_hook()
    t = _get_ident()  # (the entering thread's, read once: the exit may run in another thread)
    for c in caches:
        c.enter(t)
    try:
        yield len(caches)
    finally:
        for c in caches:
            c.leave(t)
