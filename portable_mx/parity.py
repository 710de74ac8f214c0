"""``portable-mx parity``: the cross-backend parity report, and its comparison.

A report runs a fixed corpus through :func:`portable_mx.quantize` and
:func:`portable_mx.decompose` on one device and records, per case, what a backend must
reproduce: the sha256 of every byte quantize writes (qdata, scales, macro_scales,
outlier_values, outlier_indices) and, for both decompose definitions, the whole-tensor
statistics (``Decomposition.totals()``, ``summary()``) and the sha256 of the per-block
dead and clip counts. Two reports from different backends, devices or vendors must agree:
hashes and counts exactly, statistics to fp32 summation-order noise (:data:`TOLERANCES`).

The corpus is built on the CPU from integer draws of a seeded ``torch.Generator`` and
turned into floats with correctly rounded IEEE operations only (integer sums, +, *, /,
sqrt, casts), so it is the same bytes on every machine; only then is it moved to the
device. Its normal variates are Irwin-Hall sums of 12 uniforms (variance 1, support
[-6, 6]) rather than torch.randn, whose CPU kernel is vectorised per instruction set and
whose last bits are not promised to match between machines.

Report schema (JSON, ``SCHEMA``)::

    {"schema": "portable_mx.parity/1", "corpus": "small" | "full",
     "corpus_sha256": hex (:func:`corpus_digest`), "case_filter": glob | null,
     "versions": {"portable_mx", "torch", "triton", "python", "cuda", "hip"},
     "device": {"name": "cuda:0", "description": "..."},
     "backend_forced": name | null, "backends": {"quantize": name, "decompose": name},
     "cases": {case_id: case}}

    case_id = "<op>/<tensor>/<dtype>/<recipe>", op in quantize | decompose-gain |
    decompose-counterfactual; every case has "op", "tensor", "shape", "axis", "dtype",
    "recipe" (QuantRecipe fields), "input_sha256", "backend", and either "error"
    ("Type: message") or its results:
      quantize:  "outputs": {field: {"sha256", "shape", "dtype"} | null}
      decompose: "definition", "counts": {"dead_count"|"clip_count": {"sha256", ...}},
                 "totals": {...}, "summary": {...}
    Non-finite statistics are written as the strings "nan", "inf", "-inf".

No timestamps and no timings: two runs of one backend give byte-identical reports.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import sys
import time
import warnings
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from ._argtypes import output_file_problem
from .tuning.files import write_atomic
from .decompose import DEFINITIONS

HELP = ("parity report of quantize/decompose on a fixed corpus (bytes exact; decompose's statistics "
        "to fp32 rounding), or compare reports")

EXIT_OK, EXIT_MISMATCH, EXIT_UNAVAILABLE, EXIT_NOTHING_CHECKED = 0, 1, 2, 3
EXIT_CODES = """exit status:
  0  every case ran (run) / the reports agree on every case (--compare)
  1  a case errored (run) / the reports disagree (--compare): a parity failure
  2  the backend or device cannot be used here, or bad arguments
  3  nothing was checked: a report file is missing, unreadable or not a parity report,
     a report holds no cases, or --filter matches no case of the corpus"""

SCHEMA = "portable_mx.parity/1"
CORPORA = ("small", "full")
SEED = 20240521
STOCHASTIC_SEED = 12345
MX_FIELDS = ("qdata", "scales", "macro_scales", "outlier_values", "outlier_indices")
COUNT_FIELDS = ("dead_count", "clip_count")

# ----------------------------------------------------------------------------- tolerances

RTOL = 1e-5
"""Relative tolerance of every float statistic (about 170 fp32 ulps)."""

ENERGY_ATOL = 1e-7
"""Absolute floor of an energy, as a fraction of the case's signal energy ||x||^2. An
energy that nearly cancels (the scale energy ((beta - 1) x)^2 with beta ~ 1) carries
rounding noise of order |beta - 1| * ulp(beta) * ||x||^2 rather than of order itself:
with an error d in beta, RTOL * u^2 + ENERGY_ATOL >= 2 u d holds for every u = |beta - 1|
as long as d <= sqrt(RTOL * ENERGY_ATOL) = 1e-6 (16 fp32 ulps of beta)."""

SUMMARY_ATOL = {
    "share_scale": 1e-5,
    "share_dead": 1e-5,
    "share_grid": 1e-5,
    "relative_mse": 1e-9,
    "mean_beta": 1e-6,
}
"""Absolute floors of the dimensionless summary statistics. Shares divide a nearly
cancelling energy by the (small) error energy, so they get ENERGY_ATOL / relative MSE;
relative MSE and mean beta are well conditioned and rely on RTOL."""

DEFAULT_SUMMARY_ATOL = 1e-6
EXACT_SUMMARY = ("dead_fraction", "clip_fraction")
"""Summary statistics that are ratios of integer counts: equal counts give equal floats."""

TOLERANCES = {
    "hashes, shapes, dtypes, dead/clip counts and fractions": "exact",
    "totals (energies)": f"|a-b| <= {RTOL:g}*max(|a|,|b|) + {ENERGY_ATOL:g}*signal",
    "summary (shares, relative_mse, mean_beta)": f"|a-b| <= {RTOL:g}*max(|a|,|b|) + {SUMMARY_ATOL}",
    "non-finite values": "identical (nan == nan, inf == inf)",
}


# ----------------------------------------------------------------------------- corpus


def _uniform_ints(g: torch.Generator, n: int, bits: int) -> torch.Tensor:
    """n integers uniform in [0, 2**bits), int64 (mt19937 draws: the same everywhere)."""
    return torch.randint(0, 2**bits, (n,), generator=g, dtype=torch.int64)


def _normal(g: torch.Generator, n: int) -> torch.Tensor:
    """n approximately N(0,1) float64 values: Irwin-Hall sum of 12 24-bit uniforms minus 6,
    computed exactly (integer sum, power-of-two scaling)."""
    total = torch.zeros(n, dtype=torch.int64)
    for _ in range(12):
        total += _uniform_ints(g, n, 24)
    return (total - 6 * 2**24).to(torch.float64) * 2.0**-24


def _student_t3(g: torch.Generator, n: int) -> torch.Tensor:
    """n Student-t(3)-like float64 values: z0 / sqrt((z1^2 + z2^2 + z3^2) / 3) with the
    z from :func:`_normal`; only correctly rounded operations."""
    z0, z1, z2, z3 = (_normal(g, n) for _ in range(4))
    chi2 = z1 * z1 + z2 * z2 + z3 * z3
    return z0 / torch.sqrt(chi2 / 3.0)


def _from_f32_bits(bits: Sequence[int] | torch.Tensor) -> torch.Tensor:
    from .format import f32_from_bits

    return f32_from_bits(torch.as_tensor(bits, dtype=torch.int64))


def _binades(g: torch.Generator, n: int, span: int = 60) -> torch.Tensor:
    """n fp32 values with random sign, exponent uniform in [-span, span], random mantissa."""
    sign = _uniform_ints(g, n, 1) << 31
    exponent = (_uniform_ints(g, n, 7) % (2 * span + 1)) - span + 127
    mantissa = _uniform_ints(g, n, 23)
    return _from_f32_bits(sign | (exponent << 23) | mantissa)


_TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_F32_MAX_BITS = 0x7F7FFFFF
_BF16_MAX = torch.finfo(torch.bfloat16).max


def _edge(g: torch.Generator) -> torch.Tensor:
    """Hand-built rows of 64 (two blocks each), fp32:

    zeros, -0.0, signed zeros around one tiny value; exact E2M1 ties (0.25 .. 5 times 2^j,
    with a block max of 4 * 2^j or 6 * 2^j so that every scale rule puts y exactly on the
    tie); the golden amax values (3, 3.5, 6.5, 7, just below 6 and 8) at several j; fp32
    subnormals (a whole subnormal block, subnormals under a normal max, the smallest
    subnormal, the smallest normal); random multiples of 0.25 * 2^j (ties everywhere).
    """
    rows: list[list[float] | torch.Tensor] = []
    rows.append([0.0] * 64)
    rows.append([-0.0] * 64)
    rows.append([(-0.0 if i % 3 else 0.0) for i in range(63)] + [2.0**-100])
    for j in (0, -3, 5, -20, 40):
        s = 2.0**j
        below_4 = _TIES[:-1]  # block max 4 * 2^j: ties up to 3.5
        block_a = [4.0 * s] + [t * s * (1 if i % 2 else -1) for i, t in enumerate(below_4 * 6)][:31]
        block_b = [-6.0 * s] + [t * s * (-1 if i % 2 else 1) for i, t in enumerate(_TIES[::-1] * 5)][:31]
        rows.append(block_a + block_b)
    golden = (3.0, 3.5, 6.5, 7.0, 5.999999, 7.999999, 1.5000001, 4.0000005)
    fractions = (0.1, -0.26, 0.5, 0.74, -0.9, 0.05, -0.125, 0.0)
    for j in (0, -7, 11):
        for a, b in zip(golden[0::2], golden[1::2]):  # one golden amax per 32-block
            block = lambda v: [v] + [v * f for f in fractions * 4][:31]  # noqa: E731
            rows.append(block(a * 2.0**j) + block(-b * 2.0**j))
    sub = _from_f32_bits([1 + 97 * i for i in range(32)])  # a block of subnormals
    sub2 = _from_f32_bits([0x00800000] + [1 << (i % 23) for i in range(31)])  # min normal max
    rows.append(torch.cat([sub, -sub2]))
    rows.append(torch.cat([_from_f32_bits([1] * 32), _from_f32_bits([0x80000001, 0x007FFFFF] * 16)]))
    quarter_steps = (_uniform_ints(g, 4 * 64, 5) - 12).to(torch.float64) * 0.25  # -3 .. 4.75
    for r, j in enumerate((0, -2, 3, -9)):
        rows.append((quarter_steps[r * 64 : (r + 1) * 64] * 2.0**j).to(torch.float32))
    return torch.stack([torch.as_tensor(r, dtype=torch.float32) for r in rows])


def _huge(g: torch.Generator) -> torch.Tensor:
    """Values near the fp32 maximum (the max itself, 2^127, 3e38 ...) mixed with ordinary
    and tiny values, fp32 [4, 64]."""
    top = _from_f32_bits([_F32_MAX_BITS, 0x7F7FFFFE, 0x7F000000, 0x7F600000, 0x7F700000, 0x7E800000])
    base = (_normal(g, 4 * 64) * 1e30).to(torch.float32).view(4, 64)
    base[0, :6] = top
    base[1, 32:38] = -top
    base[2, ::2] = top.repeat(6)[:32]
    base[3, :32] = 2.0**-140
    base[3, 0] = float(top[0])
    return base


def _special(g: torch.Generator) -> torch.Tensor:
    """NaN (two bit patterns) and +-Inf in some blocks, ordinary values elsewhere; fp32
    [4, 96]. Quantize only: decompose rejects non-finite input."""
    x = _normal(g, 4 * 96).to(torch.float32).view(4, 96)
    nan, neg_nan_payload = _from_f32_bits([0x7FC00000, 0xFFC00001])
    x[0, 3] = nan
    x[0, 40] = float("inf")
    x[1, 70] = float("-inf")
    x[1, 71] = neg_nan_payload
    x[2, 0:32] = float("inf")
    x[3, 33] = nan
    x[3, 34] = float(_from_f32_bits([_F32_MAX_BITS]))
    return x


@dataclass(frozen=True)
class CorpusTensor:
    """One input of the corpus: fp32 ``data`` built on the CPU, quantized along ``axis``;
    ``finite`` is False when it holds NaN/Inf (then it is only quantized)."""

    name: str
    data: torch.Tensor
    axis: int = -1
    finite: bool = True


def _shapes(corpus: str) -> dict[str, tuple[int, ...]]:
    if corpus == "small":
        return {"normal": (16, 200), "student_t3": (16, 256), "binades": (8, 256), "3d": (2, 3, 80)}
    return {
        "normal": (512, 4100),
        "student_t3": (512, 4096),
        "binades": (256, 4096),
        "3d": (8, 64, 1000),
        "tall": (4096, 48),
    }


def build_tensors(corpus: str) -> list[CorpusTensor]:
    """The corpus's input tensors (fp32, CPU), identical bytes on every call and machine."""
    if corpus not in CORPORA:
        raise ValueError(f"corpus must be one of {CORPORA}; got {corpus!r}")
    g = torch.Generator().manual_seed(SEED)
    shapes = _shapes(corpus)

    def normal(shape: tuple[int, ...], scale: float = 1.0) -> torch.Tensor:
        return (_normal(g, math.prod(shape)) * scale).to(torch.float32).view(shape)

    out = [
        CorpusTensor("normal", normal(shapes["normal"])),
        CorpusTensor("student_t3", _student_t3(g, math.prod(shapes["student_t3"])).to(torch.float32).view(shapes["student_t3"])),
        CorpusTensor("binades", _binades(g, math.prod(shapes["binades"])).view(shapes["binades"])),
        CorpusTensor("edge", _edge(g)),
        CorpusTensor("huge", _huge(g)),
        CorpusTensor("special", _special(g), finite=False),
        CorpusTensor("tiny", normal((5,), 3.0)),
    ]
    d3 = shapes["3d"]
    row_scale = (2.0 ** (torch.arange(d3[0] * d3[1], dtype=torch.float64) % 13 - 6)).view(d3[0], d3[1], 1)
    x3 = (_normal(g, math.prod(d3)).view(d3) * row_scale).to(torch.float32)
    out += [CorpusTensor("3d", x3), CorpusTensor("3d_axis1", x3, axis=1)]
    if "tall" in shapes:
        out.append(CorpusTensor("tall", normal(shapes["tall"], 0.02)))
    return out


def corpus_digest(corpus: str) -> str:
    """sha256 over the names and bytes of the corpus's tensors: equal on every machine
    that builds the same corpus."""
    h = hashlib.sha256()
    for t in build_tensors(corpus):
        h.update(f"{t.name}:{t.axis}:{tensor_digest(t.data)['sha256']};".encode())
    return h.hexdigest()


def build_recipes() -> dict[str, "QuantRecipe"]:  # noqa: F821
    """The corpus recipes by name: every scale rule with nearest rounding, stochastic
    rounding, MBS-64/128/96, OF-1/2, and MBS with OF."""
    from .recipe import QuantRecipe

    r = QuantRecipe
    return {
        "floor": r(scale_rule="floor"),
        "rceil": r(scale_rule="rceil"),
        "even": r(scale_rule="even"),
        "ceil": r(scale_rule="ceil"),
        "floor-sr": r(scale_rule="floor", rounding="stochastic", seed=STOCHASTIC_SEED),
        "rceil-sr": r(scale_rule="rceil", rounding="stochastic", seed=2**40 + 7),
        "mbs64": r(macro_block=64),
        "mbs128": r(macro_block=128),
        "mbs96": r(macro_block=96),
        "of1": r(outliers_per_block=1),
        "of2": r(outliers_per_block=2),
        "mbs128-of1": r(macro_block=128, outliers_per_block=1),
        "mbs64-of2-sr": r(macro_block=64, outliers_per_block=2, rounding="stochastic", seed=STOCHASTIC_SEED),
    }


# Which (op, tensor, dtype) combinations each corpus runs; every one with every recipe.
# The small corpus keeps the edge cases on every path and samples the rest, so that the
# Triton interpreter gets through it in well under a minute.
_SMALL_PLAN = {
    "quantize": {
        "float32": ("normal", "student_t3", "binades", "edge", "huge", "special", "tiny", "3d", "3d_axis1"),
        "bfloat16": ("normal", "edge", "huge", "special"),
    },
    "decompose": {"float32": ("normal", "student_t3", "edge", "huge", "tiny"), "bfloat16": ("binades", "3d")},
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 -> ``dtype`` on the CPU (round to nearest even); finite values that overflow
    bf16 are clamped to the bf16 maximum so that finite stays finite."""
    y = x.to(dtype)
    if dtype == torch.bfloat16:
        overflow = torch.isinf(y) & torch.isfinite(x)
        y = torch.where(overflow, torch.copysign(torch.tensor(_BF16_MAX), x).to(dtype), y)
    return y.contiguous()


@dataclass(frozen=True)
class Case:
    """One parity case: ``op`` is "quantize" or "decompose" (with ``definition``)."""

    op: str
    tensor: CorpusTensor
    dtype: str
    recipe_name: str
    recipe: Any
    definition: Optional[str] = None

    @property
    def id(self) -> str:
        op = self.op if self.definition is None else f"{self.op}-{self.definition}"
        return f"{op}/{self.tensor.name}/{self.dtype}/{self.recipe_name}"


def build_cases(corpus: str) -> list[Case]:
    """Every case of ``corpus`` ("small" or "full"), in a fixed order."""
    tensors = {t.name: t for t in build_tensors(corpus)}
    recipes = build_recipes()
    if corpus == "small":
        plan = _SMALL_PLAN
    else:
        everything = tuple(tensors)
        plan = {"quantize": {d: everything for d in DTYPES}, "decompose": {d: everything for d in DTYPES}}
    cases = []
    for op, by_dtype in plan.items():
        for dtype, names in by_dtype.items():
            for name in names:
                t = tensors[name]
                if op == "decompose" and not t.finite:
                    continue
                for rname, recipe in recipes.items():
                    if op == "quantize":
                        cases.append(Case(op, t, dtype, rname, recipe))
                    else:
                        cases += [Case(op, t, dtype, rname, recipe, d) for d in DEFINITIONS]
    return cases


# ----------------------------------------------------------------------------- the report


def tensor_digest(t: Optional[torch.Tensor]) -> Optional[dict[str, Any]]:
    """{"sha256", "shape", "dtype"} of a tensor's bytes (CPU, contiguous), None for None."""
    if t is None:
        return None
    c = t.detach().to("cpu").contiguous()
    raw = c.reshape(-1).view(torch.uint8).numpy().tobytes() if c.numel() else b""
    return {"sha256": hashlib.sha256(raw).hexdigest(), "shape": list(c.shape), "dtype": str(c.dtype).replace("torch.", "")}


_NON_FINITE = ("nan", "inf", "-inf")


def _num(v: float) -> float | str:
    """A float for JSON: non-finite values as "nan", "inf", "-inf"."""
    return v if math.isfinite(v) else str(v)


def _versions() -> dict[str, Optional[str]]:
    from . import __version__

    try:
        import triton

        triton_version = triton.__version__
    except Exception as err:  # the report still says what it could not import
        triton_version = f"not importable ({type(err).__name__})"
    return {
        "portable_mx": __version__,
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
    }


def describe_device(device: torch.device) -> str:
    """A one-line description of ``device`` (GPU name and architecture, or the CPU)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        arch = getattr(props, "gcnArchName", None) or f"sm_{props.major}{props.minor}"
        return f"{props.name} ({arch}, {props.total_memory / 2**30:.0f} GiB)"
    cpu = " ".join(p for p in (platform.machine(), platform.processor()) if p)
    return f"{device.type}: {cpu or 'unknown'}, {torch.get_num_threads()} threads"


def run_case(case: Case, device: torch.device) -> dict[str, Any]:
    """The report entry of one case (its "error" instead of results if the op raised)."""
    from . import ops, registry

    x_cpu = _cast(case.tensor.data, DTYPES[case.dtype])
    entry: dict[str, Any] = {
        "op": case.op,
        "tensor": case.tensor.name,
        "shape": list(x_cpu.shape),
        "axis": case.tensor.axis,
        "dtype": case.dtype,
        "recipe": case.recipe.model_dump(),
        "input_sha256": tensor_digest(x_cpu)["sha256"],
    }
    if case.definition is not None:
        entry["definition"] = case.definition
    try:
        entry["backend"] = registry.select(case.op, device).name
        x = x_cpu.to(device)
        if case.op == "quantize":
            mx = ops.quantize(x, case.recipe, axis=case.tensor.axis)
            entry["outputs"] = {f: tensor_digest(getattr(mx, f)) for f in MX_FIELDS}
        else:
            with warnings.catch_warnings():  # (the counterfactual's note on stochastic rounding: bytes compared here)
                warnings.filterwarnings("ignore", message=r"decompose\(definition='counterfactual'\)")
                dec = ops.decompose(x, case.recipe, axis=case.tensor.axis, definition=case.definition, full=False)
            entry["counts"] = {f: tensor_digest(getattr(dec, f)) for f in COUNT_FIELDS}
            entry["totals"] = {k: _num(v) for k, v in dec.totals().items()}
            entry["summary"] = {k: _num(v) for k, v in dec.summary().items()}
    except Exception as err:  # recorded: a backend that raises is a parity failure
        entry["error"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return entry


def build_report(
    corpus: str = "small",
    device: torch.device | str = "cpu",
    *,
    case_filter: Optional[str] = None,
    progress: Optional[Callable[[int, int, str], None]] = None,
) -> dict[str, Any]:
    """Run the corpus on ``device`` with the backends the registry selects now (set
    ``PORTABLE_MX_BACKEND`` to force one; see :func:`forced_backend`) and return the report.

    ``case_filter`` is an fnmatch pattern on case ids (a partial report); one that
    matches no case raises ValueError.
    """
    from . import registry

    device = torch.device(device)
    everything = build_cases(corpus)
    cases = [c for c in everything if case_filter is None or fnmatchcase(c.id, case_filter)]
    if not cases:
        raise ValueError(
            f"--filter {case_filter!r} matches none of the {len(everything)} cases of corpus {corpus!r} "
            f"(case ids look like {everything[0].id!r}, {everything[-1].id!r}): a report of no "
            "case proves nothing"
        )
    entries = {}
    for i, case in enumerate(cases):
        if progress is not None:
            progress(i, len(cases), case.id)
        entries[case.id] = run_case(case, device)
    forced = os.environ.get(registry.ENV_BACKEND, "").strip() or None
    return {
        "schema": SCHEMA,
        "corpus": corpus,
        "case_filter": case_filter,
        "corpus_sha256": corpus_digest(corpus),
        "versions": _versions(),
        "device": {"name": str(device), "description": describe_device(device)},
        "backend_forced": forced,
        "backends": {op: registry.select(op, device).name for op in ("quantize", "decompose")},
        "cases": entries,
    }


class forced_backend:
    """Context manager: ``PORTABLE_MX_BACKEND=name`` while inside (no-op for None), the
    previous value restored on exit. The variable is the process's: blocks in several
    threads at once overlap (each thread's calls see the last value set, and the last
    block to exit restores what its own entry saw); use it from one thread at a time."""

    def __init__(self, name: Optional[str]) -> None:
        self.name = name

    def __enter__(self) -> None:
        from .registry import ENV_BACKEND

        self._key = ENV_BACKEND
        self._prev = os.environ.get(ENV_BACKEND)
        if self.name is not None:
            os.environ[ENV_BACKEND] = self.name

    def __exit__(self, *exc: Any) -> None:
        if self._prev is None:
            os.environ.pop(self._key, None)
        else:
            os.environ[self._key] = self._prev


# ----------------------------------------------------------------------------- comparison


@dataclass(frozen=True)
class Mismatch:
    """One disagreement: report ``other`` differs from the baseline report in ``case`` at
    ``field`` (values as recorded)."""

    case: str
    field: str
    baseline: str
    other: str
    baseline_value: Any
    other_value: Any

    def __str__(self) -> str:
        return (
            f"{self.case}: {self.field}: {self.baseline}={_short(self.baseline_value)} "
            f"!= {self.other}={_short(self.other_value)}"
        )


def _short(v: Any) -> str:
    if isinstance(v, dict) and "sha256" in v:
        return f"sha256:{v['sha256'][:12]} {v.get('dtype', '')}{v.get('shape', '')}"
    if isinstance(v, float):
        return repr(v)  # (every digit: two values apart by 1e-15 showed as the same 9 digits)
    s = json.dumps(v) if not isinstance(v, str) else v
    return s if len(s) <= 60 else s[:57] + "..."


def _as_float(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) or v in _NON_FINITE else float("nan")


def _close(a: Any, b: Any, atol: float) -> bool:
    """Equal non-finite values, or finite values within RTOL relative plus ``atol``."""
    fa, fb = _as_float(a), _as_float(b)
    if not (math.isfinite(fa) and math.isfinite(fb)):
        return (math.isnan(fa) and math.isnan(fb)) or fa == fb
    return abs(fa - fb) <= RTOL * max(abs(fa), abs(fb)) + atol


def _compare_case(case_id: str, a: Mapping[str, Any], b: Mapping[str, Any], emit: Callable[..., None]) -> None:
    for key in ("op", "shape", "axis", "dtype", "recipe", "definition", "input_sha256"):
        if a.get(key) != b.get(key):
            emit(case_id, key, a.get(key), b.get(key))
            return  # not the same input: the results cannot be compared
    if "error" in a or "error" in b:
        emit(case_id, "error", a.get("error"), b.get("error"))
        return
    for group in ("outputs", "counts"):
        ga, gb = a.get(group) or {}, b.get(group) or {}
        for f in sorted(set(ga) | set(gb)):
            if ga.get(f) != gb.get(f):
                emit(case_id, f"{group}.{f}", ga.get(f), gb.get(f))
    ta, tb = a.get("totals") or {}, b.get("totals") or {}
    signal = min(_as_float(ta.get("signal", 0.0)), _as_float(tb.get("signal", 0.0)))
    energy_atol = ENERGY_ATOL * signal if math.isfinite(signal) else 0.0
    for k in sorted(set(ta) | set(tb)):
        if k not in ta or k not in tb or not _close(ta[k], tb[k], energy_atol):
            emit(case_id, f"totals.{k}", ta.get(k), tb.get(k))
    sa, sb = a.get("summary") or {}, b.get("summary") or {}
    for k in sorted(set(sa) | set(sb)):
        if k not in sa or k not in sb:
            ok = False
        elif k in EXACT_SUMMARY:
            ok = sa[k] == sb[k]
        else:
            ok = _close(sa[k], sb[k], SUMMARY_ATOL.get(k, DEFAULT_SUMMARY_ATOL))
        if not ok:
            emit(case_id, f"summary.{k}", sa.get(k), sb.get(k))


def find_mismatches(reports: Sequence[Mapping[str, Any]], labels: Optional[Sequence[str]] = None) -> list[Mismatch]:
    """Every disagreement between ``reports[0]`` (the baseline) and each other report.
    Raises ValueError for fewer than two reports or a report with no cases (a comparison
    of nothing proves nothing)."""
    if len(reports) < 2:
        raise ValueError(f"comparing needs at least two reports; got {len(reports)}")
    for i, report in enumerate(reports):
        if not (report.get("cases") if isinstance(report, Mapping) else None):
            name = labels[i] if labels is not None else f"report{i}"
            raise ValueError(f"{name} holds no cases: a comparison of nothing proves nothing")
    labels = list(labels) if labels is not None else [f"report{i}" for i in range(len(reports))]
    base, base_label = reports[0], labels[0]
    out: list[Mismatch] = []
    for other, label in zip(reports[1:], labels[1:]):

        def emit(case: str, field: str, va: Any, vb: Any) -> None:
            out.append(Mismatch(case, field, base_label, label, va, vb))

        for key in ("schema", "corpus", "corpus_sha256", "case_filter"):
            if base.get(key) != other.get(key):
                emit("*", key, base.get(key), other.get(key))
        ca, cb = base.get("cases") or {}, other.get("cases") or {}
        for case_id in ca:
            if case_id not in cb:
                emit(case_id, "case", "present", "missing")
            else:
                _compare_case(case_id, ca[case_id], cb[case_id], emit)
        for case_id in cb:
            if case_id not in ca:
                emit(case_id, "case", "missing", "present")
    return out


def compare_reports(reports: Sequence[Mapping[str, Any]], labels: Optional[Sequence[str]] = None) -> list[str]:
    """Descriptions of every mismatch between the reports (empty when they agree).

    Hashes, shapes, dtypes, counts and count fractions must be identical; energies and the
    other summary statistics equal within :data:`TOLERANCES`; both reports must hold the
    same cases, built from the same inputs, and neither may have errored. A report with no
    cases raises ValueError.
    """
    return [str(m) for m in find_mismatches(reports, labels)]


def format_table(mismatches: Sequence[Mismatch]) -> str:
    """The mismatches as fixed-width tables, one per (baseline, other) pair of reports:
    case, field, the baseline's value, the other's value."""
    lines: list[str] = []
    pairs = list(dict.fromkeys((m.baseline, m.other) for m in mismatches))
    for base, other in pairs:
        rows = [("case", "field", base, other)]
        rows += [(m.case, m.field, _short(m.baseline_value), _short(m.other_value))
                 for m in mismatches if (m.baseline, m.other) == (base, other)]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3] for r in rows]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- command line


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EXIT_CODES
    parser.add_argument("--corpus", choices=CORPORA, default=None,
                        help="small: seconds on a CPU, even in the Triton interpreter; full: for GPUs (default small)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--backend", default=None, metavar="NAME",
                        help="force a backend for this run (sets PORTABLE_MX_BACKEND, restored afterwards)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the report to PATH")
    parser.add_argument("--filter", default=None, metavar="GLOB",
                        help="only the cases whose id matches GLOB, e.g. 'quantize/edge/*'")
    parser.add_argument("--compare", nargs="+", default=None, metavar="REPORT",
                        help="compare two or more report files (the first is the baseline) instead of running")


def _progress(i: int, n: int, case_id: str) -> None:
    """Every tenth of the way: one line on stderr (the full corpus takes minutes on a CPU)."""
    step = max(n // 10, 1)
    if i and i % step == 0:
        print(f"parity: {i}/{n} {case_id}", file=sys.stderr, flush=True)


class ReportError(ValueError):
    """A report file that cannot be compared: missing, unreadable, not a parity report,
    or holding no cases (the message names the file)."""


def load_report(path: str) -> dict[str, Any]:
    """The parity report in the JSON file ``path``; raises :class:`ReportError` (one line
    naming the file) when it is missing, unreadable, not JSON, not a report, or empty."""
    try:
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
    except OSError as err:
        raise ReportError(f"cannot read report {path}: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise ReportError(f"report {path} is not UTF-8 text (byte {err.start}): not a parity report") from None
    except json.JSONDecodeError as err:
        raise ReportError(f"report {path} is not valid JSON (line {err.lineno} column {err.colno}: {err.msg})") from None
    schema = report.get("schema") if isinstance(report, dict) else None
    if not (isinstance(schema, str) and schema.startswith(SCHEMA.split("/")[0] + "/")
            and isinstance(report.get("cases"), dict)):
        raise ReportError(
            f"{path} is not a parity report (no \"schema\": \"{SCHEMA}\" and \"cases\"); "
            "write one with `portable-mx parity --json PATH`"
        )
    if schema != SCHEMA:  # (another schema's was compared, and its "schema" field counted as a mismatch)
        raise ReportError(f"report {path} has schema {schema!r}; this portable_mx compares {SCHEMA!r} reports: "
                          "write it again with `portable-mx parity --json PATH`")
    if not isinstance(report.get("device", {}), dict):
        raise ReportError(f"report {path}: \"device\" is a JSON {type(report['device']).__name__}, not an object")
    if not report["cases"]:
        raise ReportError(f"report {path} holds no cases: a comparison of nothing proves nothing")
    for case_id, case in report["cases"].items():
        why = _case_problem(case)
        if why is not None:
            raise ReportError(f"report {path}: case {case_id!r} {why}: not a parity report's case")
    return report


def _case_problem(case: Any) -> Optional[str]:
    """Why ``case`` is not a report's case (None when it is): an object with its "op" and
    either an "error" or the op's results (quantize: "outputs"; decompose: "counts" and
    "totals"), so that no comparison of cases that hold nothing passes."""
    if not isinstance(case, dict):
        return f"is a JSON {type(case).__name__}, not an object"
    op = case.get("op")
    if op not in ("quantize", "decompose"):
        return f"has op {op!r}, not 'quantize' or 'decompose'"
    if "error" in case:
        return None
    needed = ("outputs",) if op == "quantize" else ("counts", "totals")
    missing = [k for k in needed if not (isinstance(case.get(k), dict) and case[k])]
    if missing:
        return f"holds no {' or '.join(missing)}"
    for group in ("outputs", "counts", "totals", "summary"):  # (a list or a string: a traceback when compared)
        if group in case and not isinstance(case[group], dict):
            return f"has {group!r} as a JSON {type(case[group]).__name__}, not an object"
    for group in ("totals", "summary"):
        bad = [k for k, v in (case.get(group) or {}).items()  # (non-finite values are written as strings)
               if not (v is None or v in _NON_FINITE or isinstance(v, (int, float)) and not isinstance(v, bool))]
        if bad:
            return f"has {group}.{bad[0]} = {case[group][bad[0]]!r}, not a number"
    return None


def _run_compare(paths: Sequence[str]) -> int:
    if len(paths) < 2:
        print("parity --compare needs at least two reports", file=sys.stderr)
        return EXIT_UNAVAILABLE
    real = [os.path.realpath(p) for p in paths]
    if len(set(real)) != len(real):
        twice = next(p for p, r in zip(paths, real) if real.count(r) > 1)
        print(f"parity --compare: {twice} is given twice (a report agrees with itself); give different reports",
              file=sys.stderr)
        return EXIT_UNAVAILABLE
    reports = []
    for p in paths:
        try:
            reports.append(load_report(p))
        except ReportError as err:
            print(f"parity: {err}", file=sys.stderr)
            return EXIT_NOTHING_CHECKED
    mismatches = find_mismatches(reports, labels=[os.path.basename(p) for p in paths])
    for p, r in zip(paths, reports):
        print(f"{p}: {r.get('device', {}).get('description')} backends {r.get('backends')} "
              f"{len(r.get('cases', {}))} cases")
    if mismatches:
        print(format_table(mismatches))
        print(f"parity: {len(mismatches)} mismatch(es)")
        return EXIT_MISMATCH
    print(f"parity: {len(paths)} reports agree on {len(reports[0].get('cases', {}))} cases")
    return EXIT_OK


def run(args: argparse.Namespace) -> int:
    """Run the corpus (or compare reports) and return the exit status (:data:`EXIT_CODES`):
    0 = all cases ran (reports agree), 1 = a case errored (a mismatch), 2 = the backend or
    device cannot be used, 3 = nothing was checked (an unreadable or empty report, a
    ``--filter`` that matches nothing)."""
    if args.compare:
        ignored = [f"--{k}" for k in ("corpus", "device", "backend", "json", "filter") if getattr(args, k) is not None]
        if ignored:  # (they were ignored: --json wrote nothing, a --filter'ed report compared as all missing)
            print(f"parity --compare compares report files as they are: {', '.join(ignored)} "
                  f"{'does' if len(ignored) == 1 else 'do'} not apply", file=sys.stderr)
            return EXIT_UNAVAILABLE
        return _run_compare(args.compare)
    from . import registry

    args.corpus = args.corpus or "small"
    try:
        device = torch.device(args.device or _default_device())
        torch.empty(1, device=device)
        if device.type == "meta":
            raise ValueError("meta tensors hold no values to compare")
    except Exception as err:  # no such device here: say so once, not once per case
        print(f"parity: cannot use device {args.device or _default_device()}: {type(err).__name__}: {err}",
              file=sys.stderr)
        return EXIT_UNAVAILABLE
    if args.json is not None and (problem := output_file_problem("--json", args.json)):  # before the corpus runs
        print(f"parity: {problem}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    start = time.perf_counter()
    with forced_backend(args.backend):
        try:
            if args.backend is not None:
                registry.get(args.backend)
            for op in ("quantize", "decompose"):
                registry.select(op, device)
        except registry.BackendUnavailableError as err:
            print(f"parity: {err}", file=sys.stderr)
            return EXIT_UNAVAILABLE
        try:
            report = build_report(args.corpus, device, case_filter=args.filter, progress=_progress)
        except ValueError as err:  # a --filter that matches nothing
            print(f"parity: {err}", file=sys.stderr)
            return EXIT_NOTHING_CHECKED
    errors = {k: e["error"] for k, e in report["cases"].items() if "error" in e}
    if args.json is not None:
        write_atomic(args.json, json.dumps(report, indent=1, allow_nan=False) + "\n")
    print(f"parity: corpus {args.corpus}, {len(report['cases'])} cases on {device} "
          f"({report['device']['description']}), backends {report['backends']}, "
          f"{time.perf_counter() - start:.1f} s" + (f", written to {args.json}" if args.json else ""))
    for case_id, err in errors.items():
        print(f"  error: {case_id}: {err}")
    return EXIT_MISMATCH if errors else EXIT_OK


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m portable_mx.parity", description=HELP)
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
