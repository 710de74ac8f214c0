"""Published MXFP4 checkpoints and other MXFP4 libraries, byte for byte.

- :mod:`.gpt_oss`: gpt-oss-layout safetensors (``*_blocks`` / ``*_scales``) read into
  MXTensors without dequantizing, tensor by tensor, and written back byte-identically;
  a checkpoint's experts put into a model as :class:`portable_mx.nn.MXExperts`.
- :mod:`.torchao`: portable_mx's MXTensor to and from torchao's, sharing storage.

Both need optional packages (safetensors; torchao), imported on first use:
``pip install "portable_mx[hf]"``. Importing this package imports neither.
"""

from . import gpt_oss, torchao

__all__ = ["gpt_oss", "torchao"]
