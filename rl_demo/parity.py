"""Decomposition parity across backends: the same weights, activations and gradients of
the warm-up model, quantized and decomposed by every backend available on this machine.

Each backend runs in its own subprocess (``python -m rl_demo.parity --worker``) with
``PORTABLE_MX_BACKEND`` set to it, and, for ``triton-interpret``, ``TRITON_INTERPRET=1``
set before Python starts (the Triton kernels pick their mode when first imported). A
worker writes a report in the schema of ``portable_mx.parity`` (cases from
:func:`portable_mx.parity.run_case`: sha256 of every byte quantize writes; decomposition
totals, summary and dead/clip count hashes); the reports are compared with
:func:`portable_mx.parity.find_mismatches` (hashes and counts exactly, float statistics
within its tolerances), and we also count the statistics that are bit-identical.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch

from portable_mx import parity as pmx_parity
from portable_mx.recipe import QuantRecipe

ROOT = Path(__file__).resolve().parent.parent
CORPUS = "rl_demo"


def backend_devices(device: str) -> list[tuple[str, str]]:
    """(backend, device) pairs to try: reference and triton-interpret on the CPU, and,
    when ``device`` is a GPU, reference, cuda and rocm on it."""
    pairs = [("reference", "cpu"), ("triton-interpret", "cpu")]
    if device.startswith("cuda") and torch.cuda.is_available():
        pairs += [("reference", device), ("cuda", device), ("rocm", device)]
    return pairs


def _cases(inputs: dict[str, Any]) -> list:
    tensors = [pmx_parity.CorpusTensor(name, t.float().contiguous(), -1) for name, t in inputs["tensors"].items()]
    recipes = {k: QuantRecipe.model_validate(v) for k, v in inputs["recipes"].items()}
    cases = []
    for t in tensors:
        for rname, r in recipes.items():
            cases.append(pmx_parity.Case("quantize", t, "float32", rname, r))
            for d in ("gain", "counterfactual"):
                cases.append(pmx_parity.Case("decompose", t, "float32", rname, r, d))
    return cases


def _digest(inputs: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for name, t in inputs["tensors"].items():
        h.update(name.encode())
        h.update(t.float().contiguous().numpy().tobytes())
    h.update(json.dumps(inputs["recipes"], sort_keys=True).encode())
    return h.hexdigest()


def worker(inputs_path: str, device: str, out_path: str) -> None:
    """Run every case on ``device`` with the backend the environment selects."""
    from portable_mx import registry

    inputs = torch.load(inputs_path)
    dev = torch.device(device)
    report = {"schema": pmx_parity.SCHEMA, "corpus": CORPUS, "case_filter": None, "corpus_sha256": _digest(inputs),
              "device": {"name": device, "description": pmx_parity.describe_device(dev)}}
    forced = os.environ.get(registry.ENV_BACKEND, "").strip()
    reason = registry.get(forced).unavailable_reason(dev) if forced else None
    if reason is not None:
        report["unavailable"] = reason
    else:
        t0 = time.perf_counter()
        report["cases"] = {c.id: pmx_parity.run_case(c, dev) for c in _cases(inputs)}
        report["seconds"] = time.perf_counter() - t0
        report["backends"] = sorted({e.get("backend", "?") for e in report["cases"].values()})
    Path(out_path).write_text(json.dumps(report))


def _float_stats(entry: dict) -> dict[str, Any]:
    return {**{f"totals.{k}": v for k, v in (entry.get("totals") or {}).items()},
            **{f"summary.{k}": v for k, v in (entry.get("summary") or {}).items()}}


def run_parity(inputs: dict[str, Any], device: str = "cpu", progress=None, timeout: float = 900) -> dict[str, Any]:
    """Decompose ``inputs`` ({"tensors": {name: fp32 tensor}, "recipes": {name: recipe
    dict}}) on every backend of :func:`backend_devices`; compare each with the reference
    on the CPU. Returns {"tensors": ..., "recipes": ..., "results": [per backend]}."""
    pairs = backend_devices(device)
    results = []
    reports = {}
    bar = progress(total=len(pairs), desc="decomposition parity", leave=False) if progress else None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "inputs.pt")
        torch.save(inputs, path)
        for backend, dev in pairs:
            out = os.path.join(tmp, f"{backend}-{dev}.json".replace(":", "_"))
            env = dict(os.environ)
            env["PORTABLE_MX_BACKEND"] = backend
            env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
            if backend == "triton-interpret":
                env["TRITON_INTERPRET"] = "1"
            else:
                env.pop("TRITON_INTERPRET", None)
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "rl_demo.parity", "--worker", path, dev, out],
                                  env=env, capture_output=True, text=True, timeout=timeout)
            row: dict[str, Any] = {"backend": backend, "device": dev, "seconds": time.perf_counter() - t0}
            if proc.returncode != 0 or not os.path.exists(out):
                row["status"] = "error"
                row["detail"] = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            else:
                rep = json.loads(Path(out).read_text())
                if "unavailable" in rep:
                    row["status"] = "unavailable"
                    row["detail"] = rep["unavailable"]
                else:
                    row["status"] = "ran"
                    row["device_description"] = rep["device"]["description"]
                    reports[(backend, dev)] = rep
            results.append(row)
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    base = reports.get(("reference", "cpu"))
    for row in results:
        rep = reports.get((row["backend"], row["device"]))
        if rep is None or base is None:
            continue
        cases = rep["cases"]
        row["cases"] = len(cases)
        q = [c for c in cases if c.startswith("quantize/")]
        dcs = [c for c in cases if c.startswith("decompose")]
        row["quantize_cases"] = len(q)
        row["quantize_bytes_equal"] = sum(
            1 for c in q if "error" not in cases[c] and cases[c].get("outputs") == base["cases"].get(c, {}).get("outputs"))
        row["decompose_cases"] = len(dcs)
        row["counts_equal"] = sum(
            1 for c in dcs if "error" not in cases[c] and cases[c].get("counts") == base["cases"].get(c, {}).get("counts"))
        exact = total = 0
        worst = 0.0
        for c in dcs:
            sa, sb = _float_stats(base["cases"].get(c, {})), _float_stats(cases[c])
            for k in sa:
                total += 1
                va, vb = sa[k], sb.get(k)
                exact += va == vb
                if isinstance(va, float) and isinstance(vb, float):
                    worst = max(worst, abs(va - vb) / max(abs(va), abs(vb), 1e-30))
        row["statistics"] = total
        row["statistics_bit_identical"] = exact
        row["statistics_max_rel_diff"] = worst
        mism = pmx_parity.find_mismatches([base, rep], ["reference/cpu", f"{row['backend']}/{row['device']}"])
        row["mismatches"] = [str(m) for m in mism[:20]]
        row["mismatch_count"] = len(mism)
        row["equal"] = not mism and row["quantize_bytes_equal"] == len(q)
    return {
        "tensors": {k: list(v.shape) for k, v in inputs["tensors"].items()},
        "recipes": {k: QuantRecipe.model_validate(v).describe() for k, v in inputs["recipes"].items()},
        "tolerances": pmx_parity.TOLERANCES,
        "results": results,
    }


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description="rl_demo parity worker (internal)")
    parser.add_argument("--worker", nargs=3, metavar=("INPUTS", "DEVICE", "OUT"), required=True)
    args = parser.parse_args(argv)
    worker(*args.worker)


if __name__ == "__main__":
    main()
