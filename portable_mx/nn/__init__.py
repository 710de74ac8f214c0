"""Modules for training and inference with MXFP4 GEMMs.

- :class:`MXLinear`: ``torch.nn.Linear`` whose GEMMs are MXFP4 (:mod:`.linear`).
- :class:`MXExperts`: the experts of a mixture-of-experts layer, MXFP4 weights, one grouped
  GEMM per projection (:mod:`.experts`).
- :func:`convert`: swap the ``nn.Linear`` layers of a model for MXLinear, and transformers'
  GptOss / Qwen3-MoE experts for MXExperts (:mod:`.convert`, :mod:`.hf_experts`).
- :func:`reseed`, :func:`layer_seed`: a stochastic-rounding stream per layer (:mod:`.streams`).
- :func:`weight_cache`: a block inside which MX layers reuse their quantized weights
  (:mod:`.weight_cache`: when that is safe, and what it asks of the caller).
- :func:`mx_matmul`, :func:`mx_parts`: :func:`portable_mx.matmul` under its older name, and
  an MXTensor's tensors in the order the custom ops take them.
- :func:`enable_fsdp_mx_all_gather`, :func:`gathered_bytes`: the MXFP4 all-gather of
  MXLinear weights under FSDP2 (:mod:`portable_mx.distributed.fsdp`, loaded with
  ``torch.distributed`` on first use, never on the single-process path).
"""

from .convert import convert
from .experts import MXExperts
from .linear import MXLinear, mx_matmul, mx_parts
from .streams import layer_seed, reseed
from .weight_cache import weight_cache

__all__ = ["MXAllGatherFallback", "MXExperts", "MXLinear", "convert", "enable_fsdp_mx_all_gather", "gathered_bytes",
           "layer_seed", "mx_matmul", "mx_parts", "reseed", "weight_cache"]

_DISTRIBUTED = ("enable_fsdp_mx_all_gather", "gathered_bytes", "MXAllGatherFallback")


def __getattr__(name: str):
    if name in _DISTRIBUTED:
        from ..distributed import fsdp

        return getattr(fsdp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
