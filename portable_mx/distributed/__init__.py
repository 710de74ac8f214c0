"""portable_mx under PyTorch's distributed engines (FSDP2, DDP, distributed checkpoints).

- :mod:`.fsdp`: the opt-in MXFP4 all-gather of MXLinear weights under FSDP2
  (``pmx.nn.enable_fsdp_mx_all_gather``), its fallbacks and its byte counter
  (``pmx.nn.gathered_bytes``).

Nothing here is imported by ``import portable_mx`` or by a single-process forward: the
``pmx.nn`` names load this package (and ``torch.distributed``) on first use.
"""
