"""``python -m rl_demo --study``: the paper's claims settled with statistics.

One-factor arms (:mod:`.design`) trained by GRPO from one warm-up checkpoint with paired
seeds (seed s draws the same prompts, sampling uniforms and minibatch orders in every
arm, and measures on the same probe batch and evaluation prompts), run as parallel
processes (:mod:`.runner`, one (arm, seed) per :mod:`.unit`); per-arm statistics, paired
differences and the interval criterion (:mod:`.analysis`, with the intervals of
:mod:`.stats`); one verdict per claim of the paper (:mod:`.verdicts`); report.md and the
figures (:mod:`.report`). The settings are pre-registered in :mod:`.design`: calibrated
on the high-precision arm alone, then frozen, and written into results.json.
"""
