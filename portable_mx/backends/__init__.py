"""Backends. Importing this package registers every backend that ships with portable_mx
(importing it does not import Triton: the kernels load on first use)."""

from ..registry import register
from .cuda import CudaBackend
from .interpret import InterpretBackend
from .meta import MetaBackend
from .reference import ReferenceBackend
from .rocm import RocmBackend

for _backend in (ReferenceBackend(), InterpretBackend(), CudaBackend(), RocmBackend(), MetaBackend()):
    register(_backend, replace=True)

__all__ = ["CudaBackend", "InterpretBackend", "MetaBackend", "ReferenceBackend", "RocmBackend"]
