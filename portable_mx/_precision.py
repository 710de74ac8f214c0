"""Matmul precision control shared by the reference backend and the high-precision
backward GEMM: torch's fp32 matmuls in full fp32, never TF32 or bf16 internally, and
never narrowed by an autocast region of the caller."""

from __future__ import annotations

import contextlib
import threading

import torch

from ._forking import in_child

_LOCK = threading.Lock()
_depth = 0
_restore = None  # how to put back the caller's precision when the last context leaves


@in_child
def _renew_after_fork() -> None:
    """A child forked while other threads were inside: none of them will leave there, so
    the caller's precision comes back now (as their last leave would have put it) and
    the count starts again."""
    global _LOCK, _depth, _restore
    restore, _restore = _restore, None
    if _depth and restore is not None and _is_highest():
        restore()
    _depth = 0
    _LOCK = threading.Lock()


def _backends_with_precision() -> list:
    """The per-backend precision settings of torch's newer API (torch >= 2.9), if any."""
    found = []
    for name in ("cuda", "mkldnn"):
        matmul = getattr(getattr(torch.backends, name, None), "matmul", None)
        if matmul is not None and hasattr(matmul, "fp32_precision"):
            found.append(matmul)
    return found


def _set_highest():
    """Full-fp32 matmuls now; returns what puts the caller's setting back. Through the
    legacy API where torch can read it, else (the caller set only the per-backend API,
    whose mix with the legacy getter raises) through the per-backend settings."""
    try:
        prev = torch.get_float32_matmul_precision()
    except RuntimeError:
        backends = _backends_with_precision()
        saved = [(m, m.fp32_precision) for m in backends]
        for m in backends:
            m.fp32_precision = "ieee"
        return lambda: [setattr(m, "fp32_precision", v) for m, v in saved]
    torch.set_float32_matmul_precision("highest")
    return lambda: torch.set_float32_matmul_precision(prev)


def _is_highest() -> bool:
    """Whether fp32 matmuls run in full fp32 now (read through the API :func:`_set_highest`
    would use)."""
    try:
        return torch.get_float32_matmul_precision() == "highest"
    except RuntimeError:
        return all(m.fp32_precision == "ieee" for m in _backends_with_precision())


class HighestPrecision:
    """Context: fp32 matmuls in full fp32 (no TF32, no bf16) and no autocast while inside.

    The precision is a process-wide torch setting. A thread entering sets it to full fp32
    when it is not (remembering the setting it found); the last thread to leave puts back
    the setting last found, unless the setting was changed while inside (another thread of
    the caller's set its own precision: that one stays; it used to be overwritten by the
    value found first). A precision another thread sets while a portable_mx GEMM runs
    applies to that GEMM too: torch has no per-thread setting. Autocast is turned off for
    this thread only (an autocast region of the caller would otherwise run these matmuls
    in bf16)."""

    def __enter__(self) -> None:
        global _depth, _restore
        self._autocast = contextlib.ExitStack()
        for device_type in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device_type):
                self._autocast.enter_context(torch.autocast(device_type, enabled=False))
        with _LOCK:
            if not _is_highest():  # first in, or the caller changed it since: theirs is put back
                _restore = _set_highest()
            _depth += 1

    def __exit__(self, *exc) -> None:
        global _depth, _restore
        with _LOCK:
            _depth -= 1
            if _depth == 0:
                restore, _restore = _restore, None
                if restore is not None and _is_highest():  # (changed while inside: left as set)
                    restore()
        self._autocast.close()
