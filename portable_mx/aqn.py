"""Adaptive quantization noise (AQN, numerics.md section 4): the noise schedule, and its
injection into the RMSNorm weights of the model that generates rollouts.

Contract
- Schedule over ``total_steps`` optimizer steps T with ``stages`` K (default 10),
  ``sigma_start`` 1e-2 and ``sigma_end`` 1e-4: step t belongs to stage
  ``s = floor(t * K / T)`` (clamped to [0, K-1]); stage 0 (the first T/K steps) has
  sigma 0; stage s >= 1 is noisy stage ``j = s - 1`` (j = 0..K-2) with
  ``sigma = sigma_start * (sigma_end / sigma_start) ** (j / (K - 2))`` (K = 2: the one
  noisy stage uses ``sigma_start``). Steps past T stay in the last stage.
- Injection: Gaussian noise N(0, sigma^2), drawn fresh on every call, added in fp32 to
  the weight of every RMSNorm module of a model that is *not* the trained one (the
  rollout copy). A norm weight stored in a 16-bit dtype is replaced by its fp32 value
  plus the noise (a bf16 weight near 1 has a 2^-7 ulp and would swallow sigma < ~2e-3),
  an fp64 one takes the fp32 noise in fp64;
  :func:`refresh_rollout_copy` copies the trained weights into the rollout copy first, so
  the noise never reaches the trained weights and never accumulates across updates.
  Such a norm's output is cast back to its input's dtype by a forward hook (the product
  formed in fp32, rounded once), so the 16-bit layers after it take it as before.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = [
    "AQNSchedule",
    "add_rmsnorm_noise",
    "is_rmsnorm",
    "refresh_rollout_copy",
    "rmsnorm_weights",
]


@dataclass(frozen=True)
class AQNSchedule:
    """The AQN noise schedule of numerics.md section 4 (see the module doc)."""

    total_steps: int
    stages: int = 10
    sigma_start: float = 1e-2
    sigma_end: float = 1e-4

    def __post_init__(self) -> None:
        if isinstance(self.total_steps, bool) or not isinstance(self.total_steps, int) or self.total_steps < 1:
            raise ValueError(f"total_steps must be a positive int; got {self.total_steps!r}")
        if isinstance(self.stages, bool) or not isinstance(self.stages, int) or self.stages < 2:
            raise ValueError(f"stages must be an int >= 2 (one silent stage, then noisy ones); got {self.stages!r}")
        for name in ("sigma_start", "sigma_end"):  # (a str compared with 0 raised a TypeError; True was 1.0)
            _real(getattr(self, name), name)
        if not (0 < self.sigma_start < math.inf and 0 < self.sigma_end < math.inf):
            raise ValueError(f"sigma_start and sigma_end must be finite and > 0; got {self.sigma_start}, "
                             f"{self.sigma_end}")

    def stage(self, step: int) -> int:
        """The stage (0..K-1) of optimizer step ``step`` (0-based; negative steps are stage 0)."""
        s = (max(step, 0) * self.stages) // self.total_steps
        return min(s, self.stages - 1)

    def stage_sigma(self, stage: int) -> float:
        """sigma of stage ``stage``: 0 for stage 0, the geometric ladder after it."""
        if stage <= 0:
            return 0.0
        j = min(stage, self.stages - 1) - 1
        if self.stages == 2:
            return float(self.sigma_start)
        return float(self.sigma_start * (self.sigma_end / self.sigma_start) ** (j / (self.stages - 2)))

    def sigma(self, step: int) -> float:
        """sigma at optimizer step ``step``."""
        return self.stage_sigma(self.stage(step))

    def sigmas(self) -> list[float]:
        """sigma of every step 0..T-1."""
        return [self.sigma(t) for t in range(self.total_steps)]


def is_rmsnorm(module: torch.nn.Module) -> bool:
    """True for ``torch.nn.RMSNorm`` and for any module whose class name ends in
    "RMSNorm" (the Llama/Qwen-style norms of most model code) that has a ``weight``."""
    if isinstance(module, torch.nn.RMSNorm):
        return module.weight is not None
    return type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "weight", None), torch.Tensor)


def rmsnorm_weights(
    model: torch.nn.Module, match: Callable[[torch.nn.Module], bool] = is_rmsnorm
) -> Iterator[tuple[str, torch.nn.Module]]:
    """(qualified name, module) of every norm module ``match`` accepts."""
    for name, module in model.named_modules():
        if match(module):
            yield name, module


def _real(value: Any, what: str) -> float:
    """``value`` (a real number: an int, a float, a numpy scalar, a Fraction or a
    one-element real tensor; not a bool) as a float; a TypeError naming ``what`` for
    anything else."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex() \
            and value.dtype is not torch.bool:
        return float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a real number; got {type(value).__name__} {value!r}")
    return float(value)


def _sigma(sigma: Any) -> float:
    """A noise level: a finite real number >= 0, as a float."""
    sigma = _real(sigma, "sigma")
    if not math.isfinite(sigma) or sigma < 0:
        raise ValueError(f"sigma must be finite and >= 0; got {sigma!r}")
    return sigma


@torch.no_grad()
def add_rmsnorm_noise(
    model: torch.nn.Module,
    sigma: float,
    *,
    generator: Optional[torch.Generator] = None,
    match: Callable[[torch.nn.Module], bool] = is_rmsnorm,
) -> int:
    """Add N(0, sigma^2) noise, in fp32, to the weight of every RMSNorm of ``model``, in
    place; a 16-bit weight becomes an fp32 Parameter (see the module doc), an fp32 or fp64
    one keeps its dtype (the fp32 noise added in it). The noise is
    drawn on the CPU from ``generator`` (the global generator when None) so that a seed
    gives the same noise on every device. sigma = 0 still converts the weights to fp32
    and adds nothing. A weight that several norms share (tied) gets one draw of noise,
    and stays shared (a 16-bit one becomes one fp32 Parameter of them all). Returns the
    number of distinct norm weights touched."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"add_rmsnorm_noise expects a torch.nn.Module; got {type(model).__name__}")
    sigma = _sigma(sigma)
    became: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(weight) -> (weight, what it became)
    for _, module in rmsnorm_weights(model, match):
        w = module.weight
        if id(w) in became:  # tied to a norm already noised: the same tensor, no second draw
            new = became[id(w)][1]
            if new is not w:
                module.weight = new
                _hook_cast(module)
            continue
        wide = w.dtype in (torch.float32, torch.float64)  # (kept in their own dtype; 16-bit ones become fp32)
        w32 = w.detach() if wide else w.detach().to(torch.float32)
        if sigma > 0:  # (on the CPU, whatever torch's default device: the same noise on every device)
            noise = torch.randn(w.shape, generator=generator, dtype=torch.float32, device="cpu")
            w32 = w32 + (sigma * noise).to(device=w32.device, dtype=w32.dtype)
        if wide:
            w.copy_(w32)
            became[id(w)] = (w, w)
        else:
            # made inside inference_mode, it would be an inference tensor, which the next refresh
            # outside it could not write (torch's "Inplace update to inference tensor")
            with torch.inference_mode(False):
                new = torch.nn.Parameter(w32.clone() if w32.is_inference() else w32, requires_grad=w.requires_grad)
            became[id(w)] = became[id(new)] = (w, new)  # (a norm seen later may hold either)
            module.weight = new
            _hook_cast(module)
    return len({id(new) for _, new in became.values()})


def _hook_cast(module: torch.nn.Module) -> None:
    """Give a norm whose weight became fp32 the forward hook :func:`_output_in_input_dtype`
    (once; with the call's keyword arguments, for a norm called as ``norm(hidden_states=h)``)."""
    if not getattr(module, _CAST_HOOK, False):
        module.register_forward_hook(_output_in_input_dtype, with_kwargs=True)
        setattr(module, _CAST_HOOK, True)


_CAST_HOOK = "_pmx_aqn_casts_output"
"""Marks a norm whose 16-bit weight :func:`add_rmsnorm_noise` made fp32 (and hooked)."""


def _output_in_input_dtype(module: torch.nn.Module, args: tuple, kwargs: dict, out):
    """Forward hook of a norm whose 16-bit weight was made fp32: its output in its input's
    dtype, as before the noise. transformers' Llama / Qwen RMSNorm return ``weight *
    h.to(input_dtype)``, which an fp32 weight makes fp32, and the model's next 16-bit layer
    then refuses; the product is still formed in fp32 (the noise kept at fp32 precision)
    and rounded once to the input's dtype."""
    x = args[0] if args else next(iter(kwargs.values()), None)
    if isinstance(out, torch.Tensor) and isinstance(x, torch.Tensor) and x.is_floating_point() \
            and out.dtype != x.dtype:
        return out.to(x.dtype)
    return out


@torch.no_grad()
def refresh_rollout_copy(
    trained: torch.nn.Module,
    rollout: torch.nn.Module,
    sigma: float,
    *,
    generator: Optional[torch.Generator] = None,
    match: Callable[[torch.nn.Module], bool] = is_rmsnorm,
) -> int:
    """Make ``rollout`` the trained weights plus fresh AQN noise: copy every parameter and
    buffer of ``trained`` into ``rollout`` (same module structure; names must match), then
    :func:`add_rmsnorm_noise`. Call it after every optimizer step. ``trained`` is only
    read. Returns the number of distinct norm weights refreshed (:func:`add_rmsnorm_noise`;
    at sigma = 0 they are refreshed and get no noise)."""
    for what, m in (("trained", trained), ("rollout", rollout)):
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"refresh_rollout_copy: {what} must be a torch.nn.Module; got {type(m).__name__}")
    sigma = _sigma(sigma)  # (before anything is copied)
    if trained is rollout:
        raise ValueError("the rollout copy must be a different module from the trained model")
    src = dict(trained.named_parameters())
    src.update(trained.named_buffers())
    dst = dict(rollout.named_parameters())
    dst.update(rollout.named_buffers())
    if src.keys() != dst.keys():
        missing = sorted(src.keys() ^ dst.keys())[:5]
        raise ValueError(f"trained and rollout models differ in their parameters: {missing}")
    for name, t in dst.items():
        s = src[name]
        if t.numel() and t.data_ptr() == s.data_ptr():  # (empty tensors all have address 0)
            raise ValueError(f"the rollout copy shares {name!r} with the trained model; deep-copy it first")
        if t.shape != s.shape:
            raise ValueError(f"{name}: shape {tuple(t.shape)} in the rollout copy, {tuple(s.shape)} trained")
        if t.is_inference() and not torch.is_inference_mode_enabled():
            raise ValueError(f"{name}: the rollout copy holds an inference tensor there (made inside "
                             "torch.inference_mode), which cannot be written outside it; make the copy outside "
                             "inference_mode, or refresh inside it")
    for name, t in dst.items():
        t.copy_(src[name].to(t.dtype))
    # a norm weight that an earlier refresh turned into fp32 is refilled from the trained
    # weight above in fp32 (exact); the noise is then drawn fresh
    return add_rmsnorm_noise(rollout, sigma, generator=generator, match=match)
