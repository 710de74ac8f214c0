"""What a converted layer takes over from the layer it replaces (``MXLinear.from_linear``,
``hf_experts.experts_from_module``): the hooks registered on it, and what a user added to
it (Parameters, buffers, child modules, attributes), as the same objects. Dropping them
changed results silently (a masking hook stopped masking, a buffer left the state dict)."""

from __future__ import annotations

from collections.abc import Collection

import torch

__all__ = ["HOOK_TABLES", "carry_additions", "give_back_hooks", "refuse_compiled", "take_hooks"]

HOOK_TABLES = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks",
               "_is_full_backward_hook", "_state_dict_hooks", "_state_dict_pre_hooks",
               "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")
"""The ``nn.Module`` attributes that hold a module's hooks and their kind (those this torch
has)."""


def take_hooks(old: torch.nn.Module, new: torch.nn.Module) -> None:
    """``new`` gets ``old``'s hook tables, the same dicts: a handle returned by a
    ``register_*_hook`` on ``old`` removes the hook from ``new``. A load-state-dict
    pre-hook registered by ``register_load_state_dict_pre_hook`` holds the module it was
    registered on (a weak reference, passed to the hook as its first argument): it is
    rebound to ``new`` under the same key. Left bound to ``old``, the hook was handed the
    replaced layer, and once that was collected ``load_state_dict``, ``copy.deepcopy`` and
    ``torch.load`` of the model raised ("the hook of a dead Module")."""
    for table in HOOK_TABLES:
        if hasattr(old, table):
            setattr(new, table, getattr(old, table))
    _rebind(new, old, new)


def give_back_hooks(old: torch.nn.Module, new: torch.nn.Module) -> None:
    """Undo :func:`take_hooks`' rebinding where ``new`` is not used after all (a later
    layer of the same conversion failed): the shared load-state-dict pre-hooks are
    ``old``'s again."""
    _rebind(old, new, old)


def _rebind(module: torch.nn.Module, frm: torch.nn.Module, to: torch.nn.Module) -> None:
    """The load-state-dict pre-hooks of ``module`` registered with ``frm`` are bound to
    ``to`` instead, under their keys (the hook table is shared: both modules see it)."""
    hooks = getattr(module, "_load_state_dict_pre_hooks", {})
    for key, hook in list(hooks.items()):
        if getattr(hook, "with_module", False) and hook.module() is frm:
            hooks[key] = type(hook)(hook.hook, to)


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
