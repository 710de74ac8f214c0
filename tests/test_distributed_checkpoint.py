"""Distributed checkpoints of MXLinear models (``torch.distributed.checkpoint`` through
``get_state_dict`` / ``set_state_dict``), resharded 2 -> 1 -> 2 ranks, bit for bit:

1. 2 gloo ranks, FSDP2 with the MXFP4 all-gather: 2 AdamW steps, save model and
   optimizer; keep training 2 more steps (the uninterrupted run).
2. this process, no process group: load into a plain (unsharded) converted model and a
   fresh AdamW: every tensor equals the ranks' full tensors; save again.
3. 2 ranks: load that into FSDP2 with the MXFP4 gather and into FSDP2 with its own
   high-precision gather: equal again, and 2 more steps on each give the uninterrupted
   run's parameters.

The checkpoints hold plain tensors only (the MXWeight wrapper never reaches a state
dict: this process loads them with DCP's weights-only unpickler and no allow-list, and
no file names the wrapper).
"""

from __future__ import annotations

import pytest
import torch

from dist_harness import run_ranks
from dist_training import DEFAULT, assert_params, batch, fsdp_model, full_params, loss_fn, make_model, rows_of

STEPS = 2


def _full(sd) -> dict:
    """A (nested) state dict with DTensors gathered and every tensor copied."""
    from torch.distributed.tensor import DTensor

    if isinstance(sd, dict):
        return {k: _full(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [_full(v) for v in sd]
    if isinstance(sd, DTensor):
        return sd.full_tensor().detach().clone()
    if isinstance(sd, torch.Tensor):
        return sd.detach().clone()
    return sd


def _wrapper_types(sd) -> set[str]:
    """Tensor types other than plain tensors and DTensors of plain local tensors."""
    from torch.distributed.tensor import DTensor

    found: set[str] = set()
    if isinstance(sd, dict):
        for v in sd.values():
            found |= _wrapper_types(v)
    elif isinstance(sd, DTensor):
        if type(sd._local_tensor) is not torch.Tensor:
            found.add(type(sd._local_tensor).__name__)
    elif isinstance(sd, torch.Tensor) and type(sd) is not torch.Tensor and type(sd) is not torch.nn.Parameter:
        found.add(type(sd).__name__)
    return found


def _train(model, opt, rank, world, first_step):
    for step in range(first_step, first_step + STEPS):
        x, y = batch(step)
        mine = rows_of(rank, world)
        loss_fn(model(x[mine]), y[mine]).backward()
        opt.step()
        opt.zero_grad()


def save_job(rank, world, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = fsdp_model(DEFAULT, mx_gather=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, rank, world, 0)
    msd, osd = get_state_dict(model, opt)
    wrappers = _wrapper_types(msd) | _wrapper_types(osd)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    saved = {"model": _full(msd), "optim": _full(osd)}
    _train(model, opt, rank, world, STEPS)
    return {"wrappers": wrappers, "saved": saved, "uninterrupted": full_params(model)}


def load_job(rank, world, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    out = {}
    for name, mx_gather in (("mx", True), ("hp", False)):
        model = fsdp_model(DEFAULT, mx_gather=mx_gather, seed=123)  # other initial values: the load must set all
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        msd, osd = get_state_dict(model, opt)
        loaded = {"model": _full(msd), "optim": _full(osd)}
        _train(model, opt, rank, world, STEPS)
        out[name] = {"loaded": loaded, "continued": full_params(model)}
    return out


def _assert_state_equal(got, want, what):
    assert type(got) is type(want), what
    if isinstance(want, dict):
        assert got.keys() == want.keys(), (what, sorted(got), sorted(want))
        for k in want:
            _assert_state_equal(got[k], want[k], f"{what}.{k}")
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), what
    else:
        assert got == want, what


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # DCP's no_dist note
def test_dcp_save_load_2_to_1_to_2_ranks_bit_exact(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    first, second = tmp_path / "from2", tmp_path / "from1"
    ranks = run_ranks(save_job, 2, path=str(first))
    saved, uninterrupted = ranks[0]["saved"], ranks[0]["uninterrupted"]
    assert all(r["wrappers"] == set() for r in ranks), [r["wrappers"] for r in ranks]
    for f in first.iterdir():
        data = f.read_bytes()
        assert b"MXWeight" not in data and b"portable_mx" not in data, f.name

    # one process, no process group: a plain converted model
    model = make_model(DEFAULT, seed=123)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(first), no_dist=True)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    msd, osd = get_state_dict(model, opt)
    _assert_state_equal(_full({"model": msd, "optim": osd}), saved, "1 process")
    assert type(model[0]).__name__ == "MXLinear"
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(second), no_dist=True)

    for name, res in run_ranks(load_job, 2, path=str(second))[0].items():
        _assert_state_equal(res["loaded"], saved, f"2 ranks ({name} gather)")
        assert_params(res["continued"], uninterrupted, what=f"resumed on 2 ranks ({name} gather):")
