"""Smoke test of the RL demo: a tiny configuration end to end (warm-up, parity across the
CPU backends, component probe, three arms), its outputs and the results.json schema."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # rl_demo runs from a checkout

from rl_demo import cli  # noqa: E402
from rl_demo.model import GPT, ModelConfig, generate, numerics_view, token_logprobs  # noqa: E402
from rl_demo.tasks import ANSWER_LEN, Task, reward  # noqa: E402


def test_tasks_encode_reversed_digits():
    add, mul = Task("add"), Task("mul")
    p, a = add.encode(torch.tensor([123]), torch.tensor([456]))
    assert p.tolist() == [[3, 2, 1, 10, 6, 5, 4, 12]]
    assert a.tolist() == [[9, 7, 5, 0, 13]]  # 579 -> "9750" + EOS
    p, a = mul.encode(torch.tensor([999]), torch.tensor([9]))
    assert p.tolist() == [[9, 9, 9, 11, 9, 12]]
    assert a.tolist() == [[1, 9, 9, 8, 13]]  # 8991
    for t in (add, mul):
        assert t.positions().shape == (t.seq_len,)
    assert reward(a, a).tolist() == [1.0]
    assert reward(a.flip(1), a).tolist() == [0.0]


def test_numerics_view_shares_parameters():
    import portable_mx as pmx

    m = GPT(ModelConfig(d_model=32, n_layers=1, n_heads=2))
    v = numerics_view(m, pmx.QuantRecipe())
    assert {id(p) for p in m.parameters()} == {id(p) for p in v.parameters()}
    assert isinstance(v.blocks[0].mlp.fc1, pmx.nn.MXLinear) and type(m.blocks[0].mlp.fc1) is torch.nn.Linear
    assert type(v.head) is torch.nn.Linear  # the head stays high precision
    task = Task()
    g = torch.Generator().manual_seed(0)
    p, a = task.sample(4, g)
    pos = task.positions()
    out, logp, ent = generate(v, p, pos, ANSWER_LEN, greedy=False, generator=g)
    assert out.shape == logp.shape == ent.shape == (4, ANSWER_LEN)
    # the sampled log-probabilities equal the teacher-forced ones (KV cache vs full forward)
    torch.testing.assert_close(logp, token_logprobs(v, p, out, pos).detach(), atol=1e-4, rtol=0)


def _finite(obj):
    if isinstance(obj, float):
        return math.isfinite(obj)
    if isinstance(obj, dict):
        return all(_finite(v) for v in obj.values())
    if isinstance(obj, list):
        return all(_finite(v) for v in obj)
    return True


def test_tiny_run_end_to_end(tmp_path):
    pytest.importorskip("matplotlib", reason="the RL demo draws report.png with matplotlib, part of the demo "
                        "extra: pip install 'portable_mx[demo]'")
    out = tmp_path / "demo"
    rc = cli.main(["--tiny", "--out", str(out), "--no-progress"])
    assert rc == 0
    for f in ("results.json", "report.md", "report.png", "warmup.pt"):
        assert (out / f).stat().st_size > 0, f
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = json.loads((out / "results.json").read_text())
    assert r["schema"] == "rl_demo.results/1"
    assert r["finite"] is True and r["non_finite"] == [] and _finite(r)
    for key in ("command", "config", "environment", "timing", "warmup", "parity", "probe", "arms"):
        assert key in r
    assert set(r["arms"]) == {"hp", "mxfp4", "mbs_of_aqn"}
    iters = r["config"]["iterations"]
    for name, arm in r["arms"].items():
        assert set(arm["seeds"]) == {"0"}
        s = arm["seeds"]["0"]
        for k in ("iteration", "reward", "entropy", "kl_ref", "clip_fraction", "loss", "sigma"):
            assert len(s["curve"][k]) == iters
        assert s["evals"][-1]["iteration"] == iters
        for k in ("greedy_accuracy_hp", "greedy_accuracy_q", "entropy_hp", "entropy_q", "kl_hp_q"):
            assert k in s["evals"][-1]
        grad = s["evals"][-1]["grad"]
        assert {"all", "embed", "blocks.0", "blocks.1", "head"} <= set(grad)
        assert set(grad["all"]) == {"cos", "rel_err", "norm_ratio"}
        dec = s["end"]["decomposition"]["blocks.0.mlp.fc1"]
        assert set(dec) == {"weight", "input", "grad_output"}
        shares = dec["weight"]
        assert shares["share_scale"] + shares["share_dead"] + shares["share_grid"] == pytest.approx(1.0, abs=1e-9)
        assert 0.0 <= shares["dead_fraction"] <= 1.0 and 0.0 <= shares["clip_fraction"] <= 1.0
        for stat in ("reward_start", "reward_end", "reward_gain", "final_grad_cos"):
            assert set(arm["summary"][stat]) == {"mean", "std", "n"}
    aqn = r["arms"]["mbs_of_aqn"]["seeds"]["0"]
    assert "greedy_accuracy_rollout" in aqn["evals"][-1]
    assert aqn["curve"]["sigma"][0] == 0.0  # the first T/K steps are silent
    assert all(v == 0.0 for v in r["arms"]["mxfp4"]["seeds"]["0"]["curve"]["sigma"])
    # the high-precision arm's own numerics are exact, the MXFP4 arms' are not
    assert r["arms"]["hp"]["recipe"] is None and r["arms"]["mxfp4"]["recipe"]["scale_rule"] == "floor"
    # component probe: "all" reproduces MXFP4 training numerics; "exact" is exact
    p = r["probe"]
    assert set(p["modes"]) == {"exact", "scale", "dead", "grid", "all"}
    assert p["modes"]["exact"]["grad"]["all"]["cos"] == pytest.approx(1.0, abs=1e-9)
    assert p["all_vs_mxfp4_grad"]["cos"] == pytest.approx(1.0, abs=1e-4)
    # parity: reference against itself, and the interpreter when this process can run it
    rows = {(x["backend"], x["device"]): x for x in r["parity"]["results"]}
    ref = rows[("reference", "cpu")]
    assert ref["status"] == "ran" and ref["equal"] and ref["quantize_bytes_equal"] == ref["quantize_cases"]
    interp = rows[("triton-interpret", "cpu")]
    if interp["status"] == "ran":
        assert interp["quantize_bytes_equal"] == interp["quantize_cases"] > 0
        assert interp["counts_equal"] == interp["decompose_cases"] > 0
        assert interp["equal"], interp["mismatches"]
    md = (out / "report.md").read_text()
    for heading in ("## Arms", "## Component probe", "## Decomposition parity across backends"):
        assert heading in md
