"""The GEMM's search space per backend, target and M range: which :class:`GemmConfig`\\ s a
study may try for one kind of GEMM.

A space is a product of per-knob choices, so that every combination is a candidate and
a sampler can model each knob (Optuna's TPE, :mod:`.search`). The knobs and their choices
come from one table, :data:`KNOBS`: knob -> vendor -> M class (:func:`m_class`: "small"
M <= 16, "mid" M <= 256, "large") -> (curated choices, full choices). A knob is any field
of :class:`GemmConfig` (``block_m`` ... ``split_k``, and whatever fields the kernels add)
or a vendor launch option carried in ``GemmConfig.extra`` (AMD's ``waves_per_eu``,
``matrix_instr_nonkdim``, ``kpack``). The table is generic over the config: a knob that is
not a field of this version's GemmConfig (nor an extra) is left out with a note, a field
the table does not list keeps the default config's value, and a knob with one choice is
fixed (:attr:`GemmSpace.fixed`) rather than tuned.

The restrictions that keep a config valid and on the fast path are built into the
choices:

- **native MX instruction.** sm_100's ``tcgen05.mma ... block_scale`` needs an M tile of
  at least 128 and 4 or 8 warps, so an A4W4 space on sm_100 offers only those. gfx950's
  ``v_mfma_scale_f32_{16x16x128,32x32x64}_f8f6f4`` needs ``kpack`` 1 and
  ``matrix_instr_nonkdim`` 16 or 32. Whatever else breaks the instruction is found by the
  static stage (:mod:`.static`), which compiles each candidate for the target.
- **BLOCK_K.** A power of two >= 32. With macro factors promoted in the K loop the GEMM
  lowers ``block_k`` itself to the largest power of two dividing both macro blocks
  (:class:`~portable_mx.backends.triton.gemm.Plan`); larger choices would be the same
  launch twice, so they are capped there.
- **M tiles.** No ``block_m`` above ``max(64, next power of two >= M)`` (a taller tile only
  pads). ``group_m`` is dropped (fixed) when every ``block_m`` choice covers M in one row
  of tiles: it only reorders row tiles, so its choices would be one launch timed twice.
- **split_k.** Only values that leave every split at least one K tile of the smallest
  ``block_k``; a combination whose ``split_k * block_k`` exceeds K is a rule violation
  (:meth:`GemmSpace.violation`), pruned before compiling.
- **size.** The curated space is about 100-220 candidates per kind (a few dozen compiles
  after ``GROUP_M`` sharing), small enough to compile and time exhaustively on one GPU in
  a minute; ``full=True`` gives every combination of the wider lists.

Every space contains the backend's default config for the kind (its values are added to
each knob's choices): the study measures it as the baseline.

Candidates are enumerated deterministically (knobs in :data:`KNOBS` order, choices
ascending). :meth:`GemmSpace.distributions` is the Optuna encoding: one
``CategoricalDistribution`` of ints per tuned knob; :meth:`GemmSpace.encode` and
:meth:`GemmSpace.decode` map configs to and from those parameters exactly.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Optional

from ..backends.triton.launch import GemmConfig

if TYPE_CHECKING:
    from ..backends.targets import Target
    from ..backends.triton.gemm import Operand

SMALL_M = 16
"""M up to this is "small" (decode; the backends' ``SMALL_M``)."""
MID_M = 256
"""M up to this (and above SMALL_M) is "mid"."""

CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(GemmConfig) if f.name != "extra")
"""The GemmConfig fields of this version (a knob named so is a config field)."""

AMD_EXTRA = ("kpack", "matrix_instr_nonkdim", "waves_per_eu")
"""The order of an AMD config's ``extra`` options (the backends' order: kpack first)."""

NATIVE_MIN_BLOCK_M = {"sm_100": 128}
"""The smallest M tile that keeps the native block-scaled MMA, per target (A4W4)."""

NATIVE_WARPS = {"sm_100": (4, 8)}
"""The warps per program that keep the native block-scaled MMA, per target (A4W4)."""

NATIVE_NONKDIM = {"gfx950": (16, 32)}
"""``matrix_instr_nonkdim`` values of the native scaled MFMA, per target."""

Choices = tuple[tuple[int, ...], tuple[int, ...]]  # (curated, full)


def _by_m(small: Choices, mid: Optional[Choices] = None, large: Optional[Choices] = None) -> dict[str, Choices]:
    mid = mid or small
    return {"small": small, "mid": mid, "large": large or mid}


_TILES_M = (16, 32, 64, 128, 256)
_TILES_N = (32, 64, 128, 256)
_TILES_K = (32, 64, 128, 256, 512)
_NVIDIA = {
    "block_m": _by_m(((16,), (16, 32, 64)), ((32, 64, 128), _TILES_M), ((64, 128, 256), _TILES_M)),
    "block_n": _by_m(((64, 128, 256), _TILES_N)),
    "block_k": _by_m(((128, 256), _TILES_K)),
    "group_m": _by_m(((8,), (1, 4, 8, 16)), ((8,), (1, 4, 8, 16)), ((4, 8), (1, 4, 8, 16))),
    "num_warps": _by_m(((4, 8), (2, 4, 8, 16))),
    "num_stages": _by_m(((3, 4), (1, 2, 3, 4, 5)), ((3, 4), (1, 2, 3, 4, 5)), ((2, 3, 4), (1, 2, 3, 4, 5))),
    "split_k": _by_m(((1, 2, 4, 8), (1, 2, 4, 8, 16)), ((1, 2, 4), (1, 2, 4, 8)), ((1,), (1, 2, 4))),
}
_AMD = {
    **_NVIDIA,
    "num_stages": _by_m(((2,), (1, 2, 3))),
    "waves_per_eu": _by_m(((0, 2), (0, 1, 2, 3, 4))),
    "matrix_instr_nonkdim": _by_m(((16, 32), (16, 32))),
    "kpack": _by_m(((1,), (1,))),
}
_INTERPRET = {  # the interpreter ignores warps and stages; tiles change only its speed
    "block_m": _by_m(((16, 32), (16, 32, 64, 128)), ((16, 32, 64), (16, 32, 64, 128))),
    "block_n": _by_m(((32, 64), (32, 64, 128))),
    "block_k": _by_m(((32, 64, 128), (32, 64, 128, 256))),
    "group_m": _by_m(((1, 2), (1, 2, 4, 8))),
    "split_k": _by_m(((1,), (1, 2))),
}

KNOBS: dict[str, dict[str, dict[str, Choices]]] = {
    name: {vendor: table[name] for vendor, table in (("nvidia", _NVIDIA), ("amd", _AMD), ("interpret", _INTERPRET))
           if name in table}
    for name in ("block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages", "split_k",
                 "waves_per_eu", "matrix_instr_nonkdim", "kpack")
}
"""knob -> vendor ("nvidia", "amd", "interpret") -> M class -> (curated, full) choices.
The kernels' knobs are offered per target and M range here, and only here (a knob the
table lists for no vendor is never tuned). ``waves_per_eu`` 0 means no occupancy hint."""

PARAMS = tuple(KNOBS)
"""The knobs in enumeration order."""


def m_class(m: Optional[int]) -> str:
    """"small" (M <= SMALL_M), "mid" (M <= MID_M) or "large" (M > MID_M or None)."""
    if m is None:
        return "large"
    return "small" if m <= SMALL_M else "mid" if m <= MID_M else "large"


@dataclass(frozen=True)
class GemmSpace:
    """A product space of GEMM configs: ``choices`` maps each tuned knob to its ascending
    choices (two or more); ``fixed`` holds the value every candidate carries for the other
    knobs and config fields (single-choice knobs, the default config's values); ``notes``
    say which restrictions shaped the choices; ``block_k_cap`` is the macro-block cap.
    ``vendor`` ("nvidia", "amd" or "interpret") is whose table it came from."""

    name: str
    vendor: str
    choices: tuple[tuple[str, tuple[int, ...]], ...]
    fixed: tuple[tuple[str, Any], ...] = ()
    notes: tuple[str, ...] = ()
    block_k_cap: Optional[int] = None
    kp: Optional[int] = None

    @property
    def params(self) -> dict[str, tuple[int, ...]]:
        return dict(self.choices)

    def __len__(self) -> int:
        n = 1
        for _, values in self.choices:
            n *= len(values)
        return n

    def candidates(self) -> list[GemmConfig]:
        """Every config of the space, in a fixed order (first knob slowest)."""
        names = [name for name, _ in self.choices]
        return [self.decode(dict(zip(names, values)))
                for values in itertools.product(*(values for _, values in self.choices))]

    def distributions(self) -> dict[str, Any]:
        """The Optuna encoding: one categorical distribution per tuned knob."""
        from optuna.distributions import CategoricalDistribution

        return {name: CategoricalDistribution(list(values)) for name, values in self.choices}

    def encode(self, config: GemmConfig) -> dict[str, int]:
        """The parameters of ``config`` (raises ValueError when it is not in the space)."""
        out = {}
        for name, values in self.choices:
            value = knob_value(config, name)
            if value not in values:
                raise ValueError(f"{config.label()}: {name}={value} is not a choice of space {self.name} {values}")
            out[name] = value
        if self.decode(out) != config:
            raise ValueError(f"{config.label()} is not a config of space {self.name}")
        return out

    def decode(self, params: dict[str, int]) -> GemmConfig:
        """The config of a parameter assignment (every tuned knob of the space)."""
        values = {**dict(self.fixed), **{k: int(v) for k, v in params.items()}}
        fields = {k: v for k, v in values.items() if k in CONFIG_FIELDS}
        extra = {k: v for k, v in values.items() if k not in CONFIG_FIELDS}
        if not extra.get("waves_per_eu"):  # 0: no occupancy hint, as the backends' defaults
            extra.pop("waves_per_eu", None)
        order = [k for k in AMD_EXTRA if k in extra] + sorted(k for k in extra if k not in AMD_EXTRA)
        return GemmConfig(**fields, extra=tuple((k, extra[k]) for k in order))

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

    def violation(self, config: GemmConfig) -> str:
        """Why ``config`` breaks a rule across knobs ("" when it does not): a K split that
        leaves a split without a K tile."""
        split = int(getattr(config, "split_k", 1) or 1)
        if split > 1 and self.kp is not None and split * config.block_k > self.kp:
            return f"rule: split_k {split} x block_k {config.block_k} > padded K {self.kp} (a split without a K tile)"
        return ""

    def fingerprint(self) -> str:
        """8 hex digits naming the choices, fixed values and caps (a changed space is a new study)."""
        blob = json.dumps([self.choices, self.fixed, self.block_k_cap, self.kp], sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:8]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "vendor": self.vendor, "choices": {k: list(v) for k, v in self.choices},
                "fixed": [[k, v] for k, v in self.fixed], "notes": list(self.notes),
                "block_k_cap": self.block_k_cap, "kp": self.kp}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "GemmSpace":
        return cls(d["name"], d["vendor"], tuple((k, tuple(int(x) for x in v)) for k, v in d["choices"].items()),
                   tuple((k, v) for k, v in d.get("fixed", ())), tuple(d.get("notes", ())), d.get("block_k_cap"),
                   d.get("kp"))


def knob_value(config: GemmConfig, name: str) -> Any:
    """The value of knob ``name`` in ``config`` (a field, or an ``extra`` option; 0 for an
    absent ``waves_per_eu``, None for another absent option)."""
    if name in CONFIG_FIELDS:
        return getattr(config, name)
    return dict(config.extra).get(name, 0 if name == "waves_per_eu" else None)


def config_to_json(config: GemmConfig) -> dict[str, Any]:
    """The config's fields as JSON (``extra`` as [name, value] pairs)."""
    d = dataclasses.asdict(config)
    d["extra"] = [list(kv) for kv in config.extra]
    return d


def config_from_json(d: dict[str, Any]) -> GemmConfig:
    """A GemmConfig from :func:`config_to_json` (raises ValueError on a field this version lacks)."""
    unknown = set(d) - set(CONFIG_FIELDS) - {"extra"}
    if unknown:
        raise ValueError(f"GemmConfig of this version has no field {', '.join(sorted(unknown))}")
    return GemmConfig(**{**d, "extra": tuple(tuple(kv) for kv in d.get("extra", ()))})


# ----------------------------------------------------------------------------- building


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
    every study measures). See the module doc for the table and the restrictions."""
    pick = 1 if full else 0
    mc = m_class(m)
    vendor = "interpret" if target is None else target.vendor
    known = set(CONFIG_FIELDS) | (set(AMD_EXTRA) if vendor == "amd" else set())
    notes: list[str] = []
    choices: dict[str, tuple[int, ...]] = {}
    for name, per_vendor in KNOBS.items():
        if vendor not in per_vendor:
            continue
        if name not in known:
            notes.append(f"knob {name}: not a GemmConfig field in this version, not tuned")
            continue
        choices[name] = tuple(sorted(set(per_vendor[vendor][mc][pick])))

    native_a4w4 = target is not None and target.native_mx and a.format is None
    if "block_m" in choices and m is not None:
        top = max(64, 1 << max(0, m - 1).bit_length())
        choices["block_m"] = tuple(v for v in choices["block_m"] if v <= top) or (min(choices["block_m"]),)
    if native_a4w4 and target.name in NATIVE_MIN_BLOCK_M:
        low = NATIVE_MIN_BLOCK_M[target.name]
        choices["block_m"] = tuple(v for v in choices["block_m"] if v >= low) or (low,)
        notes.append(f"{target.name} A4W4: BLOCK_M >= {low} (native block-scaled MMA)")
    if native_a4w4 and target.name in NATIVE_WARPS and "num_warps" in choices:
        choices["num_warps"] = tuple(v for v in choices["num_warps"] if v in NATIVE_WARPS[target.name]) \
            or NATIVE_WARPS[target.name][:1]
        notes.append(f"{target.name} A4W4: num_warps in {NATIVE_WARPS[target.name]} (native block-scaled MMA)")
    if target is not None and target.name in NATIVE_NONKDIM and "matrix_instr_nonkdim" in choices:
        choices["matrix_instr_nonkdim"] = NATIVE_NONKDIM[target.name]
        notes.append(f"matrix_instr_nonkdim in {NATIVE_NONKDIM[target.name]} (native scaled MFMA)")
    cap = block_k_cap(a, b, kp)
    if cap is not None:
        notes.append(f"macro factors promoted per K tile: BLOCK_K <= {cap}")
        choices["block_k"] = _capped(choices["block_k"], cap)
    if "split_k" in choices and kp is not None:
        smallest = min(choices["block_k"])
        kept = tuple(v for v in choices["split_k"] if v * smallest <= kp) or (1,)
        if kept != choices["split_k"]:
            notes.append(f"split_k <= {max(kept)} (every split has a K tile)")
        choices["split_k"] = kept

    # the default's values join the choices; a knob the table does not list keeps its value
    fixed: dict[str, Any] = {}
    if default is not None:
        for name, value in dataclasses.asdict(default).items():
            if name != "extra" and name not in choices:
                fixed[name] = value
        for name, value in default.extra:
            if name not in choices:
                fixed[name] = value
        for name in list(choices):
            value = knob_value(default, name)
            if value is None or (name == "split_k" and value == 0):  # 0: the backend's per-shape split
                continue
            if name == "block_k" and cap is not None:
                value = min(value, cap)
            choices[name] = tuple(sorted(set(choices[name]) | {value}))
    if "group_m" in choices and m is not None and m <= min(choices["block_m"]):
        fixed["group_m"] = knob_value(default, "group_m") if default is not None else min(choices["group_m"])
        notes.append("group_m fixed: every M tile choice covers M in one row of tiles")
        del choices["group_m"]
    for name in [n for n, v in choices.items() if len(v) == 1]:
        fixed[name] = choices.pop(name)[0]

    kind = ("A4W4" if a.format is None else "W4A16" if a.quant is None else "A4W4-tokens") + f" a:{a.tag()} b:{b.tag()}"
    name = f"{'full' if full else 'default'}:{target.name if target else 'interpret'}:{kind}:{mc}-M"
    ordered = tuple((p, choices[p]) for p in PARAMS if p in choices)
    fixed_items = tuple(sorted(fixed.items()))
    return GemmSpace(name, vendor, ordered, fixed_items, tuple(notes), cap, kp)
