"""Training helpers shared by the multi-process tests and their one-process references.

A small MLP converted to MXLinear (by default the issue's ``Linear(64, 128), GELU,
Linear(128, 64)``) trained with AdamW on a fresh seeded batch per step; the ranks train
on equal slices of it. ``check`` / ``result`` let one spawned job run many checks and
report each one's value or its traceback to the test that reads it.
"""

from __future__ import annotations

import copy
import functools
import traceback

import pytest
import torch
from torch import nn

import portable_mx as pmx

STEPS = 6
ROWS = 64
LR = 1e-2
DEFAULT = pmx.QuantRecipe()
RECIPES = {
    "default": DEFAULT,
    "mbs": pmx.QuantRecipe(macro_block=64),
    "of": pmx.QuantRecipe(outliers_per_block=1),
    "w4a16": pmx.QuantRecipe(activations="bf16"),
    "sr": pmx.QuantRecipe(rounding="stochastic", seed=7),
}
FP32_ORDER = 1e-5
"""Tolerance against the full-batch reference: the fp32 summation order of the
gradients, through AdamW (observed: 1.1e-8 for A4W4 recipes, 2.4e-6 for W4A16, whose dW
GEMM is high precision), three orders of magnitude below the stale-weight defect (1e-2)."""


# ----------------------------------------------------------------------------- shared by ranks and reference


DIMS = (64, 128, 64)
"""in_features, hidden, out_features of the MLP."""


def make_model(recipe: pmx.QuantRecipe, seed: int = 0, dims: tuple = DIMS) -> nn.Module:
    torch.manual_seed(seed)
    d_in, hidden, d_out = dims
    return pmx.nn.convert(nn.Sequential(nn.Linear(d_in, hidden), nn.GELU(), nn.Linear(hidden, d_out)), recipe)


def batch(step: int, rows: int = ROWS, dims: tuple = DIMS) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(rows, dims[0], generator=gen)
    return x, torch.randn(rows, dims[2], generator=gen)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out.float() - target).pow(2).mean()


def rows_of(rank: int, world: int, rows: int = ROWS) -> slice:
    n = rows // world
    return slice(rank * n, (rank + 1) * n)


@functools.lru_cache(maxsize=None)
def train_reference(recipe, steps=STEPS, micro_batches=1, param_dtype=None, rows=ROWS, seed=0,
                    dims=DIMS) -> dict[str, torch.Tensor]:
    """One process: ``steps`` AdamW steps; each step's gradient is the average of the
    gradients of ``micro_batches`` equal slices of the batch. With ``param_dtype`` the
    forward and backward run on a copy of the weights in that dtype (the inputs cast to
    it) and the gradients are cast back to fp32 before they are averaged: FSDP2's
    ``MixedPrecisionPolicy(param_dtype, reduce_dtype=float32)``."""
    model = make_model(recipe, seed, dims)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(steps):
        x, y = batch(step, rows, dims)
        grads = []
        for r in range(micro_batches):
            mine = rows_of(r, micro_batches, rows)
            run = model if param_dtype is None else copy.deepcopy(model).to(param_dtype)
            run.zero_grad()
            xin = x[mine] if param_dtype is None else x[mine].to(param_dtype)
            loss_fn(run(xin), y[mine]).backward()
            grads.append([p.grad.float() for p in run.parameters()])
        for p, *g in zip(model.parameters(), *grads):
            p.grad = g[0] if len(g) == 1 else sum(g[1:], g[0]) / len(g)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def fsdp_model(recipe, mp_policy=None, seed=0, dims=DIMS, mx_gather=False) -> nn.Module:
    """The MLP with ``fully_shard`` on each layer and the root (after
    ``enable_fsdp_mx_all_gather`` with ``mx_gather``)."""
    from torch.distributed.fsdp import fully_shard

    model = make_model(recipe, seed, dims)
    if mx_gather:
        pmx.nn.enable_fsdp_mx_all_gather(model)
    kw = {} if mp_policy is None else {"mp_policy": mp_policy}
    for layer in (model[0], model[2]):
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def ddp_model(recipe, seed=0) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(make_model(recipe, seed), static_graph=True, gradient_as_bucket_view=True)


def train_ranks(model, rank, world, steps=STEPS, param_dtype=None, rows=ROWS, dims=DIMS,
                after_backward=None) -> dict[str, torch.Tensor]:
    """The ranks' side of :func:`train_reference` (micro-batch ``rank`` of ``world``) for
    a model wrapped by FSDP2 or DDP; returns the full parameters."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(steps):
        x, y = batch(step, rows, dims)
        mine = rows_of(rank, world, rows)
        xin = x[mine] if param_dtype is None else x[mine].to(param_dtype)
        loss_fn(model(xin), y[mine]).backward()
        if after_backward is not None:
            after_backward(model)
        opt.step()
        opt.zero_grad()
    return full_params(model)


def full_params(model) -> dict[str, torch.Tensor]:
    """The model's state dict with full tensors (DTensors gathered, DDP's prefix off)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for k, v in model.state_dict().items():
        out[k.removeprefix("module.")] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
    return out


def check(results: dict, name: str, fn, *args, **kwargs) -> None:
    """Run one check on a rank; record its result or its traceback under ``name``."""
    try:
        results[name] = ("ok", fn(*args, **kwargs))
    except Exception:
        results[name] = ("error", traceback.format_exc())


def result(results: list[dict], name: str):
    """The value rank 0 recorded for check ``name``; fails with every rank's traceback
    where a rank's check raised."""
    errors = [f"--- rank {r}:\n{res[name][1]}" for r, res in enumerate(results) if res[name][0] == "error"]
    if errors:
        pytest.fail(f"check {name!r} raised on the ranks:\n" + "\n".join(errors), pytrace=False)
    return results[0][name][1]


def assert_params(got: dict, want: dict, atol: float = 0.0, what: str = "") -> None:
    assert got.keys() == want.keys()
    for k in want:
        g, w = got[k], want[k]
        assert g.dtype == w.dtype and g.shape == w.shape, k
        if atol == 0.0:
            assert torch.equal(g, w), f"{what} {k}: max |diff| {(g - w).abs().max().item():.3g} (bit-identical expected)"
        else:
            diff = (g - w).abs().max().item()
            assert diff <= atol, f"{what} {k}: max |diff| {diff:.3g} > {atol:g}"


MATRIX_STEPS = 3
"""Steps of the recipe x engine matrix (the cache regression trains 6)."""


def full_batch_rows(recipe) -> int:
    """Rows of the batch (both ranks) of the fp32 runs: each rank's rows must fill whole
    blocks along M, the reduction axis of the dW GEMM, for the ranks to equal one
    process on the full batch (32 rows, and the macro block under MBS)."""
    return 2 * max(32, recipe.macro_block or 32)
