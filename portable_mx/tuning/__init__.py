"""Autotuning of the GEMM's tile configs and of the macro-block recipe, and the
per-device config cache the GEMM launch reads (cache.py).

- space.py: the search space per target, operand kinds and M range, from one knob table
  over GemmConfig's fields (GemmConfig candidates);
- static.py: ahead-of-time compiles that prune candidates before anything is timed;
- cost.py: the static cost model that ranks the survivors (occupancy, waves, operand
  reuse, bytes in flight, split-K), and the device properties it needs;
- strategy.py: what a study measures next (the model's order refitted as it goes, or TPE);
- search.py: the Optuna study per (device, op, shape bucket, operand kinds), exhaustive
  runs and their recordings, and its result in the config cache;
- replay.py: a strategy replayed on a recorded exhaustive run, no GPU: trials to come
  within 2% of the best;
- warm.py: parallel JIT compiles of the configs about to be timed (GPU);
- macro.py: the two-objective macro-block / outliers study (error vs GEMM time).

``portable-mx tune`` (portable_mx/tune.py) is the command line.
"""
