"""rl_demo: GRPO on a verifiable arithmetic task with MXFP4 layers (portable_mx), adaptive
quantization noise, and the scale-bias / deadzone / grid-noise decomposition report.

Run from a checkout: ``python -m rl_demo --quick`` (the README's ``make demo``) or
``python -m rl_demo`` (the full run: every arm, 3 seeds). See ``python -m rl_demo -h``
and :mod:`rl_demo.report` for the output schema.
"""
