"""What a converted layer takes over from the layer it replaces (``MXLinear.from_linear``,
``hf_experts.experts_from_module``): the hooks registered on it, and what a user added to
it (Parameters, buffers, child modules, attributes), as the same objects. Dropping them
changed results silently (a masking hook stopped masking, a buffer left the state dict)."""

from __future__ import annotations

from collections.abc import Collection

import torch

__all__ = ["HOOK_TABLES", "carry_additions", "hand_over", "refuse_compiled", "take_hooks"]

HOOK_TABLES = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks",
               "_is_full_backward_hook", "_state_dict_hooks", "_state_dict_pre_hooks",
               "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")
"""The ``nn.Module`` attributes that hold a module's hooks and their kind (those this torch
has)."""


def take_hooks(old: torch.nn.Module, new: torch.nn.Module) -> None:
    """``new`` gets ``old``'s hook tables, the same dicts: a handle returned by a
    ``register_*_hook`` on ``old`` removes the hook from ``new``. Nothing else changes:
    a load-state-dict pre-hook registered by ``register_load_state_dict_pre_hook`` is still
    handed ``old`` until :func:`hand_over` (the swap's) binds it to ``new``."""
    for table in HOOK_TABLES:
        if hasattr(old, table):
            setattr(new, table, getattr(old, table))


def hand_over(old: torch.nn.Module, new: torch.nn.Module) -> None:
    """Where ``new`` has taken ``old``'s place (the swap is done): the load-state-dict
    pre-hooks registered with ``old`` (``register_load_state_dict_pre_hook`` keeps the
    module in the hook, a weak reference, and hands it to the hook) are bound to ``new``,
    under their keys in the shared table. Left bound to ``old``, they were handed the
    replaced layer, and once it was collected ``load_state_dict``, ``copy.deepcopy`` and
    ``torch.load`` of the model raised ("the hook of a dead Module")."""
    hooks = getattr(new, "_load_state_dict_pre_hooks", {})
    for key, hook in list(hooks.items()):
        if getattr(hook, "with_module", False) and hook.module() is old:
            hooks[key] = type(hook)(hook.hook, new)


def refuse_compiled(old: torch.nn.Module, what: str) -> None:
    """A layer compiled in place (``module.compile()``) runs its compiled ``_call_impl``,
    which is the old layer's: refused (a TypeError naming ``what``) rather than converted
    into a layer that runs uncompiled, or whose forward is the old one's."""
    if getattr(old, "_compiled_call_impl", None) is not None:
        raise TypeError(f"{what}: this {type(old).__name__} was compiled in place (module.compile()); convert the "
                        "model first, then compile it")


def carry_additions(old: torch.nn.Module, new: torch.nn.Module, what: str, *, own: Collection[str] = (),
                    plain: Collection[str] = (), attributes: bool = True) -> None:
    """What a user added to ``old`` goes to ``new``, the same objects: Parameters,
    buffers (persistent or not) and child modules whose names are not in ``own`` (the
    ones ``old``'s class has, which ``new`` replaces), and, where ``attributes``, the
    instance attributes not in ``plain`` (those every instance of ``old``'s class has).
    A name ``new`` uses itself is refused (a TypeError naming ``what``) rather than
    overwritten or shadowed; so is a ``forward`` set on ``old``'s instance (by a wrapper),
    which ``new`` would not run."""
    if "forward" in old.__dict__:
        raise TypeError(f"{what}: this {type(old).__name__} has a forward set on the instance (by a wrapper), which "
                        f"the {type(new).__name__} would not run; leave the layer unconverted")
    taken = [(name, "parameter", p) for name, p in old._parameters.items() if name not in own]
    taken += [(name, "buffer", b) for name, b in old._buffers.items() if name not in own]
    taken += [(name, "module", m) for name, m in old._modules.items() if name not in own]
    if attributes:
        taken += [(name, "attribute", v) for name, v in old.__dict__.items() if name not in plain]
    for name, kind, _ in taken:
        if name in new.__dict__ or name in new._parameters or name in new._buffers or name in new._modules \
                or hasattr(type(new), name):
            raise TypeError(f"{what}: this {type(old).__name__} has a {kind} {name!r}, a name "
                            f"{type(new).__name__} uses itself; rename it, or leave the layer unconverted")
    for name, kind, value in taken:
        if kind == "parameter":
            new.register_parameter(name, value)
        elif kind == "buffer":
            new.register_buffer(name, value, persistent=name not in old._non_persistent_buffers_set)
        elif kind == "module":
            new.add_module(name, value)
        else:
            new.__dict__[name] = value
