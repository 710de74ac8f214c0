"""portable_mx: MXFP4 quantize, decompose and matmul on any device.

Public API: :func:`quantize`, :func:`dequantize`, :func:`decompose`, :func:`matmul`,
:func:`grouped_matmul` and :func:`route` (:class:`Routing`; mixtures of experts),
:func:`backends`, :class:`QuantRecipe`, :class:`MXTensor`, :class:`Decomposition`, and the
training module :mod:`portable_mx.nn` (:class:`~portable_mx.nn.MXLinear`,
:func:`~portable_mx.nn.convert`) and :mod:`portable_mx.aqn` (adaptive quantization noise).
"""

from . import backends as _backends  # noqa: F401  (registers the shipped backends)
from . import aqn, nn
from .decompose import Decomposition
from .moe import Routing, grouped_matmul, route
from .ops import backends, decompose, dequantize, matmul, quantize  # (ops registers the portable_mx:: torch ops)
from .recipe import QuantRecipe
from .tensor import MXTensor

__version__ = "0.1.0"

__all__ = [
    "Decomposition",
    "MXTensor",
    "QuantRecipe",
    "Routing",
    "aqn",
    "backends",
    "decompose",
    "dequantize",
    "grouped_matmul",
    "matmul",
    "nn",
    "quantize",
    "route",
]
