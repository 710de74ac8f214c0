"""The study's design, fixed before it runs: the one-factor arms, the pre-registered
settings of each scale (chosen on the high-precision arm alone, then frozen), and the
claims with the statistic and rule that decide each.

Arms. Every arm starts from the same warm-up checkpoint and differs from its *parent*
in one factor, so that ``arm - parent`` (paired over seeds) is that factor's effect:

====================  ===========================================  ==========
arm                   numerics of the block linears                parent
====================  ===========================================  ==========
fp32                  high precision                               -
mxfp4                 MXFP4, floor scales, forward and backward    fp32
rceil                 MXFP4, rceil scales                          mxfp4
mbs                   rceil + macro blocks of 64                   rceil
of                    floor + 1 outlier per 32 in bf16             mxfp4
aqn                   floor + AQN on the rollout copy              mxfp4
mbs_of                rceil + MBS-64 + OF-1                        mbs
mbs_of_aqn            rceil + MBS-64 + OF-1 + AQN                  mbs_of
fwd_only              floor, backward GEMMs in high precision      mxfp4
====================  ===========================================  ==========

MBS with the floor rule does not exist: numerics.md section 4 defines macro-block
scaling with rceil per-32 scales, and ``QuantRecipe`` rejects any other rule with a
macro block. So the MBS arm changes two things against plain MXFP4, and the study
separates them with the ``rceil`` arm: ``rceil - mxfp4`` is the scale rule alone and
``mbs - rceil`` is the macro blocks alone.

Scales. ``cpu`` fits the 60-minute budget on 2 cores; ``cuda`` is a larger model and more
prompts and seeds for one GPU (picked by :func:`for_device` from the device);
``tiny`` runs end to end in seconds (tests).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional

import portable_mx as pmx

from ..config import Arm, DemoConfig
from ..model import ModelConfig
from . import stats


@dataclass(frozen=True)
class StudyArm:
    name: str
    label: str
    recipe: Optional[dict[str, Any]]  # QuantRecipe fields; None: high precision
    aqn: bool
    parent: Optional[str]
    factor: str  # what the arm changes against its parent

    def arm(self) -> Arm:
        recipe = None if self.recipe is None else pmx.QuantRecipe(**self.recipe)
        return Arm(self.name, recipe, aqn=self.aqn)

    def to_dict(self) -> dict[str, Any]:
        recipe = self.arm().recipe
        return {**asdict(self), "recipe_tag": recipe.describe() if recipe is not None else "fp32"}


MB, OF = 64, 1
ARMS: dict[str, StudyArm] = {a.name: a for a in (
    StudyArm("fp32", "high precision (fp32)", None, False, None, "-"),
    StudyArm("mxfp4", "MXFP4 (floor)", {}, False, "fp32", "MXFP4 GEMMs, forward and backward"),
    StudyArm("rceil", "MXFP4 rceil", {"scale_rule": "rceil"}, False, "mxfp4", "scale rule floor -> rceil"),
    StudyArm("mbs", "MXFP4 rceil+MBS", {"macro_block": MB}, False, "rceil", f"macro blocks of {MB}"),
    StudyArm("of", "MXFP4+OF", {"outliers_per_block": OF}, False, "mxfp4", f"{OF} outlier per 32 in bf16"),
    StudyArm("aqn", "MXFP4+AQN", {}, True, "mxfp4", "AQN on the rollout copy"),
    StudyArm("mbs_of", "MXFP4 MBS+OF", {"macro_block": MB, "outliers_per_block": OF}, False, "mbs",
             "OF on top of MBS"),
    StudyArm("mbs_of_aqn", "MXFP4 MBS+OF+AQN", {"macro_block": MB, "outliers_per_block": OF}, True, "mbs_of",
             "AQN on top of MBS+OF"),
    StudyArm("fwd_only", "MXFP4 forward only", {"grad_input": "high", "grad_weight": "high"}, False, "mxfp4",
             "backward GEMMs in high precision"),
)}
ARM_ORDER = tuple(ARMS)


@dataclass(frozen=True)
class Claim:
    """One claim of the paper and how the study decides it.

    ``metric`` of ``arm`` minus ``baseline`` (paired over seeds), oriented by ``sign`` so
    that a positive difference is what the claim predicts. Rule ``"one-sided"``:
    supported when the interval lies above 0, refuted when it lies below ``margin``
    (what the claim predicts, if anything, is smaller than the smallest effect that
    matters), else inconclusive. Rule ``"two-sided"`` (a claim that something *moves*):
    supported when the interval excludes 0, refuted when it lies inside
    (-margin, margin). Rule ``"within"``: the relative difference ``metric`` / baseline
    mean must not fall below ``-margin``: supported when the interval's lower end is at or
    above ``-margin``, refuted when its upper end is below ``-margin``. A margin given as
    a string names a quantity the analysis computes (see :mod:`.analysis`)."""

    key: str
    text: str
    arm: str
    baseline: str
    metric: str
    sign: int
    rule: str
    margin: Any


CLAIMS = (
    Claim("mxfp4_loses_reward", "MXFP4 alone loses reward against high precision", "mxfp4", "fp32",
          "final_reward", -1, "one-sided", "reward_margin"),
    # the mechanism claims are decided at the checkpoint (same weights in every arm: the
    # numerics alone); the same metrics over training are reported beside them
    Claim("mbs_gradient", "MBS improves gradient accuracy (scale bias -> gradient)", "mbs", "rceil",
          "start_grad_cos", +1, "one-sided", 0.0),
    Claim("of_rollouts", "OF improves rollout quality (deadzone -> rollouts)", "of", "mxfp4",
          "start_accuracy", +1, "one-sided", 0.0),
    Claim("aqn_entropy", "Grid noise / AQN moves entropy", "aqn", "mxfp4",
          "entropy", +1, "two-sided", "entropy_margin"),
    Claim("all_within", "All corrections together bring final reward within 0.7% (relative) of high precision",
          "mbs_of_aqn", "fp32", "final_reward", +1, "within", 0.007),
)

# The component probe's claims: which error component moves which signal most.
PROBE_CLAIMS = (
    ("scale", "grad_err", "scale bias moves gradient accuracy the most"),
    ("dead", "acc_drop", "the deadzone moves rollout quality the most"),
    ("grid", "entropy_shift", "grid noise moves entropy the most"),
)


@dataclass(frozen=True)
class StudyConfig:
    """Everything that decides the study's numbers (all of it goes into results.json)."""

    scale: str
    demo: DemoConfig
    arms: tuple[str, ...] = ARM_ORDER
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    window: int = 10  # final reward: mean over the last `window` iterations; start: the first
    evaluations: int = 3  # at iterations 0, T/2, T (evenly spaced, the last at T)
    probe: bool = True  # the component probe, once per seed at the checkpoint
    threads_per_unit: int = 1  # torch threads in each unit's process (results depend on it)
    level: float = stats.LEVEL
    n_boot: int = stats.N_BOOT
    boot_seed: int = stats.BOOT_SEED
    reward_margin_fraction: float = 0.25  # of the fp32 arm's mean reward gain
    entropy_margin_fraction: float = 0.10  # of the fp32 arm's mean rollout entropy
    claims: tuple[Claim, ...] = CLAIMS
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        unknown = [a for a in self.arms if a not in ARMS]
        if unknown:
            raise ValueError(f"unknown study arms {unknown}; arms are {list(ARMS)}")
        if "fp32" not in self.arms:
            raise ValueError("the study needs the fp32 arm: every paired difference is taken against it")
        if len(set(self.seeds)) != len(self.seeds) or len(self.seeds) < 2:
            raise ValueError(f"the study needs at least 2 distinct seeds; got {list(self.seeds)}")
        if not 1 <= self.window <= self.demo.iterations // 2:
            raise ValueError(f"window must be in [1, iterations / 2]; got {self.window} for "
                             f"{self.demo.iterations} iterations")
        if self.evaluations < 2:
            raise ValueError("evaluations must be >= 2 (the checkpoint and the end)")
        if self.demo.iterations % (self.evaluations - 1):
            raise ValueError(f"iterations ({self.demo.iterations}) must be a multiple of evaluations - 1 "
                             f"({self.evaluations - 1})")

    @property
    def eval_every(self) -> int:
        return self.demo.iterations // (self.evaluations - 1)

    def unit_demo(self) -> DemoConfig:
        """The DemoConfig one unit runs with (its evaluation schedule set)."""
        return replace(self.demo, eval_every=self.eval_every, arms=self.arms, seeds=self.seeds)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["arms"] = {a: ARMS[a].to_dict() for a in self.arms}
        return d


def _cpu() -> StudyConfig:
    # Calibrated on the fp32 arm alone (rl_demo/results/study/README.md: the runs and their
    # numbers), then frozen: lr 1e-3 and 6e-4 collapse or stall, 5e-4 learns less than
    # 3e-4; no KL, 16 samples x 8 prompts and 4 minibatches learn no more; the fp32 gain
    # flattens after about 150 iterations.
    demo = DemoConfig(
        task="add", model=ModelConfig(d_model=64, n_layers=3, n_heads=4),
        warmup_target=0.70, iterations=150, prompts_per_iter=16, group_size=8, minibatches=2,
        lr=3e-4, kl_coef=0.02, eval_prompts=256, probe_prompts=16, probe_group=8,
    )
    # 8 seeds were pre-registered; their full run missed the interval criterion (widest
    # paired half-width 0.0292 > 0.0224), and the issue asks for more seeds where the
    # criterion needs them: 8 x (0.0292 / 0.0224)**2 = 13.6, so 16 (the faster reference
    # quantizer fits them in the hour).
    return StudyConfig(scale="cpu", demo=demo, seeds=tuple(range(16)), window=20, evaluations=3,
                       notes=("seeds raised from the pre-registered 8 to 16 after the 8-seed run missed the interval "
                              "criterion (widest half-width 0.0292 against a bound of 0.0224; its verdicts are in "
                              "rl_demo/results/study/README.md, and its units for seeds 0-7 equal the uncapped 16-seed "
                              "run's bit for bit); adding seeds after looking is a form of optional stopping, so read the intervals "
                              "as slightly optimistic",
                              "GRPO's per-token k3 KL term capped at 10 (DemoConfig.kl_cap) since 2026-11-26, after "
                              "the 16-seed run: uncapped, one token's term (up to 6.7e11) could outweigh the clipped "
                              "policy term in 1.2-4.2% of the quantized arms' iterations; the capped rerun missed the "
                              "interval criterion (rceil 0.0245 > 0.0214) and was not extended again; both runs' "
                              "verdicts are in rl_demo/results/study/README.md",
                              "the KL term's reference computes with the arm's numerics since 2026-11-27 (it computed "
                              "in fp32 for every arm, so k3 held the MXFP4-fp32 forward gap of the quantized arms "
                              "before any update), and an interval that excludes 0 but lies inside the margin is "
                              "'negligible' (both rules held there, and the code's order said 'supported'); both "
                              "changed after looking, and every run's verdicts are in rl_demo/results/study/README.md"))


def _cuda() -> StudyConfig:
    # Not calibrated on a GPU yet (no GPU was lent while this was written): the CPU
    # scale's GRPO settings on the demo's larger model (d=128, 4 layers; its warm-up is
    # trained on the device on first use), twice the prompts per iteration, more
    # iterations, more evaluation prompts. Its first run must check the criterion it prints.
    demo = DemoConfig(
        task="add", model=ModelConfig(d_model=128, n_layers=4, n_heads=4),
        warmup_target=0.70, iterations=200, prompts_per_iter=32, group_size=8, minibatches=2,
        lr=3e-4, kl_coef=0.02, eval_prompts=1024, probe_prompts=32, probe_group=8, device="cuda",
    )
    return StudyConfig(scale="cuda", demo=demo, seeds=tuple(range(8)), window=20, evaluations=5,
                       notes=("the cuda scale is not calibrated on a GPU yet; check the interval criterion it "
                              "prints",))


def _tiny() -> StudyConfig:
    demo = DemoConfig(
        task="add", model=ModelConfig(d_model=32, n_layers=1, n_heads=2),
        warmup_max_steps=10, warmup_eval_every=5, warmup_target=1.0, iterations=4, prompts_per_iter=4,
        group_size=4, eval_prompts=16, probe_prompts=4, probe_group=4,
    )
    return StudyConfig(scale="tiny", demo=demo, seeds=(0, 1), window=2, evaluations=2, n_boot=2000)


SCALES = {"cpu": _cpu, "cuda": _cuda, "tiny": _tiny}


def for_device(device: str, tiny: bool = False) -> StudyConfig:
    """The pre-registered study for ``device``: "cuda" or "cuda:N" -> the GPU scale (on
    that device), anything else ("cpu") -> the CPU scale; ``tiny`` -> the test scale."""
    if tiny:
        cfg = _tiny()
        return replace(cfg, demo=replace(cfg.demo, device=device))
    if device.startswith("cuda"):
        cfg = _cuda()
        return replace(cfg, demo=replace(cfg.demo, device=device))
    if device != "cpu":
        raise ValueError(f"the study runs on 'cpu' or 'cuda[:N]'; got device {device!r}")
    return _cpu()
