"""Mixture of experts: the routing metadata (:func:`route`, :class:`Routing`) and the
grouped GEMM over ragged experts (:func:`grouped_matmul`), both exported at the top level
of portable_mx.

- :mod:`.routing`: :func:`route` and the tile schedule, built on the device (no host sync).
- :mod:`.ops`: the public :func:`grouped_matmul` (validation).
- :mod:`._custom_ops`: ``portable_mx::grouped_mm`` and its autograd rule.
- :mod:`._dispatch`: operands -> rows view -> the backend serving "grouped_matmul".
- :mod:`.activations`: the fused gated activations (swiglu_oai, swiglu), in fp32.
- :mod:`._ragged`: per-expert helpers of the backward.
"""

from .ops import grouped_matmul
from .routing import Routing, route

__all__ = ["Routing", "grouped_matmul", "route"]
