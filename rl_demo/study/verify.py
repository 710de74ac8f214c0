"""``python -m rl_demo.study.verify DIR [ARM/SEED ...]``: rerun some units of a finished
study and check that they reproduce its results.json bit for bit (same machine and
backend), without paying for a whole second run.

The study is rebuilt from its scale (``preregistered.scale``, with the stored seeds); the
settings that decide a unit's numbers must equal those stored in results.json, or nothing
is rerun. Each named unit (by
default the fp32 arm and plain MXFP4 at the first seed) is rerun in this process with the
study's thread count, and its curves and evaluations are compared with the stored ones by
exact float equality (JSON round-trips floats exactly).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from .design import for_device
from .runner import SHIPPED, shipped_checkpoint_name, unit_settings_changed
from .unit import PROBE, init_worker, run_unit


def _first_difference(a: Any, b: Any, path: str = "") -> Optional[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return f"{path}: keys {sorted(set(a) ^ set(b))} differ"
        for k in a:
            d = _first_difference(a[k], b[k], f"{path}.{k}")
            if d:
                return d
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{path}: lengths {len(a)} and {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            d = _first_difference(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    return None if a == b else f"{path}: {a!r} != {b!r}"


def verify(out: Path, units: list[str], checkpoint: Optional[Path] = None) -> list[tuple[str, Optional[str]]]:
    """[(unit, None if bit-identical else the first difference)] for ``units`` ("arm/seed")."""
    results = json.loads((out / "results.json").read_text())
    pre = results["preregistered"]
    cfg = for_device(pre["demo"]["device"], tiny=pre["scale"] == "tiny")
    cfg = replace(cfg, seeds=tuple(pre["seeds"]))  # --seeds may have chosen them
    changed = unit_settings_changed(json.loads(json.dumps(cfg.to_dict())), pre)
    if changed:
        raise ValueError(f"{out}/results.json was made with other settings than this checkout's {pre['scale']} "
                         f"scale (they differ in {changed}); verify with the checkout that made it")
    ck = checkpoint or (out / "warmup.pt" if (out / "warmup.pt").exists() else SHIPPED / shipped_checkpoint_name(cfg))
    init_worker(cfg.threads_per_unit, cfg.demo.device)
    report = []
    for u in units:
        arm, seed = u.split("/")
        new = json.loads(json.dumps(run_unit(cfg, arm, int(seed), ck)["result"]))
        if arm == PROBE:
            old = results["probe"]["seeds"][seed]
        else:
            old = {k: v for k, v in results["arms"][arm]["seeds"][seed].items() if k != "metrics"}
        report.append((u, _first_difference(new, old, u)))
    return report


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rl_demo.study.verify", description=__doc__.split("\n\n")[0])
    p.add_argument("dir", type=Path)
    p.add_argument("units", nargs="*", help="ARM/SEED, e.g. fp32/0 mbs_of_aqn/3 probe/1 (default fp32/0 mxfp4/0)")
    args = p.parse_args(argv)
    results = json.loads((args.dir / "results.json").read_text())
    s0 = results["preregistered"]["seeds"][0]
    units = args.units or [f"fp32/{s0}", f"mxfp4/{s0}"]
    bad = 0
    for u, diff in verify(args.dir, units):
        print(f"{u}: {'bit-identical' if diff is None else 'DIFFERS at ' + diff}")
        bad += diff is not None
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
