"""The backend registry: who serves which op on which device.

A backend declares a name, a priority, the ops it implements and, per device, whether it
can serve it (``unavailable_reason``). :func:`select` picks the highest-priority backend
that implements the op and serves the device. ``PORTABLE_MX_BACKEND=name`` forces that
backend for every op it implements and raises :class:`BackendUnavailableError` when it
cannot serve the device; ops it does not implement, or cannot run in this process
(``op_problem``: the interpreter's GEMM under a triton older than 3.8), fall back to
normal selection (``portable-mx info`` shows each route and why). The
meta device (shape propagation: tensors without data) is exempt from forcing: the meta
backend answers it whatever the variable says.

Backends work on a canonical 2-D view: rows of a tensor whose quantized axis is last
(an :class:`~portable_mx.tensor.MXTensor` of shape ``(R, K)`` and axis 1). The public
ops in :mod:`portable_mx.ops` validate the input, once; :mod:`portable_mx._dispatch`
makes the rows view and calls the selected backend.

Selection is memoised per (op, device, ``PORTABLE_MX_BACKEND``, ``TRITON_INTERPRET``): the first call decides,
later calls are one dict lookup. :func:`register` and :func:`unregister` forget the
memo; :func:`routes` (``portable-mx info``) always decides afresh.

One verb per layer: ``matmul`` is the public op (:mod:`portable_mx.ops`), ``mm`` /
``grad_mm`` the torch custom ops with the autograd rule (:mod:`portable_mx._custom_ops`),
``gemm`` the rows-level problem (:mod:`portable_mx._dispatch`, :meth:`Backend.matmul`),
``launch`` one kernel launch (``backends/triton/launch.py``).
"""

from __future__ import annotations

import numbers
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from ._forking import in_child

if TYPE_CHECKING:
    from .decompose import Decomposition
    from .recipe import QuantRecipe
    from .tensor import MXTensor

OPS = ("quantize", "dequantize", "decompose", "matmul", "grouped_matmul")
ENV_BACKEND = "PORTABLE_MX_BACKEND"


class BackendUnavailableError(RuntimeError):
    """No registered backend can serve the request (or the forced one cannot)."""


class Backend:
    """Base class of a backend. Subclasses set ``name``, ``priority``, ``ops`` and
    implement the ops they list, on the canonical 2-D view described in the module doc."""

    name: str = ""
    priority: int = 0
    ops: frozenset[str] = frozenset()

    def unavailable_reason(self, device: torch.device) -> Optional[str]:
        """None when this backend serves ``device``, else a one-line reason."""
        return None

    def op_problem(self, op: str) -> Optional[str]:
        """None when this backend can run ``op`` in this process at all, whatever the
        device, else why not (one line): an op it lists but cannot run here (say, an
        interpreter too old for one of its kernels) is passed over as if it were not
        listed, with this reason in ``routes()``."""
        return None

    def path(self, device: torch.device, op: str) -> str:
        """How the op runs on the device: "native", "emulated", "interpreted" or "reference"."""
        return "reference"

    def quantize(self, x: torch.Tensor, recipe: "QuantRecipe") -> "MXTensor":
        """x: float [R, K] (fp32, bf16, fp16) -> MXTensor of shape (R, K), axis 1."""
        raise NotImplementedError

    def dequantize(self, mx: "MXTensor", dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """MXTensor of shape (R, K), axis 1 -> [R, Kp] (padding included) in ``dtype``:
        the exact fp32 values rounded once to ``dtype`` (as ``Tensor.to(dtype)``)."""
        raise NotImplementedError

    def quantized_values(self, x: torch.Tensor, recipe: "QuantRecipe") -> torch.Tensor:
        """x: float [R, K] -> bf16 [R, Kp]: the values of ``quantize(x, recipe)`` (a recipe
        without macro blocks or outliers: every value is then a bf16 number, code * 2**e;
        NaN in NaN/Inf blocks, inf where the fp32 dequantization overflows). This default
        is the exact twin a backend's own one-pass form is held to."""
        return self.dequantize(self.quantize(x, recipe), torch.bfloat16)

    def token_values(self, a: torch.Tensor, recipe: "QuantRecipe") -> torch.Tensor:
        """:meth:`quantized_values` of float tokens a [M, K] cut to their K columns (bf16
        [M, K]): the left operand of the W4A16 GEMM that stands for A4W4."""
        values = self.quantized_values(a, recipe)
        k = a.shape[1]
        return values if values.shape[1] == k else values[:, :k]

    def matmul_on_values(self, a: torch.Tensor, recipe: "QuantRecipe", b: "MXTensor",
                         out_dtype: torch.dtype = torch.float32, *,
                         bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``matmul`` of float tokens a [M, K] quantized with ``recipe`` (one that
        :meth:`left_values` accepted) by b (plus ``bias``, as :meth:`matmul`): the W4A16
        GEMM on :meth:`token_values`. This default is the exact twin a backend's own form
        (one launch) is held to."""
        values = self.token_values(a, recipe)
        return self.matmul(values, b, out_dtype) if bias is None else self.matmul(values, b, out_dtype, bias=bias)

    def left_values(self, m: int, n: int, recipe: "QuantRecipe", device: torch.device) -> bool:
        """Whether ``matmul`` of an M-row float left operand quantized with ``recipe`` by an
        N-column weight runs better as the W4A16 GEMM on :meth:`quantized_values` (the same
        products, so the same result up to accumulation order) than as the A4W4 GEMM.
        False by default."""
        return False

    def decompose(
        self, x: torch.Tensor, recipe: "QuantRecipe", definition: str, full: bool
    ) -> "Decomposition":
        """x: float [R, K] -> Decomposition in rows layout ([R, Kp] / [R, Kp/32]); blocks
        holding NaN/Inf get NaN statistics."""
        raise NotImplementedError

    def matmul(
        self, a: "MXTensor | torch.Tensor", b: "MXTensor", out_dtype: torch.dtype = torch.float32, *,
        bias: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """a: MXTensor (M, K) axis 1, or a bf16/fp16 tensor [M, K] (W4A16); b: MXTensor
        (N, K) axis 1 (b transposed); M, N, K > 0 -> [M, N] in ``out_dtype`` (fp32, bf16,
        fp16 or fp64): the product of the dequantized operands accumulated in fp32 (up to
        accumulation order), plus ``bias`` (None, or a float [N] on b's device, converted
        to fp32) added in fp32, rounded once to ``out_dtype``. A backend writes
        ``out_dtype`` directly where it can, and adds the bias in its store: a separate
        cast or add is one more kernel and one more M x N round trip. The dispatch layer
        passes ``bias`` only when there is one."""
        raise NotImplementedError

    def grouped_matmul(
        self, a: "MXTensor | torch.Tensor", w: "MXTensor", num_experts: int, offsets: torch.Tensor,
        gather: Optional[torch.Tensor], bias: Optional[torch.Tensor], activation: Optional[str],
        out_dtype: torch.dtype, schedule: Callable[[int], torch.Tensor],
    ) -> torch.Tensor:
        """The grouped GEMM over ragged experts (op "grouped_matmul"; the public op is
        :func:`portable_mx.grouped_matmul`).

        a: MXTensor (X, K) axis 1, or a bf16/fp16 tensor [X, K] (W4A16); w: MXTensor
        (E*N, K) axis 1, the expert weights [E, N, K] in rows (expert e owns rows e*N ..
        e*N + N - 1); offsets: int32 [E], the cumulative ends of the R expert-sorted rows
        (``offsets[-1] == R``); gather: None (R = X, row i reads a's row i) or int32 [R]
        (row i reads a's row ``gather[i]``); bias: None or float [E, N]; activation: None
        or a name of :mod:`portable_mx.moe.activations` (then N' = N/2, else N' = N);
        schedule: ``schedule(tile_m)`` gives the tile schedule of the rows
        (:func:`portable_mx.moe.routing.tile_schedule`) without a host sync. R, K, N > 0.

        Returns [R, N'] in ``out_dtype``: row i of expert e is the activation of the
        product of the dequantized operands (a's row, W[e]^T) accumulated in fp32 (up to
        accumulation order) plus bias[e] in fp32, rounded once."""
        raise NotImplementedError

    def route(self, topk_ids: torch.Tensor, num_experts: int, tile_m: int) -> Optional[tuple]:
        """The routing metadata of :func:`portable_mx.route` (op "grouped_matmul") made in
        the backend's own way: (counts, offsets, gather_index, scatter_index,
        tile_schedule, ok) as moe.routing.Routing holds them, ok an int32
        [1] that is 1 when every id lies in [0, num_experts) (the caller asserts it on the
        device), or None where the backend's kernel itself stops the device on an id
        outside that range (a device assertion); equal to the torch form of
        moe/routing.py element for element. None (the default): the torch form runs.
        topk_ids int32/int64 [T, k], contiguous."""
        return None

    def combine(self, rows: torch.Tensor, index: torch.Tensor, weights: Optional[torch.Tensor], k: int,
                out_dtype: torch.dtype) -> torch.Tensor:
        """The deterministic k-way weighted sum of a scattering grouped GEMM (op
        "grouped_matmul"): rows fp32 [R, N], index int32 [T*k], weights float [T, k] or
        None (all 1) -> [T, N] in ``out_dtype``, ``out[t] = sum over j = 0, 1, ..., k-1
        in this order of fp32(weights[t, j]) * rows[index[t*k + j]]``, each product and
        sum an fp32 operation (no fused multiply-add), rounded once. Bit-exact across
        backends. fp64 rows (the high-precision dX of fp64 operands) are summed in fp64,
        each product and sum an fp64 operation."""
        raise NotImplementedError

    def ragged_rows(self, a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """The high-precision ragged-M product of the grouped GEMM's backward (op
        "grouped_matmul"; dX where nothing is quantized): a float [R, P] (expert-sorted
        rows), b float [E, P, Q], offsets int32 [E] (the rows' cumulative ends) -> fp32
        [R, Q] (fp64 where an operand is fp64), row i of expert e ``a[i] @ b[e]``, the
        products and sums in fp32 without TF32, up to accumulation order. R, P, Q > 0.
        Default: the torch form (moe/_ragged.py), which on a GPU reads the offsets on the
        host."""
        from .moe import _ragged

        return _ragged.rows_product(a, b, offsets)

    def ragged_k(self, a: torch.Tensor, b: Optional[torch.Tensor], offsets: torch.Tensor,
                 out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The high-precision ragged-K product of the grouped GEMM's backward (op
        "grouped_matmul"; dW where nothing is quantized, and the bias gradient): a float
        [R, P], b float [R, Q] (both expert-sorted rows) or None, offsets int32 [E] ->
        [E, P, Q], block e ``a_e^T @ b_e`` over the rows of expert e (zero for an empty
        one); without b, [E, P], the column sums of a_e. Products and sums in fp32
        without TF32 (fp64 where an operand is fp64), up to accumulation order, rounded
        once to ``out_dtype`` (None: left fp32). R, P, Q > 0. Default: the torch form
        (moe/_ragged.py), which on a GPU reads the offsets on the host (except bf16 with
        a bf16 result on sm_90 / sm_100). bf16 a and b with a bf16 result need every
        expert's row count a multiple of 8 on a CUDA GPU (torch's grouped_mm kernel, which
        takes them on sm_90 / sm_100, asserts on the device otherwise, and the process's
        CUDA context is lost): the grouped GEMM's backward pads its experts to 32 rows
        (moe/_ragged.py pad_experts) for it."""
        from .moe import _ragged

        if b is None:
            out = _ragged.column_sums(a, offsets)
        else:
            out = _ragged.k_product(a, b, offsets, out_dtype)
        return out if out_dtype is None else out.to(out_dtype)


_REGISTRY: dict[str, Backend] = {}


# select()'s memo: (op, device, PORTABLE_MX_BACKEND, TRITON_INTERPRET values) -> backend, valid while
# _REGISTRY is the dict it was made for (a test may swap the dict wholesale)
_memo: dict[tuple, Backend] = {}
_memo_owner: Optional[dict] = None


def _env_reader(name: str) -> Callable[[], Any]:
    """A reader of one environment variable for the memo key: CPython's ``os.environ``
    keeps its ``_data`` mapping in step with every set and unset, and reading it costs
    ~30 ns where ``os.environ.get`` costs ~400 ns (it encodes and decodes)."""
    try:
        data, key = os.environ._data, os.environ.encodekey(name)  # type: ignore[attr-defined]
    except AttributeError:  # not CPython's os.environ
        return lambda: os.environ.get(name)
    return lambda: data.get(key)


_forced_backend = _env_reader(ENV_BACKEND)
_interpret_setting = _env_reader("TRITON_INTERPRET")
"""Part of the memo key: whether the interpreter backend serves depends on it (a choice
made under one value served after the variable changed, and launched compiled kernels on
a CPU tensor: "0 active drivers")."""


def _env_text(raw: Any) -> str:
    """A value an :func:`_env_reader` returned, as ``os.environ.get`` gives it (stripped;
    "" where unset). Decisions are made from the value the memo key holds, not from a
    second read: a thread that set the variable in between had the decision for its value
    stored under the old value's key."""
    if raw is None:
        return ""
    if isinstance(raw, bytes):
        raw = os.environ.decodevalue(raw)  # type: ignore[attr-defined]
    return raw.strip()


_generation = 0
"""Counts the registry's changes: select() keeps a decision only when no register or
unregister came while it decided (a thread's decision could otherwise overwrite the memo
another thread's register had just cleared, and keep a backend passed over for good)."""
_lock = threading.Lock()


@in_child
def _renew_after_fork() -> None:
    global _lock
    _lock = threading.Lock()  # (one another thread held at the fork would stay held in the child)


def _forget() -> None:
    global _memo_owner, _generation
    with _lock:
        _memo.clear()
        _memo_owner = _REGISTRY
        _generation += 1


_REQUIRED = {"quantize": ("quantize",), "dequantize": ("dequantize",), "decompose": ("decompose",),
             "matmul": ("matmul",), "grouped_matmul": ("grouped_matmul", "combine")}
"""The methods a backend must implement (override) for each op it lists."""


def register(backend: Backend, *, replace: bool = False) -> Backend:
    """Add a backend. Raises TypeError for an object that is not a :class:`Backend` or
    that lists an op without implementing its methods (``grouped_matmul`` needs
    ``combine`` too: each failed at the first call, for every op), and ValueError on a
    duplicate name unless ``replace``, on a name that is not a non-empty string without
    surrounding spaces (``PORTABLE_MX_BACKEND`` is read stripped: such a name could never
    be forced) and on a priority that is not an int (it broke every later selection, for
    every op). Change a registered backend's ``priority`` or ``ops`` by registering it
    again with ``replace=True`` (the memoised choices are kept until then)."""
    if not isinstance(backend, Backend):
        raise TypeError(f"register expects a portable_mx.registry.Backend (a subclass's instance); got "
                        f"{type(backend).__name__}")
    name = backend.name
    if not isinstance(name, str) or not name or name != name.strip():
        raise ValueError(f"a backend needs a non-empty name without surrounding spaces; got {name!r}")
    if not isinstance(backend.priority, numbers.Integral) or isinstance(backend.priority, bool):
        raise ValueError(f"backend {name!r}: priority must be an int; got {backend.priority!r}")
    backend.priority = int(backend.priority)  # (a numpy integer sorted wrongly and broke `info --json`)
    unknown = set(backend.ops) - set(OPS)
    if unknown:
        raise ValueError(f"backend {backend.name!r} lists unknown ops {sorted(unknown)}; known: {OPS}")
    missing = [f"{op} ({method})" for op in sorted(backend.ops) for method in _REQUIRED[op]
               if getattr(type(backend), method) is getattr(Backend, method)]
    if missing:
        raise TypeError(f"backend {name!r} lists ops it does not implement: {', '.join(missing)}")
    if backend.name in _REGISTRY and not replace:
        raise ValueError(f"a backend named {backend.name!r} is already registered")
    _REGISTRY[backend.name] = backend
    _forget()
    return backend


def unregister(name: str) -> None:
    """Remove the backend named ``name`` (none: nothing happens, so that cleanup code may
    call it whether or not the registration went through)."""
    _REGISTRY.pop(name, None)
    _forget()


def _refusal(backend: Backend, op: str, device: torch.device) -> Optional[str]:
    """Why ``backend`` does not serve ``op`` on ``device`` (None: it does). A check that
    raises is a refusal naming the backend and the error (a third party's driver probe
    that raised stopped every op on the device, and ``portable-mx info``, even where a
    lower backend serves)."""
    return _asked(backend.op_problem, op) or _asked(backend.unavailable_reason, device)


def _asked(check: Callable[[Any], Optional[str]], arg: Any) -> Optional[str]:
    """``check(arg)``, or a refusal naming the error it raised."""
    try:
        return check(arg)
    except Exception as err:  # noqa: BLE001  (a third party's probe: see _refusal)
        return f"its {check.__name__} raised {type(err).__name__}: {err}"


def registered() -> list[Backend]:
    """Registered backends, highest priority first (ties by name)."""
    return sorted(_REGISTRY.values(), key=lambda b: (-b.priority, b.name))


def get(name: str) -> Backend:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise BackendUnavailableError(
            f"no backend named {name!r}; registered: {', '.join(b.name for b in registered())}"
        ) from None


def _check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; ops are {OPS}")


def select(op: str, device: torch.device | str) -> Backend:
    """The backend that serves ``op`` on ``device`` (see the module doc for the rules),
    memoised per (op, device, ``PORTABLE_MX_BACKEND``, ``TRITON_INTERPRET``); a failed
    selection is not memoised (it raises again)."""
    key = (op, device, _forced_backend(), _interpret_setting())
    if _memo_owner is _REGISTRY:
        backend = _memo.get(key)
        if backend is not None:
            return backend
    else:
        _forget()
    generation = _generation
    backend = _decide(op, torch.device(device), _env_text(key[2]))  # (the value of the key: one read)
    with _lock:
        if generation == _generation and _memo_owner is _REGISTRY:
            _memo[key] = backend
    return backend


def _decide(op: str, device: torch.device, forced: str) -> Backend:
    """:func:`select` without the memo: asks every candidate whether it serves ``device``."""
    _check_op(op)
    if forced and device.type != "meta":  # meta tensors hold no data: nothing to force
        try:
            backend = get(forced)
        except BackendUnavailableError as err:  # (the message named no variable: where did the name come from?)
            raise BackendUnavailableError(f"{ENV_BACKEND}={forced}: {err} (names are case-sensitive)") from None
        if op in backend.ops and _asked(backend.op_problem, op) is None:
            reason = _asked(backend.unavailable_reason, device)
            if reason is not None:
                raise BackendUnavailableError(
                    f"{ENV_BACKEND}={forced} cannot serve {op} on {device}: {reason}"
                )
            return backend
    reasons = []
    for backend in registered():
        if op not in backend.ops:
            continue
        reason = _refusal(backend, op, device)
        if reason is None:
            return backend
        reasons.append(f"{backend.name}: {reason}")
    raise BackendUnavailableError(f"no backend serves {op} on {device} ({'; '.join(reasons) or 'none registered'})")


@dataclass(frozen=True)
class Route:
    """One row of the (device, op) -> backend table."""

    device: str
    op: str
    backend: str
    path: str
    why: str


def routes(devices: list[torch.device]) -> list[Route]:
    """The (device, op) -> backend table, with the reasons higher-ranked backends lost."""
    forced = os.environ.get(ENV_BACKEND, "").strip()
    rows = []
    for device in devices:
        for op in OPS:
            try:
                chosen = _decide(op, device, forced)
            except BackendUnavailableError as err:
                rows.append(Route(str(device), op, "-", "-", str(err)))
                continue
            ranked = [b for b in registered() if op in b.ops]
            passed = ranked[: ranked.index(chosen)]
            if forced == chosen.name:
                why = f"forced by {ENV_BACKEND}"
            elif passed:
                why = "; ".join(f"{b.name}: {_refusal(b, op, device)}" for b in passed)
            else:
                why = "highest priority"
            rows.append(Route(str(device), op, chosen.name, chosen.path(device, op), why))
    return rows
