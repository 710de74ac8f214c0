"""AQN (numerics.md section 4): the schedule against independent float64 math, and the
injection: fp32 noise on the RMSNorm weights of a copy only, fresh on every refresh."""

import copy
import math

import pytest
import torch

from portable_mx.aqn import AQNSchedule, add_rmsnorm_noise, is_rmsnorm, refresh_rollout_copy, rmsnorm_weights


def expected_sigma(t: int, T: int, K: int, s0: float, s1: float) -> float:
    """numerics.md in float64: 0 in the first T/K steps, then stage j uses
    s0 * (s1/s0)^(j/(K-2)), where the stage of step t is floor(t / (T/K))."""
    stage_len = T / K
    stage = min(int(math.floor(t / stage_len + 1e-12)), K - 1)
    if stage == 0:
        return 0.0
    j = stage - 1
    return s0 * math.exp(math.log(s1 / s0) * j / (K - 2)) if K > 2 else s0


@pytest.mark.parametrize("T,K", [(100, 10), (60, 10), (37, 10), (120, 5), (10, 10), (7, 3)])
def test_schedule_matches_float64(T, K):
    s = AQNSchedule(T, K)
    for t in range(T + 5):
        want = expected_sigma(t, T, K, 1e-2, 1e-4)
        got = s.sigma(t)
        assert got == pytest.approx(want, rel=1e-12, abs=0.0), (t, got, want)


def test_schedule_shape_default():
    T, K = 100, 10
    s = AQNSchedule(T)
    sig = s.sigmas()
    assert sig[: T // K] == [0.0] * (T // K)  # the first T/K steps are silent
    assert sig[T // K] == pytest.approx(1e-2, rel=1e-15)  # stage j = 0 starts at sigma_start
    assert sig[-1] == pytest.approx(1e-4, rel=1e-12)  # stage j = K-2 ends at sigma_end
    stages = sorted(set(sig), reverse=True)
    assert len(stages) == K  # zero + K-1 geometric stages
    ratios = [stages[i + 1] / stages[i] for i in range(len(stages) - 2)]
    want = (1e-4 / 1e-2) ** (1 / (K - 2))
    assert all(r == pytest.approx(want, rel=1e-12) for r in ratios)
    # each stage lasts T/K steps
    assert all(sig.count(v) == T // K for v in stages)


def test_schedule_custom_and_invalid():
    s = AQNSchedule(20, stages=2, sigma_start=5e-3, sigma_end=1e-5)
    assert s.sigmas() == [0.0] * 10 + [5e-3] * 10
    for bad in (dict(total_steps=0), dict(total_steps=10, stages=1), dict(total_steps=10, sigma_start=0.0),
                dict(total_steps=True), dict(total_steps=10, stages=True)):  # (a bool is an int to Python)
        with pytest.raises(ValueError):
            AQNSchedule(**bad)


class Tiny(torch.nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.norm1 = torch.nn.RMSNorm(64, dtype=dtype)
        self.lin = torch.nn.Linear(64, 64, dtype=dtype)
        self.norm2 = torch.nn.RMSNorm(64, dtype=dtype)


def test_is_rmsnorm_finds_norms_only():
    m = Tiny()
    assert [n for n, _ in rmsnorm_weights(m)] == ["norm1", "norm2"]
    assert not is_rmsnorm(m.lin)
    assert not is_rmsnorm(torch.nn.LayerNorm(8))

    class LlamaRMSNorm(torch.nn.Module):  # name-based match for model-zoo norms
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(4))

    assert is_rmsnorm(LlamaRMSNorm())


def test_noise_on_copy_only_and_fp32():
    trained = Tiny(torch.bfloat16)
    before = {k: v.clone() for k, v in trained.state_dict().items()}
    rollout = copy.deepcopy(trained)
    g = torch.Generator().manual_seed(0)
    sigma = 1e-3  # below the bf16 ulp at 1 (2^-7): must survive because the add is in fp32
    n = refresh_rollout_copy(trained, rollout, sigma, generator=g)
    assert n == 2
    for k, v in trained.state_dict().items():  # the trained model is untouched
        assert torch.equal(v, before[k]) and v.dtype == torch.bfloat16
    for name in ("norm1", "norm2"):
        w = getattr(rollout, name).weight
        assert w.dtype == torch.float32
        delta = (w - getattr(trained, name).weight.float()).detach()
        # the exact noise: N(0,1) draws from the same generator, scaled in fp32
        assert delta.abs().max() > 0
        assert 0.5 * sigma < float(delta.std()) < 2 * sigma
    g2 = torch.Generator().manual_seed(0)
    want1 = trained.norm1.weight.float() + sigma * torch.randn(64, generator=g2)
    assert torch.equal(rollout.norm1.weight, want1)
    assert torch.equal(rollout.lin.weight, trained.lin.weight)  # non-norm weights: copied, no noise


def test_fp64_norms_keep_their_dtype_and_noise_is_drawn_on_the_cpu():
    """An fp64 norm weight became an fp32 Parameter (1 + 2**-40 lost, the forward on
    torch's mixed-dtype path); the noise followed torch's default device (under
    set_default_device("meta") a CPU model failed: "Cannot copy out of meta tensor")."""
    model = Tiny(torch.float64)
    weight = model.norm1.weight
    with torch.no_grad():
        weight.fill_(1 + 2**-40)
    add_rmsnorm_noise(model, 0.0)
    assert model.norm1.weight is weight and weight.dtype == torch.float64 and (weight == 1 + 2**-40).all()
    g = torch.Generator().manual_seed(3)
    torch.set_default_device("meta")
    try:
        add_rmsnorm_noise(model, 1e-3, generator=torch.Generator().manual_seed(3))
    finally:
        torch.set_default_device(None)
    want = (1 + 2**-40) + (1e-3 * torch.randn(64, generator=g)).double()
    assert torch.equal(model.norm1.weight, want)


def test_noise_is_fresh_and_does_not_accumulate():
    trained = Tiny()
    rollout = copy.deepcopy(trained)
    g = torch.Generator().manual_seed(1)
    refresh_rollout_copy(trained, rollout, 1e-2, generator=g)
    d1 = (rollout.norm1.weight - trained.norm1.weight).detach()
    refresh_rollout_copy(trained, rollout, 1e-2, generator=g)
    d2 = (rollout.norm1.weight - trained.norm1.weight).detach()
    assert not torch.equal(d1, d2)  # a fresh draw
    assert float(d2.std()) < 2e-2  # not d1 + d2: the copy starts from the trained weights each time
    # a trained update shows up in the copy at the next refresh
    with torch.no_grad():
        trained.lin.weight.add_(1.0)
    refresh_rollout_copy(trained, rollout, 0.0, generator=g)
    assert torch.equal(rollout.lin.weight, trained.lin.weight)
    assert torch.equal(rollout.norm1.weight, trained.norm1.weight)  # sigma 0: no noise


def test_refresh_rejects_shared_parameters():
    trained = Tiny()
    with pytest.raises(ValueError):
        refresh_rollout_copy(trained, trained, 1e-2)
    shallow = copy.copy(trained)
    with pytest.raises(ValueError):
        refresh_rollout_copy(trained, shallow, 1e-2)
    with pytest.raises(ValueError):
        add_rmsnorm_noise(trained, -1.0)


def test_refresh_accepts_a_deep_copy_with_empty_tensors():
    """A zero-size parameter or buffer (an empty cache, a pruned layer) has address 0 in
    both models: the deep copy is not taken for a shared one."""
    trained = Tiny()
    trained.register_buffer("kv_cache", torch.zeros(0, 4))
    rollout = copy.deepcopy(trained)
    assert refresh_rollout_copy(trained, rollout, 1e-2, generator=torch.Generator().manual_seed(1)) > 0


class LlamaRMSNorm(torch.nn.Module):
    """transformers' Llama / Qwen RMSNorm, as they write it: ``weight * h.to(input_dtype)``."""

    def __init__(self, n, dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n, dtype=dtype))

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(x.dtype)


def test_noised_16_bit_norms_keep_their_output_dtype():
    """A bf16 model with Llama-style norms: after AQN (its norm weights fp32 plus noise)
    the norms still return bf16, equal to the fp32 product of the noised weight and the
    normalised input rounded once to bf16, so the bf16 layers after them run (they
    refused the fp32 output before); refreshing again keeps one hook per norm."""
    trained = torch.nn.Sequential(LlamaRMSNorm(64, torch.bfloat16), torch.nn.Linear(64, 8, dtype=torch.bfloat16))
    rollout = copy.deepcopy(trained)
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        assert refresh_rollout_copy(trained, rollout, 1e-2, generator=g) == 1
    norm = rollout[0]
    assert norm.weight.dtype == torch.float32 and len(norm._forward_hooks) == 1
    x = torch.randn(5, 64, generator=g).bfloat16()
    h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    out = norm(x)
    assert out.dtype == torch.bfloat16 and torch.equal(out, (norm.weight * h.bfloat16()).bfloat16())
    assert rollout(x).dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tied_norm_weight_gets_one_draw_and_stays_tied(dtype):
    """Two norms sharing one weight (tied): one draw of noise, not two (the fp32 weight
    got sigma * sqrt(2) before), and still one tensor (a 16-bit one became two fp32
    Parameters with different noise, and the next refresh refused the untied copy)."""
    trained = torch.nn.Sequential(torch.nn.RMSNorm(64, dtype=dtype), torch.nn.Linear(64, 64, dtype=dtype),
                                  torch.nn.RMSNorm(64, dtype=dtype))
    with torch.no_grad():
        trained[0].weight.uniform_(0.5, 1.5)
    trained[2].weight = trained[0].weight
    rollout = copy.deepcopy(trained)
    sigma = 1e-2
    for seed in (4, 5):  # twice: the second refresh meets the weight the first made
        assert refresh_rollout_copy(trained, rollout, sigma, generator=torch.Generator().manual_seed(seed)) == 1
        assert rollout[0].weight is rollout[2].weight and rollout[0].weight.dtype == torch.float32
        want = trained[0].weight.float() + sigma * torch.randn(64, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(rollout[0].weight, want)


def test_a_noised_norm_called_with_a_keyword_keeps_its_output_dtype():
    """norm(hidden_states=h): the cast-back hook read only positional arguments, and the
    keyword call returned fp32 to the next bf16 layer."""
    class KwNorm(LlamaRMSNorm):
        def forward(self, hidden_states):
            return super().forward(hidden_states)

    model = torch.nn.Sequential(KwNorm(64, torch.bfloat16))
    add_rmsnorm_noise(model, 1e-2, generator=torch.Generator().manual_seed(0))
    h = torch.randn(3, 64).bfloat16()
    assert model[0](hidden_states=h).dtype == torch.bfloat16
    assert torch.equal(model[0](hidden_states=h), model[0](h))


def test_schedule_refuses_infinite_sigmas():
    with pytest.raises(ValueError, match="finite"):
        AQNSchedule(10, sigma_start=float("inf"))
    with pytest.raises(ValueError, match="finite"):
        AQNSchedule(10, sigma_end=float("inf"))


def test_careless_sigmas_and_models_are_refused_by_name():
    """A str sigma raised "'<' not supported between 'int' and 'str'", True was taken as
    1.0, None gave "must be real number", and a list of modules an AttributeError (audit)."""
    norm = torch.nn.Sequential(torch.nn.RMSNorm(8))
    for bad in ("1e-2", True, None):
        with pytest.raises(TypeError, match="sigma_start must be a real number"):
            AQNSchedule(10, sigma_start=bad)
        with pytest.raises(TypeError, match="sigma must be a real number"):
            add_rmsnorm_noise(norm, bad)
        rollout = copy.deepcopy(norm)
        with torch.no_grad():
            rollout[0].weight.fill_(3.0)
        with pytest.raises(TypeError, match="sigma must be a real number"):
            refresh_rollout_copy(norm, rollout, bad)
        assert (rollout[0].weight == 3.0).all()  # refused before anything was copied
    with pytest.raises(TypeError, match="expects a torch.nn.Module; got list"):
        add_rmsnorm_noise([norm], 0.1)
    with pytest.raises(TypeError, match="rollout must be a torch.nn.Module; got list"):
        refresh_rollout_copy(norm, [copy.deepcopy(norm)], 0.1)
    # real numbers of every kind: an int, a Fraction, a numpy float, a 0-d tensor
    from fractions import Fraction

    import numpy as np

    for sigma in (0, Fraction(1, 100), np.float32(0.01), torch.tensor(0.01)):
        assert add_rmsnorm_noise(norm, sigma, generator=torch.Generator().manual_seed(0)) == 1
        assert AQNSchedule(10, sigma_start=sigma or 0.01).sigma(9) > 0


def test_a_16_bit_rollout_copy_refreshed_inside_inference_mode_refreshes_outside_it():
    """A rollout function under @torch.inference_mode() that refreshes the copy made each
    16-bit norm weight an fp32 inference tensor; the next refresh after the optimizer step
    (outside inference mode) raised torch's "Inplace update to inference tensor outside
    InferenceMode", naming neither AQN nor the norm. Now the new weights are normal
    tensors, and each refresh gives the bits of the same refresh made outside inference mode
    (the trained weight in fp32 plus the seed's noise)."""
    trained = torch.nn.Sequential(LlamaRMSNorm(64, torch.bfloat16), torch.nn.Linear(64, 8, dtype=torch.bfloat16))
    inside, outside = copy.deepcopy(trained), copy.deepcopy(trained)
    for step in range(3):
        with torch.no_grad():
            trained[0].weight.add_(0.125)  # (an optimizer step)
        with torch.inference_mode(step % 2 == 0):
            refresh_rollout_copy(trained, inside, 1e-2, generator=torch.Generator().manual_seed(step))
        refresh_rollout_copy(trained, outside, 1e-2, generator=torch.Generator().manual_seed(step))
        assert not inside[0].weight.is_inference()
        assert torch.equal(inside[0].weight, outside[0].weight)
        assert torch.equal(inside[1].weight, trained[1].weight)
    with torch.inference_mode():
        made_inside = copy.deepcopy(trained).to(torch.float32)  # (fp32: its parameters are inference tensors)
    with pytest.raises(ValueError, match=r"0\.weight: the rollout copy holds an inference tensor"):
        refresh_rollout_copy(trained, made_inside, 1e-2)
