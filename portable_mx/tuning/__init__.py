"""Autotuning of the GEMM's tile configs and of the macro-block recipe, and the
per-device config cache the GEMM launch reads (cache.py).

- space.py: the search space per target and operand kinds (GemmConfig candidates);
- static.py: ahead-of-time compiles that prune candidates before anything is timed;
- search.py: the Optuna study per (device, op, shape bucket, operand kinds) and its
  result in the config cache;
- macro.py: the two-objective macro-block / outliers study (error vs GEMM time).

``portable-mx tune`` (portable_mx/tune.py) is the command line.
"""
