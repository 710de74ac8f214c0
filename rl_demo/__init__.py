"""rl_demo: GRPO on a verifiable arithmetic task with MXFP4 layers (portable_mx), adaptive
quantization noise, and the scale-bias / deadzone / grid-noise decomposition report.

Run from a checkout: ``python -m rl_demo --quick`` (the README's ``make demo``),
``python -m rl_demo`` (the full run: every arm, 3 seeds) or ``python -m rl_demo --study``
(one-factor arms, paired seeds, intervals and a verdict per claim of the paper:
:mod:`rl_demo.study`). See ``python -m rl_demo -h``, :mod:`rl_demo.report` and
:mod:`rl_demo.study.runner` for the outputs.
"""
