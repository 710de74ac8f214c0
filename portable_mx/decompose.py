"""The exact three-way decomposition of MXFP4 quantization error (numerics.md section 3).

For each 32-block, with x the input, Q the dequantized value actually produced (Q is the
corrected quantizer's output under MBS/OF: outliers are survivors holding their bf16
value, except one of magnitude 2**-134 or less, which bf16 holds as 0: deadzoned like
any Q = 0) and e = Q - x:

- "gain" (default): beta = sum_S Q x / sum_S x^2 over the survivors S (not deadzoned);
  e_dead = -x on the deadzone D = {Q = 0, x != 0}; e_scale = (beta - 1) x on S;
  e_grid = Q - beta x on S. Exact (e = e_scale + e_dead + e_grid to fp32 rounding) and
  orthogonal (the three energies add up to ||e||^2).
- "counterfactual": Q* = s* g(x / s*) with the ideal real scale s* = amax/6 of the values
  that were quantized; e_scale = Q - Q*; e_dead = -x where Q* = 0 and x != 0; e_grid =
  Q* - x elsewhere. Exact, not orthogonal. At outlier positions Q* = Q.

The math is written once here, on blocked tensors ``[..., n_blocks, 32]``; backends call
it (or reproduce it in a kernel and are tested against it).

Range. The statistics are right for every finite x, from fp32 subnormals to the fp32
maximum, on every backend, with two exceptions of "counterfactual", whose Q* is computed
in fp32 (:func:`ideal_quantize`; the README's departures from the spec): an fp32 x within
a few ulps of a grid tie or of the deadzone edge s*/4 of the real s* = amax/6 may take
the code on the other side (x/s* = 0.2500000075 read as 1/4: deadzoned), and in a block of
fp32 subnormals Q* is a multiple of 2**-149, its scale and grid parts carrying that
rounding. Here every component is computed in float64 from x and Q
(fp32 values, so each product is exact and no square overflows or underflows), beta is
that float64 gain rounded once to fp32, and the per-block energies are float64 (a block's
energy spans 2**-298 .. 2**261, beyond fp32's range). The element tensors are the float64
components rounded once to fp32. A kernel that sums in fp32 must scale each block by a
power of two first (the Triton kernel does; see its module doc). Subnormal x are not
flushed: a block whose scale exponent would fall below -127 gets E8M0 byte 0 = 2**-127
(numerics.md section 1), y = x * 2**127 is exact (without macro blocks; with them the
division by the factor m is fp32's and rounds below fp32's normals: README), and
(rounding to nearest) its values
with |x| <= 2**-129 are deadzoned (Q = 0, e_dead = -x): the statistics count them as the
element tensors show them (a block of such values has relative error 1, all deadzone).

The one finite x without finite statistics is one whose Q is itself infinite: Q is the
fp32 value dequantize produces: under rceil/even/ceil scales a block whose largest |x|
is at least 3.5 * 2**126 (about 2.98e38, 7/8 of the fp32 maximum; with stochastic
rounding, above 3 * 2**126) can quantize its largest values to 2**128, which fp32 holds as
+-inf; with macro blocks, a macro block whose largest |x| is at least about 3.39e38 gets a
factor m = 171/128 or more, m * 6 * 2**125 passes the fp32 maximum, and that value and any
of its macro block's from about 2.84e38 up are +-inf; an outlier of at least
2**128 - 2**119 (about 3.396e38; bfloat16's maximum is 3.389e38) is stored as +-inf. The error is
then infinite, as the ``dequantized`` elements show: that block's error energy is inf,
its beta, scale and grid statistics inf or NaN, and so are the whole-tensor figures
(relative MSE inf, shares NaN).

Non-finite input. A block holding NaN or Inf has no decomposition: its float statistics
are NaN, its counts 0 and its element tensors NaN, and the Decomposition carries the
number of NaN/Inf values of x as a device tensor (``non_finite``). Computing one never
synchronises with the device; every whole-tensor figure (:meth:`Decomposition.totals`,
``shares``, ``relative_mse``, ``summary``), which has to synchronise anyway, raises
ValueError when that count is not 0, so a NaN never turns into a silent number.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional

import torch

from .format import E2M1_VALUES, e2m1_round_nearest
from .recipe import QuantRecipe

DEFINITIONS = ("gain", "counterfactual")


@dataclass(frozen=True)
class Decomposition:
    """The decomposition of ``Q(x) - x`` for one tensor.

    Tensors shaped like x (fp32; None when computed with ``full=False``):
    ``dequantized`` (Q), ``scale_bias``, ``deadzone``, ``grid_noise``.
    Per-block statistics, shaped ``[*lead, n_blocks]`` where ``lead`` is x's shape without
    the quantized axis: ``beta`` (fp32, the least-squares gain of the survivors, 1 for a
    block with none), ``dead_count`` and ``clip_count`` (int32; clipped = |x/s| > 6 before
    rounding), ``energy_scale``, ``energy_dead``, ``energy_grid`` (float64 sums of squares
    of each component), ``energy_error`` (||Q - x||^2) and ``energy_signal`` (||x||^2), all
    float64 because a block's energy can lie outside fp32's range (the module doc, "Range").
    On every backend the energies are within 2 * 31 fp32 roundings (about 2**-19) of the
    exact sums for the signal, deadzone and error energies; the scale and grid energies
    also carry the fp32 rounding of beta, up to 16 * 31 roundings (about 2**-15) of the
    block's signal energy. The reference computes them in float64.
    """

    definition: str
    recipe: QuantRecipe
    axis: int
    beta: torch.Tensor
    dead_count: torch.Tensor
    clip_count: torch.Tensor
    energy_scale: torch.Tensor
    energy_dead: torch.Tensor
    energy_grid: torch.Tensor
    energy_error: torch.Tensor
    energy_signal: torch.Tensor
    dequantized: Optional[torch.Tensor] = None
    scale_bias: Optional[torch.Tensor] = None
    deadzone: Optional[torch.Tensor] = None
    grid_noise: Optional[torch.Tensor] = None
    num_elements: int = 0
    """Elements of x (without the zero padding to a multiple of 32); 0 when unknown, and
    then fractions are taken over the padded count."""
    non_finite: Optional[torch.Tensor] = None
    """The number of NaN/Inf values of x (0-d int64 on x's device; None: not counted,
    taken as 0). Not 0: the whole-tensor figures raise ValueError (see the module doc)."""

    _ENERGIES = ("scale", "dead", "grid", "error", "signal")

    def _reduce(self) -> dict[str, float]:
        """The five energies, beta's sum and the two counts summed over every block in
        float64 on the device, and the non-finite count, read back in one transfer; raises
        ValueError when x held NaN/Inf."""
        if self.beta.device.type == "meta":
            raise ValueError("a decomposition on the meta device holds shapes only: it has no whole-tensor figures")

        def total(t: torch.Tensor) -> torch.Tensor:
            return t.sum(dtype=torch.float64)

        sums = [total(getattr(self, f"energy_{k}")) for k in self._ENERGIES]
        sums += [total(self.beta), total(self.dead_count), total(self.clip_count)]
        bad = self.non_finite if self.non_finite is not None else torch.zeros((), dtype=torch.int64)
        sums.append(bad.to(device=self.beta.device, dtype=torch.float64).reshape(()))
        values = torch.stack(sums).tolist()  # the one synchronisation
        if values[-1]:
            raise ValueError(f"decompose needs finite input; x holds {int(values[-1])} NaN/Inf value(s) in fp32, "
                             "the precision it quantizes (a float64 |x| of 2**128 - 2**103, about 3.4028236e38, "
                             "or more is Inf there)")
        return dict(zip(self._ENERGIES + ("beta_sum", "dead_count", "clip_count"), values))

    def totals(self) -> dict[str, float]:
        """Whole-tensor energies (float64 sums over blocks). Raises ValueError when x held
        NaN/Inf."""
        t = self._reduce()
        return {k: t[k] for k in self._ENERGIES}

    @staticmethod
    def _shares(t: dict[str, float]) -> dict[str, float]:
        total = t["scale"] + t["dead"] + t["grid"]
        if total == 0.0:
            return {"scale": 0.0, "dead": 0.0, "grid": 0.0}
        return {k: t[k] / total for k in ("scale", "dead", "grid")}

    def shares(self) -> dict[str, float]:
        """Each component's share of the summed component energy (0 for an exact tensor).
        For "gain" the summed component energy equals the error energy. Raises ValueError
        when x held NaN/Inf."""
        return self._shares(self._reduce())

    def relative_mse(self) -> float:
        """||Q(x) - x||^2 / ||x||^2 over the whole tensor (0 for an all-zero x). Raises
        ValueError when x held NaN/Inf."""
        t = self._reduce()
        return t["error"] / t["signal"] if t["signal"] > 0 else 0.0

    def summary(self) -> dict[str, float]:
        """Shares, relative MSE, mean beta (over blocks), and the deadzone and clip
        fractions of x's elements, as plain floats (one synchronisation). Raises ValueError
        when x held NaN/Inf."""
        t = self._reduce()
        # padding is zero: never dead, never clipped, so only the denominator changes
        n = max(self.num_elements or self.dead_count.numel() * 32, 1)
        out = {f"share_{k}": v for k, v in self._shares(t).items()}
        out["relative_mse"] = t["error"] / t["signal"] if t["signal"] > 0 else 0.0
        out["mean_beta"] = t["beta_sum"] / self.beta.numel() if self.beta.numel() else 1.0
        out["dead_fraction"] = t["dead_count"] / n
        out["clip_fraction"] = t["clip_count"] / n
        return out

    def map_tensors(self, block_fn, element_fn) -> "Decomposition":
        """A copy with ``block_fn`` applied to every per-block tensor and ``element_fn`` to
        every element tensor (used to move from the rows layout to x's layout)."""
        changes = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, torch.Tensor) or f.name == "non_finite":
                continue
            is_element = f.name in ("dequantized", "scale_bias", "deadzone", "grid_noise")
            changes[f.name] = element_fn(v) if is_element else block_fn(v)
        return replace(self, **changes)


def _sumsq(t: torch.Tensor) -> torch.Tensor:
    return (t * t).sum(-1)


def gain_components(x: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Definition G on blocked ``x``, ``q`` ``[..., 32]``, computed in their dtype (the
    reference passes float64 holding fp32 values: every product below is then exact).

    Returns (beta [...], dead mask, e_scale, e_dead, e_grid) with the masks and components
    shaped like x.
    """
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    dead = (q == 0) & (x != 0)
    surv = ~dead
    num = torch.where(surv, q * x, zero).sum(-1)
    den = torch.where(surv, x * x, zero).sum(-1)
    beta = torch.where(den > 0, num / torch.where(den > 0, den, 1.0), torch.ones_like(den))
    b = beta.unsqueeze(-1)
    e_dead = torch.where(dead, -x, zero)
    e_scale = torch.where(surv, (b - 1) * x, zero)
    e_grid = torch.where(surv, q - b * x, zero)
    return beta, dead, e_scale, e_dead, e_grid


def ideal_quantize(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """Q* = s* g(x / s*) with the real scale s* = amax / 6 per block (round to nearest,
    ties to even); blocked fp32 ``x`` ``[..., 32]``, ``amax`` ``[...]``; Q* = 0 when amax = 0.
    Computed in fp32 (the definition every backend reproduces bit for bit): s = fl(A / 6),
    y = fl(X / s), Q* = fl(fl(s g) * 2**-p), with A = amax * 2**p and X = x * 2**p (exact)
    for p = 64 where amax < 2**-100, else p = 0: so that s is never an fp32 subnormal (which
    keeps fewer bits: with amax about 1e-41 Q* was off by up to 17% of amax). Q* itself is
    rounded to fp32: in a block of fp32 subnormals (amax < 2**-126) to a multiple of
    2**-149, a visible share of amax when amax is a few such steps (a block [5, 1, ..., 1]
    * 2**-149 gets Q* = 2**-149 for its 1s, where the real s* gives 5/6 of that: a scale
    energy 20% above the real s*'s)."""
    up = torch.where(amax < 2.0**-100, 2.0**64, 1.0).to(torch.float32)
    s = (amax * up / 6.0).unsqueeze(-1)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    y = x * up.unsqueeze(-1) / safe
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=x.device)
    g = grid[e2m1_round_nearest(y.abs()).long()]
    g = torch.where(y < 0, -g, g)
    return torch.where(s > 0, s * g * (1.0 / up).unsqueeze(-1), torch.zeros_like(x))


def counterfactual_components(
    x: torch.Tensor, q: torch.Tensor, rest_amax: torch.Tensor, outlier_mask: Optional[torch.Tensor]
) -> tuple[torch.Tensor, ...]:
    """Definition C on blocked ``x``, ``q`` ``[..., 32]`` (fp32 values, in fp32 or float64:
    Q* is always computed in fp32 by :func:`ideal_quantize`, the differences in x's dtype);
    ``rest_amax`` ``[...]`` is the amax of the values that went through the MXFP4 grid
    (outliers excluded).

    Returns (dead mask, e_scale, e_dead, e_grid).
    """
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    q_star = ideal_quantize(x.float(), rest_amax.float()).to(x.dtype)
    if outlier_mask is not None:
        q_star = torch.where(outlier_mask, q, q_star)
    dead = (q_star == 0) & (x != 0)
    e_scale = q - q_star
    e_dead = torch.where(dead, -x, zero)
    e_grid = torch.where(dead, zero, q_star - x)
    return dead, e_scale, e_dead, e_grid


def decompose_blocks(
    x: torch.Tensor,
    q: torch.Tensor,
    *,
    definition: str,
    recipe: QuantRecipe,
    clip_count: torch.Tensor,
    rest_amax: torch.Tensor,
    outlier_mask: Optional[torch.Tensor],
    full: bool,
) -> Decomposition:
    """Both definitions on blocked fp32 ``x`` and ``q`` ``[R, n_blocks, 32]`` -> a
    Decomposition in the rows layout (element tensors ``[R, n_blocks * 32]``).

    Everything is computed in float64 from x and q (the module doc, "Range"): beta is
    rounded once to fp32, the energies stay float64, the element tensors are rounded once
    to fp32. Blocks of x holding NaN/Inf get NaN statistics, counts 0 and NaN elements,
    and ``non_finite`` counts x's NaN/Inf values (module doc); nothing here synchronises."""
    if definition not in DEFINITIONS:
        raise ValueError(f"definition must be one of {DEFINITIONS}; got {definition!r}")
    bad = ~torch.isfinite(x)
    special = bad.any(-1)
    x64, q64 = x.double(), q.double()
    beta, dead, e_scale, e_dead, e_grid = gain_components(x64, q64)
    if definition == "counterfactual":
        dead, e_scale, e_dead, e_grid = counterfactual_components(x64, q64, rest_amax, outlier_mask)
        energy_scale = _sumsq(e_scale)
    else:  # ||(beta - 1) x||^2 over the survivors, factored (as kernels sum it; also where Q overflowed: beta = inf)
        energy_scale = (beta - 1) ** 2 * _sumsq(torch.where(dead, 0.0, x64))
    nan = torch.tensor(float("nan"), device=x.device)

    def stat(t: torch.Tensor) -> torch.Tensor:
        return torch.where(special, nan.to(t.dtype), t)

    def count(t: torch.Tensor) -> torch.Tensor:
        return torch.where(special, 0, t).to(torch.int32)

    def element(t: torch.Tensor) -> torch.Tensor:
        return torch.where(special.unsqueeze(-1), nan, t.float()).flatten(-2)

    return Decomposition(
        definition=definition,
        recipe=recipe,
        axis=1,
        beta=stat(beta.float()),
        dead_count=count(dead.sum(-1, dtype=torch.int32)),
        clip_count=count(clip_count),
        energy_scale=stat(energy_scale),
        energy_dead=stat(_sumsq(e_dead)),
        energy_grid=stat(_sumsq(e_grid)),
        energy_error=stat(_sumsq(q64 - x64)),
        energy_signal=stat(_sumsq(x64)),
        dequantized=element(q) if full else None,
        scale_bias=element(e_scale) if full else None,
        deadzone=element(e_dead) if full else None,
        grid_noise=element(e_grid) if full else None,
        non_finite=bad.sum(dtype=torch.int64),
    )


__all__ = [
    "DEFINITIONS",
    "Decomposition",
    "counterfactual_components",
    "decompose_blocks",
    "gain_components",
    "ideal_quantize",
]


def zeros_decomposition(rows: int, k: int, recipe: QuantRecipe, definition: str, full: bool,
                        device: torch.device) -> Decomposition:
    """The rows-layout Decomposition of an all-zero ``[rows, k]`` tensor, built without a
    quantizer: what an empty tensor decomposes to, and the shapes and dtypes that shape
    propagation (the meta device) reports."""
    nb = -(-k // 32)
    blocks = torch.zeros(rows, nb, 32, device=device)
    stats = blocks.sum(-1)
    return decompose_blocks(blocks, blocks, definition=definition, recipe=recipe, clip_count=stats,
                            rest_amax=stats, outlier_mask=None, full=full)
