"""The demo's configuration: one dataclass, three presets (``quick``, ``full``, ``tiny``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Optional

import portable_mx as pmx

from .model import ModelConfig

ARM_NAMES = ("hp", "mxfp4", "mbs", "mbs_of", "mbs_of_aqn")
QUICK_ARMS = ("hp", "mxfp4", "mbs_of_aqn")


@dataclass(frozen=True)
class Arm:
    """One arm: the numerics of the trained model's GEMMs (None: high precision) and
    whether the rollout copy gets AQN noise."""

    name: str
    recipe: Optional[pmx.QuantRecipe]
    aqn: bool = False

    @property
    def label(self) -> str:
        return {"hp": "high precision", "mxfp4": "MXFP4", "mbs": "MXFP4+MBS", "mbs_of": "MXFP4+MBS+OF",
                "mbs_of_aqn": "MXFP4+MBS+OF+AQN"}.get(self.name, self.name)


@dataclass(frozen=True)
class DemoConfig:
    task: str = "add"
    model: ModelConfig = field(default_factory=ModelConfig)
    coupled_positions: bool = True
    arms: tuple[str, ...] = ARM_NAMES
    seeds: tuple[int, ...] = (0, 1, 2)
    # supervised warm-up (high precision), shared by every arm and seed
    warmup_seed: int = 1234
    warmup_batch: int = 128
    warmup_lr: float = 3e-3
    warmup_max_steps: int = 3000
    warmup_eval_every: int = 25
    warmup_target: float = 0.40
    # GRPO
    iterations: int = 60
    prompts_per_iter: int = 16
    group_size: int = 8
    minibatches: int = 2
    lr: float = 3e-4
    clip_eps: float = 0.2
    kl_coef: float = 0.02
    kl_cap: float = 10.0  # per-token k3 capped here (grpo.grpo_loss); inf: uncapped
    temperature: float = 1.0
    grad_clip: float = 1.0
    # numerics of the corrected arms
    scale_rule: str = "floor"
    macro_block: int = 64
    outliers_per_block: int = 1
    aqn_stages: int = 10
    aqn_sigma_start: float = 1e-2
    aqn_sigma_end: float = 1e-4
    # measurements
    eval_every: int = 10
    eval_prompts: int = 256
    probe_prompts: int = 16
    probe_group: int = 8
    probe_recipe: str = "mxfp4"
    parity_rows: int = 256
    device: str = "cpu"

    def __post_init__(self) -> None:
        # a group of one has no relative baseline: torch's std of one value is NaN, and
        # the advantages, the loss and every later weight became NaN
        for name in ("group_size", "probe_group"):
            if getattr(self, name) < 2:
                raise ValueError(f"{name} must be >= 2 (group-relative advantages need two samples); "
                                 f"got {getattr(self, name)}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0; got {self.temperature}")

    def arm(self, name: str) -> Arm:
        base = dict(scale_rule=self.scale_rule)
        mbs = dict(macro_block=self.macro_block)
        of = dict(outliers_per_block=self.outliers_per_block)
        recipes = {
            "hp": None,
            "mxfp4": pmx.QuantRecipe(**base),
            "mbs": pmx.QuantRecipe(**mbs),
            "mbs_of": pmx.QuantRecipe(**mbs, **of),
            "mbs_of_aqn": pmx.QuantRecipe(**mbs, **of),
        }
        if name not in recipes:
            raise ValueError(f"unknown arm {name!r}; arms are {ARM_NAMES}")
        return Arm(name, recipes[name], aqn=name.endswith("aqn"))

    def to_dict(self) -> dict:
        return asdict(self)


def preset(name: str) -> DemoConfig:
    """``full``: every arm, 3 seeds; ``quick``: 1 seed, 3 arms, fewer iterations;
    ``tiny``: a toy configuration for the smoke test (seconds)."""
    full = DemoConfig()
    if name == "full":
        return full
    if name == "quick":
        return replace(full, arms=QUICK_ARMS, seeds=(0,), iterations=30, eval_every=10)
    if name == "tiny":
        return replace(
            full, model=ModelConfig(d_model=32, n_layers=2, n_heads=2), arms=QUICK_ARMS, seeds=(0,),
            warmup_max_steps=10, warmup_eval_every=5, warmup_target=1.0, iterations=3, prompts_per_iter=4,
            group_size=4, eval_every=2, eval_prompts=16, probe_prompts=4, probe_group=4, parity_rows=32,
        )
    raise ValueError(f"unknown preset {name!r}")
