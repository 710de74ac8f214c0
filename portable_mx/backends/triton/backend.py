"""The backend half shared by every Triton backend: it turns the registry's canonical
rows problems into kernel launches. A vendor backend (cuda.py, rocm.py) or the
interpreter backend (interpret.py) says which devices it serves, which targets it
compiles for, and which tile configs and launch options it uses; nothing vendor-specific
lives here.

The hot ops (quantize and the GEMM) are a plan and an execution. Everything decided by
(device, op, dtypes, recipe or operand kinds, shapes) is decided on the first call and
kept per device (:class:`_Device`): the target, the tile config (the tuned one from the
config cache, else the backend's default), the grid, the constexprs and, after the
first launch, the compiled kernel (:class:`~.launch.Launch`). A later call with the same
key allocates its outputs (``torch.empty``: torch's caching allocator, so CUDA-graph
capture records them) and makes one launch (:func:`~.launch.launch`). A weight's
prepared GEMM operand (contiguous parts, operand kind, alignment) is kept with its
MXTensor (:meth:`MXTensor.memo`). Nothing on these paths reads device memory from the
host or depends on tensor values: they can be captured in a CUDA graph.

A plan key holds every integer argument of its launch and the 16-byte alignment of every
pointer, which is everything Triton's JIT specialises on beyond dtypes, so the kernel a
plan keeps is the one the JIT would pick for the same call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ... import _graphs
from ...decompose import Decomposition
from ...recipe import QuantRecipe
from ...registry import Backend
from ...tensor import MXTensor, materialized, part_versions, version_of
from ...tuning import cache as config_cache
from ..targets import Target, probe
from . import launch as _launch
from . import mode_problem
from .launch import GemmConfig, KernelLaunch, Launch, TileConfig

# Recipes the compile matrix compiles for each target: every kernel specialization that
# changes the generated code in kind (rules differ by a few integer ops; the heaviest
# combination is included), fp32/bf16/fp16 inputs.
_AOT_RECIPES = (
    QuantRecipe(),
    QuantRecipe(scale_rule="even"),
    QuantRecipe(rounding="stochastic", seed=1),
    QuantRecipe(macro_block=128),
    QuantRecipe(macro_block=4096),
    QuantRecipe(outliers_per_block=1),
    QuantRecipe(outliers_per_block=2, macro_block=256, rounding="stochastic", seed=1),
)
_AOT_DTYPES = (torch.bfloat16, torch.float32, torch.float16)


def _aot_gemms():
    """The operand kinds the compile matrix compiles the GEMM for, with the dtype each
    stores: A4W4 plain (fp32), MBS (per tile and in the epilogue) and OF on both sides
    (bf16); W4A16 in bf16 and fp16, with MBS and with weight outliers (the activations'
    dtype; fp16 tokens multiply bf16 outliers as two bf16 parts, numerics.bf16_pair)."""
    from .gemm import Operand

    mx, bf16 = Operand(None, None, 0), Operand(torch.bfloat16, None, 0)
    f32, b16, f16 = torch.float32, torch.bfloat16, torch.float16
    return (
        (mx, mx, f32), (Operand(None, 128, 0), Operand(None, 128, 0), b16),
        (Operand(None, 8192, 0), Operand(None, 8192, 0), b16), (Operand(None, None, 1), Operand(None, 128, 2), b16),
        (bf16, mx, b16), (Operand(torch.float16, None, 0), mx, f16), (bf16, Operand(None, 128, 0), b16),
        (bf16, Operand(None, None, 2), b16), (Operand(torch.float16, None, 0), Operand(None, None, 2), f16),
    )


@dataclass(frozen=True)
class GemmRoute:
    """Which GEMM kernel a launch uses and how it reads the weight: ``kernel`` "scaled"
    (gemm.py, ``tl.dot_scaled``: native block-scaled MMA, weight scales in ``scales``) or
    "upcast" (gemm_upcast.py, the MXFP4 tiles decoded in registers, read as ``upcast``
    says)."""

    kernel: str
    scales: Any = None
    upcast: Any = None


_WORD_DTYPES = (torch.bfloat16, torch.float16)
"""Token dtypes the upcast kernel quantizes itself (read as words of two elements)."""

STORE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Output dtypes the GEMM kernel stores itself (any other is stored fp32, then cast)."""

GROUPED_MM_BF16_TARGETS = ("sm_90", "sm_100")
"""Targets where torch's ``grouped_mm`` multiplies bf16 operands into a bf16 result with its
own kernel on the device (aten GroupedBlas.cpp: compute capability 9.x and 10.x; torch
2.9 - 2.11): the backward's bf16 ragged dW takes it there. Everywhere else, and for any
other dtypes, torch loops over the experts after copying the offsets to the host, and
the ragged kernels (ragged.py) serve instead."""
_MAX_PLANS = 4096  # per device and op: past it the plans are dropped and rebuilt on demand


_is_compiling = torch.compiler.is_compiling
_current_device = _launch.current_device


class _Device:
    """What a Triton backend decided for one device, once: its target, the weight's
    scale layout, whether the GEMM stores fp32 and casts afterwards (the interpreter,
    whose fp32 -> bf16 conversion truncates), the context launches run in, and the launch
    plans (quantize per recipe and shapes, dequantize and the GEMM per operand kinds and
    shapes)."""

    __slots__ = ("device", "index", "target", "layout", "cast_output", "running", "quantize_plans",
                 "quantize_by_value", "dequantize_plans", "gemm_plans", "grouped_plans", "cache_generation", "upcasts",
                 "token_quant")

    def __init__(self, backend: "TritonBackend", device: torch.device) -> None:
        self.device = device
        self.target = backend.target(device)
        # the GPU's index where kernels are compiled for it (None: the CPU, the interpreter):
        # Triton launches on the *current* device, so a launch for another one is guarded
        gpu = torch.device(device)  # (callers may name it by a string)
        self.index = gpu.index if gpu.type == "cuda" and self.target is not None else None
        self.layout = backend.scale_layout(self.target)
        self.cast_output = self.target is None
        overridden = type(backend).running is not TritonBackend.running
        self.running = backend.running if overridden else None
        self.quantize_plans: dict[tuple, tuple[QuantRecipe, _QuantizePlan]] = {}  # by recipe object
        self.quantize_by_value: dict[tuple, _QuantizePlan] = {}  # by recipe value
        self.dequantize_plans: dict[tuple, tuple] = {}  # see TritonBackend._plan_dequantize
        self.gemm_plans: dict[tuple, _GemmPlan] = {}
        self.grouped_plans: dict[tuple, Any] = {}  # grouped_gemm.GroupedPlan and combine launches
        self.cache_generation = config_cache.generation()
        self.upcasts = None  # whether the A4W4 GEMM decodes its operands (TritonBackend.left_values)
        self.token_quant = None  # whether the W4A16 GEMM runs the upcast kernel (TritonBackend.matmul_on_values)


class _QuantizePlan:
    """One quantize launch: x [R, K] of one dtype, row stride and alignment, one recipe;
    how x becomes the kernel's input (``words``: None for x itself, else a function making
    the padded or fp32 copy), the output shapes and the integer arguments."""

    __slots__ = ("launch", "words", "qdata", "scales", "macro", "outliers", "ints")

    def __init__(self, launch, words, qdata, scales, macro, outliers, ints) -> None:
        self.launch, self.words, self.qdata, self.scales = launch, words, qdata, scales
        self.macro, self.outliers, self.ints = macro, outliers, ints


class _GemmPlan:
    """One GEMM launch: operand kinds, M, N, K, strides and alignment, output dtype; the
    weight's storage layouts (``weight``: None for the MXTensor's own parts, else the key
    and builder of its swizzled copy, kept by ``_Operand.storage``), the split-K buffers'
    sizes (``split``: None without split-K, else :func:`splitk.buffers`, the workspace's
    elements and the tiles, for a call at each launch: the buffers belong to the launch's
    stream, not to the plan) and the integer arguments."""

    __slots__ = ("launch", "store", "ints", "weight", "split")

    def __init__(self, launch, store, ints, weight=None, split=None) -> None:
        self.launch, self.store, self.ints = launch, store, ints
        self.weight, self.split = weight, split


def _weight_parts(values, scales, bsmax: Optional[bool] = None):
    """A memo builder: an MXTensor's GEMM parts with its codes in value layout ``values``
    and its scales in ``scales`` (layouts.py), swizzled once; ``bsmax`` (the upcast
    kernel's last weight part): True, the largest scale byte (read by its folded decode);
    False, a stand-in never read."""
    from .layouts import largest_scale, prepared

    def build(mx: MXTensor):
        parts = _weight_operand(mx).parts
        out = (prepared(parts[0], values), prepared(parts[1], scales), *parts[2:])
        if bsmax is not None:
            out += (largest_scale(parts[1]) if bsmax else parts[1],)
        return out

    return build


VALUES_MIN_N = 2048
"""The output width from which an A4W4 GEMM with more than 16 rows runs as the W4A16 GEMM
on the tokens' values on upcast targets: its A4W4 kernel decodes each token value once per
column of tiles (256 columns at prefill: ~5.4 instructions a value each time on sm_90),
against ~3 more bytes a value moved by the values pass; they break even near N ~ 1400 on
an H100/H200-class GPU (NOTES-gemm.md, "A4W4 at every size on upcast targets")."""


@functools.cache
def _module(name: str):
    """A module of this package (relative ``name``), imported on its first use (the kernel
    modules need triton, which this one does not) and then found by a dict lookup, not the
    import machinery (~0.4 us a ``from . import`` on the grouped GEMM's hot path)."""
    return importlib.import_module(name, __package__)


def _values_shape(m: int, n: int, recipe: QuantRecipe) -> bool:
    """The shapes and recipes :meth:`TritonBackend.left_values` serves on upcast targets:
    no macro blocks or outliers (their values are not bf16 numbers), and M <= 16 or N >=
    :data:`VALUES_MIN_N`."""
    return (m <= 16 or n >= VALUES_MIN_N) and recipe.macro_block is None and not recipe.outliers_per_block


class _Operand:
    """An MXTensor in the rows layout as the GEMM kernel takes it: its five part pointers
    (codes, scales, macro factors, outlier bits as int16, outlier indices; absent parts
    stood in for by the scales, never read), its kind (format None, macro block,
    outliers per block), and ``key``: the kind, K, padded K, rows and the alignment.
    A part that is not contiguous is copied; ``copied`` keeps each such source with its
    version counter, so that a kept operand is made again after an in-place write to
    one (:meth:`fresh`, the weight memo's check). ``stored``: the parts in the storage
    layouts GEMM plans asked for (:meth:`storage`)."""

    __slots__ = ("parts", "kind", "key", "copied", "stored")

    def __init__(self, mx: MXTensor) -> None:
        s = mx.scales.contiguous()
        ov = mx.outlier_values
        self.parts = (mx.qdata.contiguous(), s,
                      s if mx.macro_scales is None else mx.macro_scales.contiguous(),
                      s if ov is None else ov.contiguous().view(torch.int16),
                      s if mx.outlier_indices is None else mx.outlier_indices.contiguous())
        self.kind = (None, mx.recipe.macro_block if mx.macro_scales is not None else None,
                     0 if ov is None else ov.shape[-1])
        aligned = all(p.data_ptr() % 16 == 0 for p in self.parts)
        self.key = (self.kind, mx.shape[1], mx.k_padded, mx.qdata.shape[0], aligned)
        sources = (mx.qdata, mx.scales, mx.macro_scales, ov, mx.outlier_indices)
        self.copied = tuple((t, version_of(t)) for t, p in zip(sources, self.parts)
                            if t is not None and not t.is_contiguous()) or None
        self.stored: Optional[dict[str, tuple]] = None  # (made on first use: a left operand never stores)

    def storage(self, mx: MXTensor, key: str, build) -> tuple:
        """``build(mx)``: the weight's parts in the storage layouts named ``key`` (swizzled
        copies: :func:`_weight_parts`), made once and again after an in-place write of any
        part of ``mx``, this operand's MXTensor (:func:`~portable_mx.tensor.part_versions`,
        as :meth:`MXTensor.memo` keeps copies; inference tensors: made on every call).
        One lookup with the operand's own: the dense and grouped GEMMs' hot path.

        CUDA graphs (``portable_mx._graphs``): made while the stream is captured, not kept;
        made again after an in-place write, copied into the kept tensors (their addresses,
        which a graph captured before reads, now hold the new layouts) where the shapes
        agree."""
        versions = part_versions(mx)
        if versions is None:
            return build(mx)
        stored = self.stored
        if stored is None:
            stored = self.stored = {}
        kept = stored.get(key)
        if kept is None or kept[0] != versions:
            value = build(mx)
            if _graphs.capturing(mx.qdata):
                return value
            if kept is not None and _graphs.refill(kept[1], value, mx.parts()):
                value = kept[1]
            kept = stored[key] = (versions, value)
        return kept[1]

    def fresh(self) -> bool:
        """Whether no part it copied was written in place since (an inference tensor has
        no version counter: a copy of one is never taken as fresh)."""
        return self.copied is None or all(v is not None and version_of(t) == v for t, v in self.copied)


def _weight_operand(mx: MXTensor) -> _Operand:
    """The weight's kept GEMM operand (made again when a copied part was written: into
    the kept one's copies where the shapes agree, :func:`_refreshed`)."""
    kept = mx.__dict__.get("_memo")  # (memo's lookup inlined for one that copied nothing: valid while it lives)
    if kept is not None:
        kept = kept.get("gemm-operand")
        if kept is not None and kept.copied is None and not _is_compiling():
            return kept
    if kept is None or _is_compiling():
        return mx.memo("gemm-operand", _Operand, valid=_Operand.fresh)
    return mx.memo("gemm-operand", lambda m: _refreshed(m, kept), valid=_Operand.fresh)


def _refreshed(mx: MXTensor, stale: _Operand) -> _Operand:
    """A new operand of ``mx``, whose non-contiguous parts were written in place since
    ``stale`` copied them; outside a CUDA graph capture, its copies written into
    ``stale``'s where the shapes agree and ``stale`` returned (its addresses, and the
    storage layouts it keeps, which a graph captured with it reads, stay: the layouts are
    made again at their next use, into their kept tensors too)."""
    new = _Operand(mx)
    if _graphs.capturing(mx.qdata) or new.key != stale.key or not _graphs.refill(
            stale.parts, new.parts, mx.parts()):
        return new
    stale.copied = new.copied
    return stale


class TritonBackend(Backend):
    """quantize, dequantize, decompose and matmul with the Triton kernels of this package.

    Subclasses set ``name``, ``priority``, ``targets``, ``tiles`` and ``gemm_tiles`` and
    implement :meth:`unavailable_reason` and :meth:`target`.
    """

    ops = frozenset({"quantize", "dequantize", "decompose", "matmul", "grouped_matmul"})
    targets: tuple[str, ...] = ()
    """Names of the compile targets (targets.TARGETS) this backend launches on."""

    def target(self, device: torch.device) -> Optional[Target]:
        """The compile target of ``device`` (None for the interpreter)."""
        raise NotImplementedError

    tiles: dict[str, TileConfig] = {}
    """Default tile config per kernel: "quantize", "quantize-heavy" (stochastic rounding or
    outliers), "quantize-macro" (macro blocks, not heavy; "quantize" where absent),
    "quantize-stochastic-masked" (optional: the masked variant with stochastic rounding,
    the same tiles as the key it replaces),
    "dequantize", "decompose" (statistics only), "decompose-full" (with the element
    tensors)."""

    target_tiles: dict[str, dict[str, TileConfig]] = {}
    """Per target name, tile configs that replace those of ``tiles`` there."""

    def tile_config(self, op: str, target: Optional[Target], recipe: Optional[QuantRecipe],
                    masked: bool = False) -> TileConfig:
        """The tile config and launch options of ``op`` on ``target`` for ``recipe``;
        ``masked``: for the masked variant (ragged tiles) of a quantize, where a target's
        "quantize-stochastic-masked" (same tiles, other launch options) comes first for
        stochastic rounding."""
        key = op
        if op == "quantize" and recipe is not None:
            if recipe.rounding == "stochastic" or recipe.outliers_per_block > 0:
                key = "quantize-heavy"
            elif recipe.macro_block is not None:
                key = "quantize-macro"
        own = self.target_tiles.get(target.name, {}) if target is not None else {}
        keys = (key, "quantize") if key == "quantize-macro" else (key,)
        if masked and op == "quantize" and recipe is not None and recipe.rounding == "stochastic":
            keys = ("quantize-stochastic-masked",) + keys
        for k in keys:
            config = own.get(k) or self.tiles.get(k)
            if config is not None:
                return config
        raise KeyError(f"{self.name}: no tile config for {key!r}")

    gemm_tiles: dict[str, dict[str, GemmConfig]] = {}
    """GEMM configs per target name ("interpret" for the interpreter), keyed "a4w4" or
    "w4a16" (16-bit left operand), plus "-small" for M <= SMALL_M or "-mid" for M <=
    MID_M, plus "-heavy" when an operand has macro factors or outliers (their extra
    accumulator and correction dots need smaller tiles to stay in registers); missing keys
    fall back as :meth:`default_gemm_config` says. ``block_m`` counts the left operand's
    rows (tokens), ``block_n`` the weight's; ``split_k = 0``: :meth:`resolve_split_k`."""

    SMALL_M = 16

    scale_layouts: dict[str, str] = {}
    """The storage layout of the weight's scales in the ``tl.dot_scaled`` GEMM per target
    name (``layouts.LAYOUTS``; "plain" where absent)."""

    upcast_layouts: dict[str, str] = {}
    """The weight's value layout in the upcast GEMM per target name
    (``layouts.VALUE_LAYOUTS``; "plain" where absent; its scale layout goes with it)."""

    upcast_asm: tuple[str, ...] = ()
    """Targets whose upcast GEMM decodes bf16 with inline assembly (upcast.py)."""

    scaled_outliers: tuple[str, ...] = ()
    """Upcast targets on which launches with outliers (OF) use the ``tl.dot_scaled``
    kernel (where it compiles and has been measured)."""

    gemm_sms: dict[str, int] = {}
    """Nominal SM / CU count per target name: what ``split_k = 0`` assumes for the
    ahead-of-time compile (a live device reports its own)."""

    def scale_layout(self, target: Optional[Target]):
        from .layouts import LAYOUTS

        return LAYOUTS[self.scale_layouts.get(target.name, "plain") if target is not None else "plain"]

    MID_M = 128

    grouped_tiles: dict[str, dict[str, GemmConfig]] = {}
    """Per target name, grouped GEMM configs that replace the dense ones of the same key
    (``gemm_tiles``' keys: the grouped kernel's row and column index vectors, bias and
    activation need registers the dense tile does not have)."""

    grouped_min_block_m: dict[str, int] = {}
    """Per target name, the smallest BLOCK_M of the A4W4 grouped GEMM (sm_100's
    block-scaled tcgen05 MMA needs 128 rows); 16 where absent."""

    def grouped_config(self, target: Optional[Target], rows: int, num_experts: int, a_format: Optional[torch.dtype],
                       heavy: bool, *, pair: bool = False) -> GemmConfig:
        """The grouped GEMM's config for ``rows`` expert-sorted rows over ``num_experts``
        experts: the default for the mean rows per expert (``grouped_tiles`` over
        ``gemm_tiles``), its BLOCK_M lowered to
        the routing's tile height (moe.routing.default_tile_m: tiles never span experts)
        but not below ``grouped_min_block_m``."""
        from ...moe.routing import default_tile_m

        mean = -(-rows // num_experts)
        name = target.name if target is not None else "interpret"
        tiles = {**self.gemm_tiles[name], **self.grouped_tiles.get(name, {})}
        config = self.default_gemm_config(target, mean, a_format, heavy, tiles, pair=pair)
        floor = self.grouped_min_block_m.get(target.name, 16) if target is not None and a_format is None else 16
        block_m = max(min(config.block_m, default_tile_m(rows, num_experts)), floor)
        return config if block_m == config.block_m else dataclasses.replace(config, block_m=block_m)

    def default_gemm_config(self, target: Optional[Target], m: int, a_format: Optional[torch.dtype],
                            heavy: bool, tiles: Optional[dict[str, GemmConfig]] = None, *,
                            pair: bool = False) -> GemmConfig:
        """The heuristic GEMM config for an M-row left operand of ``a_format`` (None:
        MXFP4), ``heavy`` when an operand has macro factors or outliers, ``pair`` when fp16
        tokens meet the weight's outliers (``gemm.Operand.pairs_with``): the first that
        ``gemm_tiles`` has of "<kind>-small" (M <= SMALL_M; "-small-heavy" first when
        heavy) or "<kind>-mid" (M <= MID_M; "-mid-heavy" and "-heavy" first when heavy),
        then "<kind>" ("-heavy" first when heavy); above SMALL_M "<kind>-pair" before all
        when pair. ``tiles``: another table than ``gemm_tiles``' for the target (the
        grouped GEMM's)."""
        base = "a4w4" if a_format is None else "w4a16"
        if m <= self.SMALL_M:
            keys = [base + "-small-heavy", base + "-small"] if heavy else [base + "-small"]
        else:
            keys = [base + "-pair"] if pair else []
            if m <= self.MID_M:
                keys += [base + "-mid-heavy", base + "-heavy", base + "-mid"] if heavy else [base + "-mid"]
        keys += [base + "-heavy", base] if heavy else [base]
        if tiles is None:
            tiles = self.gemm_tiles[target.name if target is not None else "interpret"]
        for key in keys:
            if key in tiles:
                return tiles[key]
        raise KeyError(f"no GEMM config for {base} at M={m} in gemm_tiles")

    def launch_config(self, target: Optional[Target], a, config: GemmConfig, store: torch.dtype) -> GemmConfig:
        """The config a dense GEMM launches with on ``target`` once its split is resolved:
        ``config`` with the launch options this backend adds for a left operand like ``a``
        (``gemm.Operand``) and an output stored as ``store`` (a register cap where one was
        measured faster, backends/cuda.py), or ``config`` itself (here: always). The plan
        (:meth:`run_gemm`) and :meth:`gemm_launch_spec` (the compile matrix, the tuner's
        static stage, the sweeps) both ask here."""
        return config

    def gemm_route(self, target: Optional[Target], a, b) -> GemmRoute:
        """The GEMM kernel and weight layouts of operands like ``a``, ``b``
        (``gemm.Operand``) on ``target`` (None: the interpreter, which runs the
        ``tl.dot_scaled`` kernel): the native block-scaled MMA where the target has one,
        else the upcast kernel (outliers may stay on ``tl.dot_scaled`` where
        ``scaled_outliers`` says so)."""
        from .gemm_upcast import UpcastRoute
        from .layouts import VALUE_LAYOUTS

        if target is None or target.native_mx or ((a.outliers or b.outliers) and target.name in self.scaled_outliers):
            return GemmRoute("scaled", scales=self.scale_layout(target))
        values = VALUE_LAYOUTS[self.upcast_layouts.get(target.name, "plain")]
        return GemmRoute("upcast", upcast=UpcastRoute(values, asm=target.name in self.upcast_asm))

    def sm_count(self, device: torch.device, target: Optional[Target]) -> int:
        """Streaming multiprocessors (CUs) of ``device``: what ``split_k = 0`` fills (read
        from a live GPU; the target's nominal count otherwise; 4 for the interpreter).
        Asked once per GEMM plan, never per call."""
        if target is None:
            return 4
        if torch.device(device).type == "cuda" and torch.cuda.is_available():
            try:
                return torch.cuda.get_device_properties(device).multi_processor_count
            except (RuntimeError, AssertionError, AttributeError):  # a simulated device
                pass
        return self.gemm_sms.get(target.name, 132)

    def resolve_split_k(self, config: GemmConfig, m: int, n: int, kp: int, sms: int) -> GemmConfig:
        """``config`` with ``split_k = 0`` (auto) made concrete for an M x N output and
        padded K ``kp`` on ``sms`` SMs: the largest split (at most 16, and at least 2 K
        tiles per split) that keeps the programs within one wave, counting 2 programs per
        SM for small tiles (M tiles of at most 32 rows) and 1 for the others."""
        if config.split_k != 0:
            return config
        tiles = -(-m // config.block_m) * -(-n // config.block_n)
        k_tiles = -(-kp // config.block_k)
        per_sm = 2 if config.block_m <= 32 else 1
        split = 1
        while split < 16 and split * 2 <= k_tiles // 2 and tiles * split * 2 <= per_sm * sms:
            split *= 2
        return dataclasses.replace(config, split_k=split)

    def options(self, config: TileConfig | GemmConfig) -> dict:
        """Launch options: the config's, and no FMA contraction (results must match the
        reference's separately rounded multiplies and adds)."""
        return {**config.options(), "enable_fp_fusion": False}

    def running(self):
        """Context every kernel launch runs in (nothing by default)."""
        return contextlib.nullcontext()

    def __init__(self) -> None:
        self._devices: dict[torch.device, _Device] = {}

    def _device(self, device: torch.device) -> _Device:
        """The per-device decisions (made on the first call on ``device``)."""
        found = self._devices.get(device)
        if found is None:
            found = self._devices[device] = _Device(self, device)
        return found

    def _launch(self, st: _Device, plan: Launch, args: tuple) -> None:
        """Run ``plan`` on ``st``'s device. Triton launches on the *current* device (its
        stream, its context): where that is another GPU (a model spread over GPUs in one
        process, ``device_map``-style, with the current device left at cuda:0) the
        launch runs under a device guard. Unguarded, the kernel ran on the current GPU's
        stream with addresses on another GPU, which fails or, with peer access on, races
        the operands' stream (silently wrong)."""
        if st.running is None and (st.index is None or _current_device() == st.index):
            _launch.launch(plan, args)  # (the hot path: _guard's test, inline)
        else:
            with self._context(st):
                _launch.launch(plan, args)

    @staticmethod
    def _guard(st: _Device) -> Optional[contextlib.AbstractContextManager]:
        """A device guard where ``st`` is a GPU the kernels are compiled for and not the
        current device, else None."""
        if st.index is None or _current_device() == st.index:
            return None
        return torch.cuda.device(st.index)

    def _context(self, st: _Device) -> contextlib.AbstractContextManager:
        """:meth:`running` and, where needed, the device guard (:meth:`_guard`)."""
        guard = self._guard(st)
        if guard is None:
            return self.running()
        stack = contextlib.ExitStack()
        stack.enter_context(guard)
        stack.enter_context(self.running())
        return stack

    def device_guard(self, device: torch.device) -> contextlib.AbstractContextManager:
        """:meth:`_guard` of ``device``, or nothing: for launches that are not planned (the
        tuner's :meth:`run_gemm`; :meth:`_launch` guards planned ones)."""
        return self._guard(self._device(device)) or contextlib.nullcontext()

    # ------------------------------------------------------------------- the ops

    def quantize(self, x: torch.Tensor, recipe: QuantRecipe) -> MXTensor:
        """x [R, K] (R, K > 0; unit stride along K, else copied) -> MXTensor (R, K), axis 1."""
        st = self._devices.get(x.device) or self._device(x.device)
        if x.is_neg():  # materialized(x), inlined on the hot path
            x = x.resolve_neg()
        strides = x.stride()
        if strides[1] != 1:
            x = x.contiguous()
            strides = x.stride()
        r, k = x.shape
        key = (id(recipe), x.dtype, r, k, strides[0], x.storage_offset() & 1, x.data_ptr() % 16 == 0)
        hit = st.quantize_plans.get(key)  # (a recipe's hash and == cost more than its id)
        plan = hit[1] if hit is not None and hit[0] is recipe else self._plan_quantize(st, key, x, recipe)
        dev = x.device
        words = x if plan.words is None else plan.words(x)
        qdata = torch.empty(*plan.qdata, dtype=torch.uint8, device=dev)  # (*shape: faster to parse)
        scales = torch.empty(*plan.scales, dtype=torch.uint8, device=dev)
        macro = ov = oi = None
        if plan.macro is None and plan.outliers is None:
            self._launch(st, plan.launch, (words, qdata, scales, scales, scales, scales, *plan.ints))
        else:
            if plan.macro is not None:
                macro = torch.empty(*plan.macro, dtype=torch.float32, device=dev)
            if plan.outliers is not None:
                ov = torch.empty(*plan.outliers, dtype=torch.bfloat16, device=dev)
                oi = torch.empty(*plan.outliers, dtype=torch.uint8, device=dev)
            args = (words, qdata, scales, scales if macro is None else macro,
                    scales if ov is None else ov.view(torch.int16), scales if oi is None else oi, *plan.ints)
            self._launch(st, plan.launch, args)
        return MXTensor._make(qdata, scales, x.shape, x.dtype, 1, recipe, macro, ov, oi)

    def quantized_values(self, x: torch.Tensor, recipe: QuantRecipe) -> torch.Tensor:
        """:meth:`Backend.quantized_values` in one launch: the quantize kernel writing the
        bf16 values of the codes instead of codes and scales (``VALUES``); x [R, K] (R, K
        > 0), recipes without macro blocks or outliers."""
        if recipe.macro_block is not None or recipe.outliers_per_block:
            raise ValueError(f"quantized_values: a recipe without macro blocks or outliers; got {recipe.describe()}")
        st = self._devices.get(x.device) or self._device(x.device)
        x = materialized(x)
        if x.stride(-1) != 1:
            x = x.contiguous()
        r, k = x.shape
        key = ("values", id(recipe), x.dtype, r, k, x.stride()[0], x.storage_offset() & 1, x.data_ptr() % 16 == 0)
        hit = st.quantize_plans.get(key)
        plan = hit[1] if hit is not None and hit[0] is recipe else self._plan_quantize(st, key, x, recipe)
        words = x if plan.words is None else plan.words(x)
        out = torch.empty(r, plan.qdata[1] * 2, dtype=torch.bfloat16, device=x.device)
        o = out.view(torch.int32)
        self._launch(st, plan.launch, (words, o, o, o, o, o, *plan.ints))
        return out

    def matmul_on_values(self, a: torch.Tensor, recipe: QuantRecipe, b: MXTensor,
                         out_dtype: torch.dtype = torch.float32, *,
                         bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """:meth:`Backend.matmul_on_values`; at decode sizes (M <= SMALL_M) with nearest
        rounding and bf16/fp16 tokens readable as words, in one launch: the upcast kernel
        quantizes the tokens itself (``gemm.Operand.quant``; the quantize kernel's values
        bit for bit, so the same products and the same accumulation: the two-launch form's
        bits), which halves the host's work of an eager A4W4 call at decode. Elsewhere the
        two launches of the default."""
        rule = self.token_quant_rule(a, recipe, b)
        if rule is not None:
            return self.matmul(a, b, out_dtype, rule, bias=bias)
        return super().matmul_on_values(a, recipe, b, out_dtype, bias=bias)

    def token_quant_rule(self, a: torch.Tensor, recipe: QuantRecipe, b: MXTensor) -> Optional[int]:
        """The scale rule's id with which :meth:`matmul_on_values` has the GEMM kernel
        quantize the tokens a [M, K] itself, or None where it launches the quantize kernel
        first: M <= SMALL_M, nearest rounding, bf16/fp16 tokens readable as words (unit
        stride, K, the row stride and the offset even), the W4A16 GEMM on the upcast
        kernel for this weight (benchmarks time what the dispatch launches with it)."""
        if not (a.shape[0] <= self.SMALL_M and recipe.rounding == "nearest" and a.dtype in _WORD_DTYPES
                and a.stride(-1) == 1 and a.shape[1] % 2 == 0 and a.stride()[0] % 2 == 0
                and a.storage_offset() % 2 == 0 and (b.outlier_values is None or not self.scaled_outliers)):
            return None
        st = self._devices.get(a.device) or self._device(a.device)
        if st.token_quant is None:
            gemm = _module(".gemm")
            st.token_quant = self.gemm_route(st.target, gemm.Operand(torch.bfloat16, None, 0, 0),
                                             gemm.Operand(None, None, 0)).kernel == "upcast"
        return _module(".numerics").RULE_IDS[recipe.scale_rule] if st.token_quant else None

    def left_values(self, m: int, n: int, recipe: QuantRecipe, device: torch.device) -> bool:
        """:meth:`Backend.left_values`: on targets whose A4W4 GEMM decodes its operands in
        registers (the upcast route: sm_90, gfx942), for recipes without macro blocks or
        outliers, at decode sizes (M <= 16) and wherever the output is wide (N >=
        :data:`VALUES_MIN_N`). The W4A16 kernel then reads bf16 values the quantize
        kernel wrote, instead of decoding the tokens' codes in every K step of every
        column of tiles (sm_90, per 8 weight values: 28.8 -> 23.9 instructions on the
        decode tile, 56.1 -> 34.6 on the prefill tile) at the price of one more pass over
        the tokens (bf16 written and read: about 3 bytes an element more than the codes)."""
        if not _values_shape(m, n, recipe):
            return False
        st = self._devices.get(device) or self._device(device)
        if st.upcasts is None:
            st.upcasts = self._a4w4_upcasts(st.target)
        return st.upcasts

    def left_values_on(self, target: Optional[Target], m: int, n: int, recipe: QuantRecipe) -> bool:
        """:meth:`left_values` for ``target`` (None: the interpreter) without a device:
        what the tuner asks to tune the kernel the dispatch launches."""
        return _values_shape(m, n, recipe) and self._a4w4_upcasts(target)

    def token_quant_on(self, target: Optional[Target], m: int, n: int, recipe: QuantRecipe) -> Optional[int]:
        """:meth:`token_quant_rule` for ``target`` without tokens (bf16, readable as
        words): the scale rule's id with which an A4W4 matmul of M x N rows quantizes its
        tokens inside the GEMM kernel, or None. What the tuner asks to tune that kernel
        (``Problem.launched``)."""
        if not (m <= self.SMALL_M and recipe.rounding == "nearest" and self.left_values_on(target, m, n, recipe)):
            return None
        gemm = _module(".gemm")
        route = self.gemm_route(target, gemm.Operand(torch.bfloat16, None, 0, 0), gemm.Operand(None, None, 0))
        return _module(".numerics").RULE_IDS[recipe.scale_rule] if route.kernel == "upcast" else None

    def _a4w4_upcasts(self, target: Optional[Target]) -> bool:
        """Whether the A4W4 GEMM on ``target`` decodes both operands in registers."""
        from .gemm import Operand

        mx = Operand(None, None, 0)
        return target is not None and self.gemm_route(target, mx, mx).kernel == "upcast"

    def _plan_quantize(self, st: _Device, key: tuple, x: torch.Tensor, recipe: QuantRecipe) -> _QuantizePlan:
        """The launch ``quantize.quantize`` makes, decided once per recipe value (a new
        recipe object equal to a known one finds its plan): relies on
        ``quantize.Plan.make(recipe, config)`` (block_r, span, constexprs, grid, even),
        ``encode.as_words`` and ``quantize_kernel(x, q, s, m, ov, oi, R, KW_IN, KW, NM,
        stride_w, seed, **constexprs)`` reading the input as words (two 16-bit or two fp32
        elements each)."""
        from . import interpreting
        from . import quantize as kernels
        from .encode import IN_KINDS, as_words, fma_divides, readable_as_words

        if len(st.quantize_plans) >= _MAX_PLANS:
            st.quantize_plans.clear()
        values = key[0] == "values"  # quantized_values' plan: the kernel writes bf16 values
        by_value = (recipe, *key[1:]) if not values else ("values", recipe, *key[2:])
        out = st.quantize_by_value.get(by_value)
        if out is not None:
            st.quantize_plans[key] = (recipe, out)
            return out

        config = self.tile_config("quantize", st.target, recipe)
        plan = kernels.Plan.make(recipe, config)
        r, k = x.shape
        kp = -(-k // 32) * 32
        nb = kp // 32
        mb = recipe.macro_block
        nm = -(-kp // mb) if mb else 1
        n_out = recipe.outliers_per_block
        # the kernel reads the input as words of two elements: x itself when K, the row
        # stride and the offset are even, else a zero-padded copy (odd shapes); float64
        # is rounded to fp32 first
        if x.dtype not in IN_KINDS:
            words, src = (lambda t: as_words(t.to(torch.float32))), torch.float32
        elif readable_as_words(x):
            words, src = None, x.dtype
        else:
            words, src = as_words, x.dtype
        stride_w = (x if words is None else words(x)).stride(0) // 2
        warp = st.target.warp_size if st.target is not None else 32
        constexprs = {**plan.constexprs, "IN_KIND": IN_KINDS[src], "EVEN": plan.even(r, k),
                      "FMA_DIV": fma_divides(interpreting()),
                      "VALUES": kernels.values_mode(plan, config, warp) if values else 0}
        if not constexprs["EVEN"]:  # the masked variant: the same tiles, maybe other launch options
            config = self.tile_config("quantize", st.target, recipe, masked=True)
        launch = Launch("quantize", kernels.quantize_kernel, plan.grid(r, k), constexprs, self.options(config), config)
        out = _QuantizePlan(launch, words, (r, kp // 2), (r, nb), (r, nm) if mb else None,
                            (r, nb, n_out) if n_out else None, (r, (k + 1) // 2, kp // 2, nm, stride_w, recipe.seed))
        if len(st.quantize_by_value) >= _MAX_PLANS:
            st.quantize_by_value.clear()
        st.quantize_by_value[by_value] = out
        st.quantize_plans[key] = (recipe, out)
        return out

    def dequantize(self, mx: MXTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """mx (R, K), axis 1 -> [R, Kp] in ``dtype``, written by the kernel (fp32, bf16,
        fp16; float64 exactly from fp32): one planned launch, decided once per (parts'
        kinds, R, Kp, output dtype, alignment)."""
        dev = mx.qdata.device
        st = self._devices.get(dev) or self._device(dev)
        q, s = mx.qdata.contiguous(), mx.scales.contiguous()
        m, ov, oi = mx.macro_scales, mx.outlier_values, mx.outlier_indices
        m = s if m is None else m.contiguous()
        if ov is None:
            ov = oi = s
        else:
            ov, oi = _module(".dequantize").outlier_words(ov, oi)
        aligned = q.data_ptr() % 16 == 0 and s.data_ptr() % 16 == 0 and m.data_ptr() % 16 == 0 \
            and ov.data_ptr() % 16 == 0 and oi.data_ptr() % 16 == 0
        r, kp = q.shape[0], mx.k_padded
        key = (dtype, r, kp, None if m is s else mx.recipe.macro_block, 0 if ov is s else ov.shape[-1], aligned)
        plan = st.dequantize_plans.get(key) or self._plan_dequantize(st, key, mx, dtype)
        launch, ints, written, words = plan
        out = torch.empty(r, kp, dtype=written, device=dev)
        self._launch(st, launch, (q, s, m, ov, oi, out.view(words), *ints))
        return out if written == dtype else out.to(dtype)

    def _plan_dequantize(self, st: _Device, key: tuple, mx: MXTensor, dtype: torch.dtype) -> tuple:
        """(launch, integer arguments, dtype written, its word dtype) of
        ``dequantize.dequantize``'s launch for ``mx`` to ``dtype``: ``dequantize.plan``
        (grid, constexprs) and ``dequantize.int_args``."""
        from . import dequantize as kernels

        if len(st.dequantize_plans) >= _MAX_PLANS:
            st.dequantize_plans.clear()
        written = dtype if dtype in kernels.OUT_WORDS else torch.float32  # float64: exact from fp32
        config = self.tile_config("dequantize", st.target, mx.recipe)
        n_out = 0 if mx.outlier_values is None else mx.outlier_values.shape[-1]
        grid, constexprs = kernels.plan(mx.qdata.shape[0], mx.k_padded, mx.macro_scales is not None, n_out, written,
                                        config)
        launch = Launch("dequantize", kernels.dequantize_kernel, grid, constexprs, self.options(config), config)
        out = st.dequantize_plans[key] = (launch, kernels.int_args(mx), written, kernels.OUT_WORDS[written][0])
        return out

    def decompose(self, x: torch.Tensor, recipe: QuantRecipe, definition: str, full: bool) -> Decomposition:
        from .decompose import decompose

        st = self._device(x.device)
        target = st.target
        config = self.tile_config("decompose-full" if full else "decompose", target, recipe)
        x = _rows_contiguous(materialized(x))
        with self._context(st):
            return decompose(x, recipe, definition, full, config, self.options(config),
                             warp_size=target.warp_size if target is not None else 32)

    def matmul(self, a: MXTensor | torch.Tensor, b: MXTensor, out_dtype: torch.dtype = torch.float32,
               quant: Optional[int] = None, *, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """a: MXTensor (M, K) axis 1 or bf16/fp16 [M, K]; b: MXTensor (N, K) axis 1 ->
        [M, N] in ``out_dtype``, stored by the kernel (fp32, bf16, fp16; not on the
        interpreter) or stored fp32 and cast. ``quant`` (a scale rule's id; the upcast
        route, 16-bit a readable as words): a quantized by the kernel, nearest rounding
        (:meth:`matmul_on_values`). ``bias`` (float [N]): added by the kernel's epilogue
        in fp32 (an fp64 bias is rounded to fp32 first)."""
        dev = b.qdata.device
        st = self._devices.get(dev) or self._device(dev)
        if st.cache_generation != config_cache.generation():  # the tuned configs changed
            st.gemm_plans.clear()
            st.cache_generation = config_cache.generation()
        w = _weight_operand(b)
        if isinstance(a, torch.Tensor):
            if a.is_neg():  # materialized(a), inlined on the hot path
                a = a.resolve_neg()
            strides = a.stride()  # (stride(0) costs twice as much)
            if strides[1] != 1:
                a = a.contiguous()
                strides = a.stride()
            m, stride_am = a.shape[0], strides[0]
            s = w.parts[1]
            a_parts = (a, s, s, s, s)
            # tokens the kernel quantizes: their offset's parity in the key too (the plan checks
            # once that they can be read as words)
            a_key = ((a.dtype, stride_am, a.data_ptr() % 16 == 0, quant) if quant is None
                     else (a.dtype, stride_am, a.data_ptr() % 16 == 0, quant, a.storage_offset() & 1))
        else:
            op = _Operand(a)
            m, stride_am = a.qdata.shape[0], a.k_padded // 2
            a_parts = op.parts
            a_key = (op.kind, op.key[4])
        if bias is None:
            key = (a_key, w.key, m, out_dtype)
        else:  # (its dtype and alignment specialise the launch)
            bias = _bias_operand(bias)
            key = (a_key, w.key, m, out_dtype, bias.dtype, bias.data_ptr() % 16 == 0)
        plan = st.gemm_plans.get(key)
        if plan is None:
            plan = self._plan_gemm(st, key, a, w, m, stride_am, out_dtype, bias is not None)
        c = torch.empty(m, w.key[3], dtype=plan.store, device=dev)
        b_parts = w.parts if plan.weight is None else w.storage(b, plan.weight[0], plan.weight[1])
        split = plan.split
        part, counts = (c, c) if split is None else split[0](dev, split[1], split[2])
        self._launch(st, plan.launch, (*a_parts, *b_parts, c, part, counts, c if bias is None else bias, *plan.ints))
        return c if plan.store is out_dtype else c.to(out_dtype)

    def grouped_matmul(self, a, w, num_experts, offsets, gather, bias, activation, out_dtype, schedule):
        """:meth:`Backend.grouped_matmul` with the grouped kernels (grouped_gemm.py), on
        the dense GEMM's route for the target; one launch, no host sync."""
        grouped_gemm = _module(".grouped_gemm")
        st = self._devices.get(w.device) or self._device(w.device)
        wop = _weight_operand(w)
        if bias is not None:
            bias = materialized(bias)
        if isinstance(a, torch.Tensor):
            a = materialized(a)
            if a.stride(-1) != 1:
                a = a.contiguous()
            s = wop.parts[1]
            xr, stride_am = a.shape[0], a.stride()[0]
            a_parts, a_key = (a, s, s, s, s), (a.dtype, stride_am, a.data_ptr() % 16 == 0)
        else:
            op = _Operand(a)
            a_parts, a_key = op.parts, (op.kind, op.key[4])
            xr, stride_am = a.qdata.shape[0], a.k_padded // 2
        return grouped_gemm.run(self, st, a, a_parts, a_key, xr, stride_am, w, wop, num_experts, offsets, gather,
                                bias, activation, out_dtype, schedule, STORE_DTYPES)

    def route(self, topk_ids, num_experts, tile_m):
        """:meth:`Backend.route` in one launch (routing.route_kernel) where it fits
        (routing.fits: decode sizes), else None (the torch form). On a target where the
        kernel carries its device assertion (routing.asserts_in_kernel) the flag comes
        back as None: the kernel itself stops the device on a bad id."""
        routing = _module(".routing")
        rows = topk_ids.numel()
        if not routing.fits(rows, num_experts):
            return None
        st = self._devices.get(topk_ids.device) or self._device(topk_ids.device)
        # a plan per shape, dtypes and alignment (the direct launch re-uses the JIT's
        # specialisation; the outputs' alignment follows from the shape)
        key = ("route", rows, topk_ids.shape[1], num_experts, tile_m, topk_ids.dtype, topk_ids.data_ptr() % 16 == 0)
        plan = st.grouped_plans.get(key)
        if plan is None:
            if len(st.grouped_plans) >= 4096:
                st.grouped_plans.clear()
            plan = st.grouped_plans[key] = routing.make_plan(rows, num_experts, tile_m,
                                                             routing.asserts_in_kernel(st.target))
        slots = _module("...moe.routing").max_tiles(rows, num_experts, tile_m)
        made = routing.route_tensors(topk_ids, num_experts, tile_m, slots, lambda _, args: self._launch(st, plan, args))
        return made[:-1] + (None,) if plan.options.get("debug") else made

    def combine(self, rows, index, weights, k, out_dtype):
        """:meth:`Backend.combine` with grouped_gemm.combine_kernel (one launch); fp64 rows
        take the torch form (the reference's)."""
        if rows.dtype == torch.float64:
            from .. import grouped_reference

            return grouped_reference.combine(rows, index, weights, k, out_dtype)
        st = self._devices.get(rows.device) or self._device(rows.device)
        weights = None if weights is None else materialized(weights)  # the router's (rows and index are ours)
        return _module(".grouped_gemm").run_combine(self, st, rows, index, weights, k, out_dtype, STORE_DTYPES)

    def ragged_rows(self, a, b, offsets):
        """:meth:`Backend.ragged_rows` with ragged.ragged_rows_kernel (one launch, no host
        sync); fp64 operands take the torch form."""
        ragged = _module(".ragged")
        if not ragged.takes(a, b):
            return super().ragged_rows(a, b, offsets)
        st = self._devices.get(a.device) or self._device(a.device)
        return ragged.run_rows(self, st, a, b, offsets, STORE_DTYPES)

    def ragged_k(self, a, b, offsets, out_dtype=None):
        """:meth:`Backend.ragged_k` with ragged.ragged_k_kernel (one launch, no host sync);
        fp64 operands, and bf16 ones with a bf16 result where torch's grouped_mm runs its
        own kernel for them (:data:`GROUPED_MM_BF16_TARGETS`), take the torch form (whose
        experts must hold multiples of 8 rows there: :meth:`Backend.ragged_k`)."""
        ragged = _module(".ragged")
        if not ragged.takes(a, b):
            return super().ragged_k(a, b, offsets, out_dtype)
        st = self._devices.get(a.device) or self._device(a.device)
        if (out_dtype is torch.bfloat16 and a.dtype is torch.bfloat16 and b is not None and b.dtype is torch.bfloat16
                and st.target is not None and st.target.name in GROUPED_MM_BF16_TARGETS):
            out = _module("...moe._ragged").grouped_k_product(a, b, offsets)
            if out is not None:  # (None: grouped_mm refused the operands' shapes or strides; an
                # expert's row count off a multiple of 8 is no refusal but a device assert)
                return out
        return ragged.run_k(self, st, a, b, offsets, out_dtype, STORE_DTYPES)

    def _plan_gemm(self, st: _Device, key: tuple, a, w: _Operand, m: int, stride_am: int,
                   out_dtype: torch.dtype, bias: bool = False) -> _GemmPlan:
        """The launch :meth:`run_gemm` makes (with a bias in the epilogue or not), decided
        once: the kernel of :meth:`gemm_route` (``gemm.gemm_kernel`` or
        ``gemm_upcast.upcast_gemm_kernel``, both taking ``(a, as, am, aov, aoi, b, bs, bm,
        bov, boi, [bsmax,] c, part, counts, bias, *ints, **constexprs)``, bsmax for the upcast
        kernel, and storing c's dtype), the config with ``split_k = 0`` resolved
        for this device, the weight's layouts, and the split-K buffers' sizes."""
        from . import gemm, gemm_upcast
        from .layouts import HOPPER, HOPPER_VALUES, PLAIN, PLAIN_VALUES

        oa = (gemm.Operand(a.dtype, None, 0, key[0][3]) if isinstance(a, torch.Tensor)
              else gemm.Operand(*_Operand(a).kind))
        ob = gemm.Operand(*w.kind)
        _, k, kp, n, _ = w.key
        if oa.quant is not None and (a.dtype not in _WORD_DTYPES or stride_am % 2 or key[0][4] or k % 2):
            raise ValueError(f"matmul(quant=...): 16-bit tokens readable as words (K, row stride and offset "
                             f"even); got {a.dtype} {tuple(a.shape)} stride {a.stride()}")
        config = self._gemm_config(st.device, st.target, oa, ob, m, n, kp)
        config = self.resolve_split_k(config, m, n, kp, self.sm_count(st.device, st.target))
        store = out_dtype if not st.cast_output and out_dtype in STORE_DTYPES else torch.float32
        config = self.launch_config(st.target, oa, config, store)
        route = self.gemm_route(st.target, oa, ob)
        if oa.quant is not None and route.kernel != "upcast":  # only the upcast kernel quantizes its tokens
            raise RuntimeError(f"{self.name}: tokens quantized in the GEMM need the upcast route; "
                               f"{st.target} runs {route.kernel} for {oa} x {ob}")
        nma = -(-kp // oa.macro_block) if oa.macro_block else 1
        nmb = -(-kp // ob.macro_block) if ob.macro_block else 1
        macros = (oa.macro_block or 32, ob.macro_block or 32)
        if route.kernel == "upcast":
            consts = gemm_upcast.constexprs(oa, ob, k, kp, config, route.upcast, interpreted=st.target is None, m=m,
                                            bias=bias)
            values, scales = (HOPPER_VALUES, HOPPER) if consts["VALUES"] == 1 else (PLAIN_VALUES, PLAIN)
            strides = ((values.row_stride(kp), scales.padded(1, kp // 32)[1] * 64) if values is HOPPER_VALUES
                       else (kp // 2, kp // 32))
            ints = (m, n, k, kp, stride_am, n, *strides, nma, nmb, *macros)
            fn, name = gemm_upcast.upcast_gemm_kernel, "gemm-upcast"
        else:
            consts = gemm.Plan.make(oa, ob, kp, config, route.scales, bias).constexprs
            values, scales = PLAIN_VALUES, route.scales
            ints = (m, n, k, kp, stride_am, n, nma, nmb, *macros)
            fn, name = gemm.gemm_kernel, "gemm"
        weight = None
        if fn is gemm_upcast.upcast_gemm_kernel:  # its weight parts end with bsmax
            fold = bool(consts["FOLD"])
            weight = (f"gemm-weight:{values.name}:{scales.name}" + (":largest" if fold else ":bsmax-unread"),
                      _weight_parts(values, scales, fold))
        elif values.layout_id or scales.layout_id:
            weight = (f"gemm-weight:{values.name}:{scales.name}", _weight_parts(values, scales))
        split = consts["SPLIT_K"]
        tiles = -(-m // config.block_m) * -(-n // config.block_n)
        launch = Launch(name, fn, (tiles * split,), dict(consts), self.options(config), config)
        out = _GemmPlan(launch, store, ints, weight, (_module(".splitk").buffers, tiles * split * config.block_m
                                                      * config.block_n, tiles) if split > 1 else None)
        if len(st.gemm_plans) >= _MAX_PLANS:
            st.gemm_plans.clear()
        st.gemm_plans[key] = out
        return out

    def device_identity(self, device: torch.device) -> tuple[str, str]:
        """(arch, device name) under which tuned configs of ``device`` are cached."""
        return self._identity(device, self.target(device))

    def _identity(self, device: torch.device, target: Optional[Target]) -> tuple[str, str]:
        raise NotImplementedError

    def gemm_config(self, device: torch.device, a, b, m: int, n: int, kp: int) -> GemmConfig:
        """The config of a GEMM of operands like ``a``, ``b`` (``gemm.Operand``) with M, N
        rows and padded K ``kp`` on ``device``: the tuned one from the config cache when
        there is one for its key, else the backend's heuristic default."""
        return self._gemm_config(device, self.target(device), a, b, m, n, kp)

    def _gemm_config(self, device: torch.device, target: Optional[Target], a, b, m: int, n: int,
                     kp: int) -> GemmConfig:
        arch, name = self._identity(device, target)
        tuned = config_cache.lookup(arch, name, config_cache.entry_key("matmul", a.tag(), b.tag(), m, n, kp))
        if tuned is not None:
            return GemmConfig(**{**tuned, "extra": tuple(tuple(kv) for kv in tuned.get("extra", ()))})
        return self.default_gemm_config(target, m, a.format, a.heavy or b.heavy, pair=a.pairs_with(b))

    def run_gemm(self, a: MXTensor | torch.Tensor, b: MXTensor, config: GemmConfig, target: Optional[Target],
                 out_dtype: torch.dtype = torch.float32, quant: Optional[int] = None) -> torch.Tensor:
        """[M, N] in ``out_dtype`` = a @ b^T with ``config`` on ``target`` (None: the
        interpreter): the launch :meth:`matmul` plans for its own config, without the plan
        (the tuner times configs with it). The kernel's store writes ``out_dtype``, except
        in the interpreter (its casts truncate): fp32 there, cast after. ``quant``: the
        kernel quantizes the 16-bit tokens a with this scale rule's id (the one-launch
        A4W4 of :meth:`matmul_on_values`; the upcast route only)."""
        from . import gemm, gemm_upcast
        from .gemm import Operand

        route = self.gemm_route(target, Operand.of(a), Operand.of(b))
        config = self.resolve_split_k(config, a.shape[0], b.shape[0], b.k_padded, self.sm_count(b.device, target))
        kernel_dtype = out_dtype if target is not None and out_dtype in STORE_DTYPES else torch.float32
        config = self.launch_config(target, Operand.of(a), config, kernel_dtype)  # (as the plan: the tuner times it)
        if quant is not None and route.kernel != "upcast":
            raise ValueError(f"{self.name}: tokens quantized in the GEMM need the upcast route; {target} runs "
                             f"{route.kernel}")
        with self.device_guard(b.qdata.device):
            if route.kernel == "upcast":
                c = gemm_upcast.matmul(a, b, config, self.options(config), route.upcast, kernel_dtype,
                                       interpreted=target is None, quant=quant)
            else:
                c = gemm.matmul(a, b, config, self.options(config), route.scales, kernel_dtype)
        return c if c.dtype == out_dtype else c.to(out_dtype)

    def gemm_launch_spec(self, target: Target, a, b, config: GemmConfig, m: int = SMALL_M, n: int = 8192,
                         kp: int = 8192, out_dtype: torch.dtype = torch.float32,
                         bias: Optional[torch.dtype] = None) -> KernelLaunch:
        """The launch :meth:`run_gemm` makes on ``target`` for operands like ``a``, ``b``
        (``gemm.Operand``) with ``config`` at M x N x ``kp`` (which resolves ``split_k = 0``
        with the target's nominal SM count), as data for the compile matrix and the tuner;
        with a bias of dtype ``bias`` in the epilogue (:meth:`matmul`) or none."""
        from . import gemm, gemm_upcast

        route = self.gemm_route(target, a, b)
        config = self.resolve_split_k(config, m, n, kp, self.gemm_sms.get(target.name, 132))
        config = self.launch_config(target, a, config, out_dtype)
        if route.kernel == "upcast":
            return gemm_upcast.launch_spec(a, b, config, self.options(config), route.upcast, kp=kp, out_dtype=out_dtype,
                                           m=m, bias=bias)
        return gemm.launch_spec(a, b, config, self.options(config), route.scales, kp=kp, out_dtype=out_dtype,
                                bias=bias)

    # ------------------------------------------------------------------- for AOT

    def launches(self, target: Target) -> list[KernelLaunch]:
        """Every (kernel, specialization, config) this backend launches on ``target``,
        for the compile matrix."""
        from . import decompose, dequantize, quantize

        out = []
        for recipe in _AOT_RECIPES:
            dtypes = _AOT_DTYPES if recipe == QuantRecipe() else _AOT_DTYPES[:1]
            config = self.tile_config("quantize", target, recipe)
            out += [quantize.launch_spec(d, recipe, config, self.options(config)) for d in dtypes]
        # the masked variant (ragged tiles) of the plainest and of the heaviest recipe
        for recipe in (QuantRecipe(), _AOT_RECIPES[-1]):
            config = self.tile_config("quantize", target, recipe, masked=True)
            out.append(quantize.launch_spec(torch.bfloat16, recipe, config, self.options(config), even=False))
        # quantized_values (the left operand of a decode-size A4W4 GEMM on upcast targets),
        # for bf16 and fp32 tokens, nearest and stochastic rounding
        for dtype, recipe in ((torch.bfloat16, QuantRecipe()), (torch.float32, QuantRecipe()),
                              (torch.bfloat16, QuantRecipe(rounding="stochastic", seed=1))):
            config = self.tile_config("quantize", target, recipe)
            out.append(quantize.launch_spec(dtype, recipe, config, self.options(config), values=True,
                                            warp_size=target.warp_size))
        for has_macro, n_out in ((False, 0), (True, 0), (False, 2), (True, 2)):
            recipe = QuantRecipe(macro_block=128 if has_macro else None, outliers_per_block=n_out)
            config = self.tile_config("dequantize", target, recipe)
            dtypes = (torch.bfloat16, torch.float32, torch.float16) if not (has_macro or n_out) else (
                torch.bfloat16, torch.float32)
            out += [dequantize.launch_spec(has_macro, n_out, d, config, self.options(config)) for d in dtypes]
        out.append(dequantize.launch_spec(True, 2, torch.bfloat16, config, self.options(config), even=False))
        for dtype, recipe, definition, full, even in (
                (torch.bfloat16, QuantRecipe(), "gain", False, True),
                (torch.bfloat16, QuantRecipe(), "gain", True, True),
                (torch.float32, QuantRecipe(), "gain", False, False),
                (torch.float32, _AOT_RECIPES[-1], "counterfactual", True, True),
                (torch.float32, QuantRecipe(macro_block=4096), "gain", True, True)):
            config = self.tile_config("decompose-full" if full else "decompose", target, recipe)
            out.append(decompose.launch_spec(dtype, recipe, definition, full, config, self.options(config), even,
                                             warp_size=target.warp_size))
        seen = set()
        for a, b, store in _aot_gemms():
            heavy = a.heavy or b.heavy
            # decode (M = 1), the edges of the small and mid classes and a large M: every
            # tile config, split and output dtype the defaults launch at N = K = 8192
            for m in (1, self.SMALL_M, self.SMALL_M + 1, self.MID_M, self.MID_M + 1, 4096):
                config = self.default_gemm_config(target, m, a.format, heavy, pair=a.pairs_with(b))
                launch = self.gemm_launch_spec(target, a, b, config, m=m, out_dtype=store)
                if launch.label not in seen:
                    seen.add(launch.label)
                    out.append(launch)
        from .gemm import Operand

        # MXLinear's bias in the epilogue: W4A16 and A4W4 at decode and prefill
        mx, bf16 = Operand(None, None, 0), Operand(torch.bfloat16, None, 0)
        for a, m in ((bf16, 1), (bf16, 4096), (mx, 4096)):
            config = self.default_gemm_config(target, m, a.format, False)
            out.append(self.gemm_launch_spec(target, a, mx, config, m=m, out_dtype=torch.bfloat16,
                                             bias=torch.bfloat16))
        if self._a4w4_upcasts(target):  # A4W4 at decode in one launch: the kernel quantizes the tokens
            for a, store, bias in ((Operand(torch.bfloat16, None, 0, 0), torch.bfloat16, None),
                                   (Operand(torch.float16, None, 0, 1), torch.float16, None),
                                   (Operand(torch.bfloat16, None, 0, 0), torch.bfloat16, torch.bfloat16)):
                for m in (1, self.SMALL_M):
                    config = self.default_gemm_config(target, m, a.format, False)
                    launch = self.gemm_launch_spec(target, a, mx, config, m=m, out_dtype=store, bias=bias)
                    if launch.label not in seen:
                        seen.add(launch.label)
                        out.append(launch)
        from .layouts import swizzle_launch_specs
        from .routing import launch_specs as route_launch_specs

        out += swizzle_launch_specs() + route_launch_specs(target)
        return out + self.grouped_launches(target)

    def grouped_launch_spec(self, target: Target, a, b, epi, rows: int, num_experts: int, n: int, kp: int,
                            out_dtype: torch.dtype) -> KernelLaunch:
        """The launch :meth:`grouped_matmul` makes on ``target`` for operands like ``a``,
        ``b`` (``gemm.Operand``), ``rows`` expert-sorted rows over ``num_experts`` experts
        of N = ``n``, K = Kp = ``kp`` and epilogue ``epi`` (grouped_gemm.Epilogue), as data
        for the compile matrix."""
        from ...moe.routing import max_tiles
        from . import grouped_gemm

        config = self.grouped_config(target, rows, num_experts, a.format, a.heavy or b.heavy, pair=a.pairs_with(b))
        slots = max_tiles(rows, num_experts, config.block_m)
        config = self.resolve_split_k(config, slots * config.block_m, n, kp, self.gemm_sms.get(target.name, 132))
        route = self.gemm_route(target, a, b)
        kind = "upcast" if route.kernel == "upcast" else "scaled"
        return grouped_gemm.launch_spec(kind, a, b, config, self.options(config), epi, layout=route.scales,
                                        route=route.upcast, n=n, kp=kp, out_dtype=out_dtype)

    def grouped_launches(self, target: Target) -> list[KernelLaunch]:
        """The grouped GEMM's launches for the compile matrix: gpt-oss's two projections
        (E = 32, top-4, N = 5760 / 2880, K = 2880: gather + bias + swiglu_oai, and the
        fp32 rows of the scattering one) at decode (T = 1) and prefill (T = 4096), W4A16
        and A4W4 (the native block-scaled MMA where the target has one), Qwen3-30B-A3B's
        first at prefill (E = 128, top-8, N = 1536, K = 2048, concatenated swiglu), MBS
        and OF on both kinds, fp16 tokens against OF weights (with and without MBS); the
        k-way combine (top-8); and the backward's ragged products (ragged.launch_specs)."""
        from . import grouped_gemm
        from .gemm import Operand

        mx, bf16, heavy = Operand(None, None, 0), Operand(torch.bfloat16, None, 0), Operand(None, 128, 1)
        first = grouped_gemm.Epilogue(True, torch.bfloat16, "swiglu_oai")
        second = grouped_gemm.Epilogue(False, torch.bfloat16, None)
        qwen = grouped_gemm.Epilogue(True, None, "swiglu")
        cases = []
        for tokens in (1, 4096):  # decode (split-K on the second projection) and prefill
            cases += [(bf16, mx, first, tokens * 4, 32, 5760, 2880, torch.bfloat16),
                      (bf16, mx, second, tokens * 4, 32, 2880, 2880, torch.float32),
                      (mx, mx, first, tokens * 4, 32, 5760, 2880, torch.bfloat16)]
        cases += [(bf16, mx, qwen, 4096 * 8, 128, 1536, 2048, torch.bfloat16),
                  (Operand(None, 128, 0), heavy, first, 512 * 4, 32, 5760, 2880, torch.bfloat16),
                  (bf16, heavy, second, 4, 32, 2880, 2880, torch.float32)]
        # fp16 tokens times the weight's outliers (numerics.bf16_pair; the "-pair" tiles)
        f16, first16 = Operand(torch.float16, None, 0), grouped_gemm.Epilogue(True, torch.float16, "swiglu_oai")
        for b in (Operand(None, None, 2), Operand(None, 128, 1)):
            cases += [(f16, b, first16, tokens * 4, 32, 5760, 2880, torch.float16) for tokens in (1, 4096)]
        out, seen = [], set()
        for a, b, epi, rows, experts, n, kp, store in cases:
            launch = self.grouped_launch_spec(target, a, b, epi, rows, experts, n, kp, store)
            if launch.label not in seen:
                seen.add(launch.label)
                out.append(launch)
        config = self.tiles.get("combine", TileConfig(16, 256, num_warps=4))
        for k, weights, store in ((8, torch.bfloat16, torch.bfloat16),):
            out.append(grouped_gemm.combine_launch_spec(k, weights, store, self.options(config), config.block_r,
                                                        config.block_k))
        return out + _module(".ragged").launch_specs(self.options)


def _bias_operand(bias: torch.Tensor) -> torch.Tensor:
    """A GEMM's bias [N] as the kernels read it: its values (a negative view resolved),
    fp32, bf16 or fp16 (an fp64 bias rounded to fp32, as the epilogue adds in fp32), unit
    stride."""
    bias = materialized(bias)
    if bias.dtype not in STORE_DTYPES:
        bias = bias.to(torch.float32)
    return bias if bias.stride(0) == 1 else bias.contiguous()


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """The kernels index rows by stride and need unit stride along K."""
    return x if x.stride(-1) == 1 else x.contiguous()


class CompiledTritonBackend(TritonBackend):
    """A Triton backend that compiles its kernels for the GPUs of its ``targets``."""

    def unavailable_reason(self, device: torch.device) -> Optional[str]:
        target, why = probe(device)
        if target is None:
            return why
        if target.name not in self.targets:
            return f"{target.name} ({target.vendor}) is not a {self.name} target ({', '.join(self.targets)})"
        return mode_problem(interpreted=False)

    def target(self, device: torch.device) -> Optional[Target]:
        return probe(device)[0]

    def path(self, device: torch.device, op: str) -> str:
        """"native" where the GEMMs run the target's block-scaled MMA, "emulated" where the
        upcast kernel decodes MXFP4 to 16-bit first (sm_90, gfx942: `info` called them native);
        the other ops are element-wise kernels: "native" everywhere."""
        if op in ("matmul", "grouped_matmul"):
            target = self.target(device)
            if target is not None and not target.native_mx:
                return "emulated"
        return "native"

    def _identity(self, device: torch.device, target: Optional[Target]) -> tuple[str, str]:
        return target.name, _device_name(torch.device(device))

    def sm_count(self, device: torch.device, target: Optional[Target]) -> int:
        device = torch.device(device)
        if device.type == "cuda" and torch.cuda.is_available():
            return _sm_count(device)
        return super().sm_count(device, target)  # a simulated device: the target's nominal count


@functools.lru_cache(maxsize=None)
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
