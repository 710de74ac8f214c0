"""The component probe: inject one MXFP4 error component at a time into an otherwise
exact forward and backward, and see which signal it moves.

Every GEMM operand that MXFP4 training would quantize (numerics.md; portable_mx.nn:
forward x and W along K, dX = dY W with dY and W along N, dW = dY^T X with dY and X
along M) is replaced by ``t + c(t)``, where ``c`` is one component of
``portable_mx.decompose(t, recipe, axis=<that GEMM's reduction axis>)`` (gain
definition): "scale" (scale bias), "dead" (deadzone), "grid" (grid noise), "all" (their
sum, which is the full MXFP4 error: this mode reproduces MXFP4 training numerics to
fp32 rounding) or "exact" (nothing). The GEMMs run in fp32 at the highest precision.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

import portable_mx as pmx
from portable_mx.backends.reference import HighestPrecision

from .measure import EvalSet, ProbeBatch, compare_gradients, forward_agreement, gradients, greedy_accuracy
from .model import GPT, _shallow_tree

MODES = ("exact", "scale", "dead", "grid", "all")
_FIELDS = {"scale": ("scale_bias",), "dead": ("deadzone",), "grid": ("grid_noise",),
           "all": ("scale_bias", "deadzone", "grid_noise")}


def inject(t: torch.Tensor, recipe: pmx.QuantRecipe, mode: str, axis: int) -> torch.Tensor:
    """``t`` plus the chosen component(s) of its MXFP4 error along ``axis`` (fp32)."""
    t = t.float()
    if mode == "exact":
        return t
    d = pmx.decompose(t, recipe, axis=axis)
    out = t
    for f in _FIELDS[mode]:
        out = out + getattr(d, f)
    return out


class _ComponentMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, recipe, mode):  # x [M, K], w [N, K] -> x @ w.T
        ctx.save_for_backward(x, w)
        ctx.recipe, ctx.mode = recipe, mode
        with HighestPrecision():
            return inject(x, recipe, mode, -1) @ inject(w, recipe, mode, -1).T

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        r, m = ctx.recipe, ctx.mode
        with HighestPrecision():
            gx = inject(gy, r, m, -1) @ inject(w, r, m, 0)  # reduction over N
            gw = inject(gy, r, m, 0).T @ inject(x, r, m, 0)  # reduction over M
        return gx, gw, None, None


class ComponentLinear(nn.Module):
    """A bias-free ``nn.Linear`` stand-in (sharing its weight) whose GEMMs carry one
    error component."""

    def __init__(self, linear: nn.Linear, recipe: pmx.QuantRecipe, mode: str) -> None:
        super().__init__()
        if linear.bias is not None:
            raise ValueError("ComponentLinear supports bias-free layers only")
        self.weight = linear.weight
        self.recipe, self.mode = recipe, mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _ComponentMM.apply(x.reshape(-1, x.shape[-1]), self.weight, self.recipe, self.mode)
        return y.reshape(*x.shape[:-1], -1)


def component_view(model: GPT, recipe: pmx.QuantRecipe, mode: str) -> GPT:
    """A view of ``model`` (shared Parameters) whose block linears carry ``mode``."""
    view = _shallow_tree(model)
    for name, mod in list(view.named_modules()):
        for cname, child in list(mod._modules.items()):
            full = f"{name}.{cname}" if name else cname
            if type(child) is nn.Linear and full != "head":
                setattr(mod, cname, ComponentLinear(child, recipe, mode))
    return view


def run_probe(model: GPT, recipe: pmx.QuantRecipe, ev: EvalSet, probe: ProbeBatch,
              progress: Optional[callable] = None) -> dict:
    """For each mode: gradient accuracy (vs exact), greedy accuracy, entropy and KL(exact ||
    mode) of the teacher-forced answer distribution; plus the check that "all" matches
    real MXFP4 training numerics (portable_mx.nn) on the probe gradient."""
    exact = component_view(model, recipe, "exact")
    g_exact = gradients(exact, model, probe)
    out = {"recipe": recipe.describe(), "modes": {}}
    bar = progress(total=len(MODES), desc="component probe", leave=False) if progress else None
    for mode in MODES:
        view = component_view(model, recipe, mode)
        g = gradients(view, model, probe)
        agree = forward_agreement(exact, view, ev)
        out["modes"][mode] = {
            "grad": compare_gradients(g, g_exact),
            "greedy_accuracy": greedy_accuracy(view, ev),
            "entropy": agree["entropy_b"],
            "entropy_exact": agree["entropy_a"],
            "kl_exact_mode": agree["kl_a_b"],
        }
        if mode == "all":
            from .model import numerics_view

            g_mx = gradients(numerics_view(model, recipe), model, probe)
            out["all_vs_mxfp4_grad"] = compare_gradients(g, g_mx)["all"]
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return out
