"""The GEMM's search space per backend and target: which :class:`GemmConfig`\\ s a study
may try for one kind of GEMM.

A space is a product of per-parameter choices (``block_m``, ``block_n``, ``block_k``,
``group_m``, ``num_warps``, ``num_stages``, and on AMD ``waves_per_eu`` and
``matrix_instr_nonkdim``, with ``kpack`` fixed to 1), so that every combination is a
candidate and a sampler can model each parameter (Optuna's TPE, :mod:`.search`). The
restrictions that keep a config valid and on the fast path are built into the choices,
never filtered afterwards:

- **native MX instruction.** sm_100's ``tcgen05.mma ... block_scale`` needs an M tile of
  at least 128 and 4 or 8 warps, so an A4W4 space on sm_100 offers only those. gfx950's
  ``v_mfma_scale_f32_{16x16x128,32x32x64}_f8f6f4`` needs ``kpack`` 1 and
  ``matrix_instr_nonkdim`` 16 or 32. Whatever else breaks the instruction (a tile the
  lowering cannot use) is found by the static stage (:mod:`.static`), which compiles each
  candidate for the target.
- **BLOCK_K.** A power of two >= 32. With macro factors promoted in the K loop the GEMM
  lowers ``block_k`` itself to the largest power of two dividing both macro blocks
  (:class:`~portable_mx.backends.triton.gemm.Plan`); larger choices would be the same
  launch twice, so they are capped there.
- **size.** The default ("curated") space is a few dozen to a few hundred candidates per
  kind, small enough to compile for one target in minutes on two cores; ``full=True``
  gives every combination of the wider choice lists.

Every space contains the backend's default config for the kind (its values are added to
each parameter's choices): the study measures it as the baseline.

Candidates are enumerated deterministically (parameters in :data:`PARAMS` order, choices
ascending). :meth:`GemmSpace.distributions` is the Optuna encoding: one
``CategoricalDistribution`` of ints per parameter; :meth:`GemmSpace.encode` and
:meth:`GemmSpace.decode` map configs to and from those parameters exactly.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Optional

from ..backends.triton.launch import GemmConfig

if TYPE_CHECKING:
    from ..backends.targets import Target
    from ..backends.triton.gemm import Operand

PARAMS = ("block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages",
          "waves_per_eu", "matrix_instr_nonkdim")
"""The tuned parameters, in enumeration order (the AMD ones only in AMD spaces)."""

AMD_EXTRA = ("kpack", "matrix_instr_nonkdim", "waves_per_eu")
"""The order of an AMD config's ``extra`` options (the backends' order: kpack first)."""

SMALL_M = 16
"""M up to this is "small" (decode): the curated space offers narrow M tiles (the
backends' ``SMALL_M``)."""

NATIVE_MIN_BLOCK_M = {"sm_100": 128}
"""The smallest M tile that keeps the native block-scaled MMA, per target (A4W4)."""

NATIVE_WARPS = {"sm_100": (4, 8)}
"""The warps per program that keep the native block-scaled MMA, per target (A4W4)."""

NATIVE_NONKDIM = {"gfx950": (16, 32)}
"""``matrix_instr_nonkdim`` values of the native scaled MFMA, per target."""


@dataclass(frozen=True)
class GemmSpace:
    """A product space of GEMM configs: ``choices`` maps each tuned parameter (a subset
    of :data:`PARAMS`) to its ascending choices; ``fixed`` holds vendor options every
    candidate carries (``kpack``); ``notes`` say which restrictions shaped the choices.
    ``vendor`` ("nvidia", "amd" or "interpret") decides how ``extra`` is built."""

    name: str
    vendor: str
    choices: tuple[tuple[str, tuple[int, ...]], ...]
    fixed: tuple[tuple[str, Any], ...] = ()
    notes: tuple[str, ...] = ()
    block_k_cap: Optional[int] = None

    @property
    def params(self) -> dict[str, tuple[int, ...]]:
        return dict(self.choices)

    def __len__(self) -> int:
        n = 1
        for _, values in self.choices:
            n *= len(values)
        return n

    def candidates(self) -> list[GemmConfig]:
        """Every config of the space, in a fixed order (first parameter slowest)."""
        names = [name for name, _ in self.choices]
        return [self.decode(dict(zip(names, values)))
                for values in itertools.product(*(values for _, values in self.choices))]

    def distributions(self) -> dict[str, Any]:
        """The Optuna encoding: one categorical distribution per parameter."""
        from optuna.distributions import CategoricalDistribution

        return {name: CategoricalDistribution(list(values)) for name, values in self.choices}

    def encode(self, config: GemmConfig) -> dict[str, int]:
        """The parameters of ``config`` (raises ValueError when it is not in the space)."""
        extra = dict(config.extra)
        out = {}
        for name, values in self.choices:
            value = getattr(config, name) if hasattr(config, name) else extra.get(name, 0)
            if value not in values:
                raise ValueError(f"{config.label()}: {name}={value} is not a choice of space {self.name} {values}")
            out[name] = value
        if self.decode(out) != config:
            raise ValueError(f"{config.label()} is not a config of space {self.name}")
        return out

    def decode(self, params: dict[str, int]) -> GemmConfig:
        """The config of a parameter assignment (every parameter of the space)."""
        fields = {name: int(params[name]) for name in ("block_m", "block_n", "block_k", "group_m",
                                                       "num_warps", "num_stages") if name in params}
        defaults = {"group_m": 8, "num_warps": 4, "num_stages": 2}
        fields = {**defaults, **fields}
        return GemmConfig(fields["block_m"], fields["block_n"], fields["block_k"],
                          num_warps=fields["num_warps"], num_stages=fields["num_stages"],
                          group_m=fields["group_m"], extra=self._extra(params))

    def canonical(self, config: GemmConfig) -> GemmConfig:
        """``config`` with ``block_k`` lowered as the GEMM lowers it (the same launch)."""
        if self.block_k_cap is not None and config.block_k > self.block_k_cap:
            return dataclasses.replace(config, block_k=self.block_k_cap)
        return config

    def contains(self, config: GemmConfig) -> bool:
        try:
            self.encode(config)
        except ValueError:
            return False
        return True

    def _extra(self, params: dict[str, int]) -> tuple[tuple[str, Any], ...]:
        if self.vendor != "amd":
            return tuple(self.fixed)
        values = {**dict(self.fixed), **{k: int(params[k]) for k in ("matrix_instr_nonkdim", "waves_per_eu")
                                         if k in params}}
        if not values.get("waves_per_eu"):  # 0: no occupancy hint, as the backends' defaults
            values.pop("waves_per_eu", None)
        return tuple((k, values[k]) for k in AMD_EXTRA if k in values)


# ----------------------------------------------------------------------------- choices

# (curated, full) choices per parameter and vendor; the restrictions below narrow them.
_NVIDIA = {
    "block_m": ((64, 128, 256), (16, 32, 64, 128, 256)),
    "block_m_small": ((16, 32, 64), (16, 32, 64, 128, 256)),
    "block_n": ((64, 128, 256), (32, 64, 128, 256)),
    "block_n_small": ((32, 64, 128), (32, 64, 128, 256)),
    "block_k": ((128, 256), (32, 64, 128, 256, 512)),
    "block_k_small": ((128, 256, 512), (32, 64, 128, 256, 512)),
    "group_m": ((4, 8), (1, 4, 8, 16)),
    "num_warps": ((4, 8), (2, 4, 8, 16)),
    "num_stages": ((2, 3, 4), (1, 2, 3, 4, 5)),
}
_AMD = {
    **_NVIDIA,
    "num_stages": ((2,), (1, 2, 3)),
    "num_warps": ((4, 8), (2, 4, 8, 16)),
    "waves_per_eu": ((0, 2), (0, 1, 2, 3, 4)),
    "matrix_instr_nonkdim": ((16, 32), (16, 32)),
}
_INTERPRET = {  # the interpreter ignores warps and stages; tiles change only its speed
    "block_m": ((16, 32, 64), (16, 32, 64, 128)),
    "block_m_small": ((16, 32), (16, 32, 64, 128)),
    "block_n": ((32, 64), (32, 64, 128)),
    "block_n_small": ((32, 64), (32, 64, 128)),
    "block_k": ((32, 64, 128), (32, 64, 128, 256)),
    "block_k_small": ((32, 64, 128), (32, 64, 128, 256)),
    "group_m": ((1, 2), (1, 2, 4, 8)),
}


def block_k_cap(a: "Operand", b: "Operand", kp: Optional[int]) -> Optional[int]:
    """The largest ``block_k`` that makes a distinct launch: with macro factors promoted in
    the K loop, the largest power of two dividing both macro blocks; else None (no cap).
    ``kp`` (padded K) decides whether the factors move to the epilogue instead (one macro
    block spans K and there are no outliers); None: assume they do not."""
    import math

    macros = [mb for mb in (a.macro_block, b.macro_block) if mb is not None]
    if not macros:
        return None
    epilogue = kp is not None and min(macros) >= kp and not (a.outliers or b.outliers)
    if epilogue:
        return None
    period = math.gcd(*macros)
    return period & -period


def _capped(values: Iterable[int], cap: Optional[int]) -> tuple[int, ...]:
    values = sorted(set(values))
    if cap is None:
        return tuple(values)
    kept = {v for v in values if v <= cap}
    if any(v > cap for v in values):
        kept.add(cap)
    return tuple(sorted(v for v in kept if v >= 32)) or (cap,)


def _with(values: tuple[int, ...], extra: Optional[int]) -> tuple[int, ...]:
    return tuple(sorted(set(values) | ({extra} if extra is not None else set())))


def gemm_space(
    target: Optional["Target"],
    a: "Operand",
    b: "Operand",
    m: Optional[int] = None,
    kp: Optional[int] = None,
    full: bool = False,
    default: Optional[GemmConfig] = None,
) -> GemmSpace:
    """The search space of a GEMM of operands like ``a``, ``b`` (``gemm.Operand``) with M
    rows (None: large M) and padded K ``kp`` on ``target`` (None: the interpreter).
    ``default``: a config whose values join the choices (the backend's default, which
    every study measures). See the module doc for the restrictions."""
    pick = 1 if full else 0
    small = m is not None and m <= SMALL_M
    vendor = "interpret" if target is None else target.vendor
    table = {"interpret": _INTERPRET, "nvidia": _NVIDIA, "amd": _AMD}[vendor]

    def base(name: str) -> tuple[int, ...]:
        key = f"{name}_small" if small and f"{name}_small" in table else name
        return table[key][pick]

    notes = []
    native_a4w4 = target is not None and target.native_mx and a.format is None
    block_m = base("block_m")
    num_warps = base("num_warps") if "num_warps" in table else ()
    if native_a4w4 and target.name in NATIVE_MIN_BLOCK_M:
        low = NATIVE_MIN_BLOCK_M[target.name]
        block_m = tuple(v for v in block_m if v >= low) or (low,)
        notes.append(f"{target.name} A4W4: BLOCK_M >= {low} (native block-scaled MMA)")
    if native_a4w4 and target.name in NATIVE_WARPS:
        num_warps = tuple(v for v in num_warps if v in NATIVE_WARPS[target.name])
        notes.append(f"{target.name} A4W4: num_warps in {NATIVE_WARPS[target.name]} (native block-scaled MMA)")
    cap = block_k_cap(a, b, kp)
    if cap is not None:
        notes.append(f"macro factors promoted per K tile: BLOCK_K <= {cap}")
    choices: dict[str, tuple[int, ...]] = {
        "block_m": block_m,
        "block_n": base("block_n"),
        "block_k": _capped(base("block_k"), cap),
        "group_m": base("group_m"),
    }
    fixed: tuple[tuple[str, Any], ...] = ()
    if vendor != "interpret":
        choices["num_warps"] = num_warps
        choices["num_stages"] = base("num_stages")
    if vendor == "amd":
        fixed = (("kpack", 1),)
        choices["waves_per_eu"] = base("waves_per_eu")
        choices["matrix_instr_nonkdim"] = NATIVE_NONKDIM.get(target.name, base("matrix_instr_nonkdim"))
        notes.append("kpack = 1" + (f", matrix_instr_nonkdim in {NATIVE_NONKDIM[target.name]} (native scaled MFMA)"
                                    if target.name in NATIVE_NONKDIM else ""))
    if default is not None:
        extra = dict(default.extra)
        for name in list(choices):
            value = getattr(default, name) if hasattr(default, name) else extra.get(name, 0)
            if name == "block_k" and cap is not None:
                value = min(value, cap)
            choices[name] = _with(choices[name], value)
    kind = ("A4W4" if a.format is None else "W4A16") + (f" a:{a.tag()} b:{b.tag()}")
    name = f"{'full' if full else 'default'}:{target.name if target else 'interpret'}:{kind}:{'small-M' if small else 'M'}"
    ordered = tuple((p, choices[p]) for p in PARAMS if p in choices)
    return GemmSpace(name, vendor, ordered, fixed, tuple(notes), cap)
