"""What the compiled element-wise kernels look like, without a GPU: for each launch the
cuda / rocm backend makes (or a chosen subset), compile for a target and report
registers, stack (local memory), the load/store widths and instruction counts of the SASS
(NVIDIA) or amdgcn (AMD), shuffles and shared-memory round trips (layout conversions),
float negations on the sign path, and the TTGIR layouts.

    python benchmarks/sweeps/elementwise_asm.py [--target sm_90] [--kernel quantize] [--dump DIR]

Instruction counts are static (straight-line code per program tile, or per loop trip),
divided by the elements one thread handles per tile: a design figure, not a profile.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
os.environ.pop("TRITON_INTERPRET", None)


def _sass(kernel) -> str:
    import triton

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        return subprocess.run([triton.knobs.nvidia.cuobjdump.path, "-sass", path], capture_output=True,
                              text=True, check=True).stdout


_SASS_LINE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def sass_stats(sass: str) -> dict:
    ops = Counter(m.group(1) for m in _SASS_LINE.finditer(sass))
    total = sum(n for op, n in ops.items() if not op.startswith("NOP"))
    pick = lambda prefix: {op: n for op, n in sorted(ops.items()) if op.startswith(prefix)}  # noqa: E731
    return {
        "instructions": total,
        "loads": pick("LDG"), "stores": pick("STG"), "local": {**pick("LDL"), **pick("STL")},
        "shared": {**pick("LDS"), **pick("STS")}, "shuffles": pick("SHFL"), "barriers": pick("BAR"),
        "fneg_like": {op: n for op, n in ops.items() if op in ("FADD.NEG",)},
        "top": ops.most_common(12),
    }


def amd_stats(asm: str) -> dict:
    body = asm.split("; Kernel info:")[0]
    ops = Counter(m.group(1) for m in re.finditer(r"^\s+([sv]_[a-z0-9_]+|global_[a-z0-9_]+|buffer_[a-z0-9_]+|ds_[a-z0-9_]+|scratch_[a-z0-9_]+)", body, re.M))
    pick = lambda prefix: {op: n for op, n in sorted(ops.items()) if op.startswith(prefix)}  # noqa: E731
    info = {k: int(v) for k, v in re.findall(r"^; (NumVgprs|ScratchSize|Occupancy|NumAgprs): (\d+)", asm, re.M)}
    return {"instructions": sum(ops.values()), "loads": {**pick("global_load"), **pick("buffer_load")},
            "stores": {**pick("global_store"), **pick("buffer_store")}, "lds": pick("ds_"),
            "scratch": pick("scratch_"), "dpp_or_permute": {op: n for op, n in ops.items() if "dpp" in op or "permute" in op or "swizzle" in op},
            **info}


def ttgir_layouts(ttgir: str) -> dict:
    layouts = re.findall(r"#(?:ttg|triton_gpu)\.blocked<\{([^}]*)\}>", ttgir)
    return {"blocked": sorted(set(layouts)), "convert_layout": ttgir.count("convert_layout"),
            "local_alloc": ttgir.count("local_alloc")}


def elements_per_thread(launch, warp_size: int) -> float:
    c = launch.constexprs
    tile = c.get("BLOCK_R", 1) * c.get("BLOCK_K", 1)
    return tile / (launch.options.get("num_warps", 4) * warp_size)


def report(launch, target) -> dict:
    import triton
    from triton.compiler import ASTSource

    from portable_mx.aot import _unwrap

    k = triton.compile(ASTSource(_unwrap(launch.fn), dict(launch.signature), constexprs=dict(launch.constexprs),
                                 attrs=launch.attrs()), target=target.gpu_target(), options=dict(launch.options))
    ept = elements_per_thread(launch, target.warp_size)
    out = {"kernel": launch.kernel, "label": launch.label, "target": target.name, "elements_per_thread": ept,
           "ttgir": ttgir_layouts(k.asm["ttgir"])}
    if target.triton_backend == "cuda":
        ptx = k.asm["ptx"]
        sass = _sass(k)
        s = sass_stats(sass)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            usage = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "--dump-resource-usage", f.name],
                                   capture_output=True, text=True).stdout
        m = re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)", usage)
        out.update({"registers": int(m.group(1)) if m else None, "stack": int(m.group(2)) if m else None,
                    "ptx_neg_f32": len(re.findall(r"\bneg\.f32\b", ptx)),
                    "ptx_ld_local": len(re.findall(r"\bld\.local", ptx)),
                    "ptx_vector_ld": Counter(re.findall(r"\bld\.global(?:\.\w+)*\.(v\d)\.(b\d+)", ptx)).most_common(),
                    "ptx_vector_st": Counter(re.findall(r"\bst\.global(?:\.\w+)*\.(v\d)\.(b\d+)", ptx)).most_common(),
                    "sass": s, "sass_per_element": round(s["instructions"] / ept, 2)})
        out["_asm"] = {"ttgir": k.asm["ttgir"], "ptx": ptx, "sass": sass}
    else:
        a = amd_stats(k.asm["amdgcn"])
        out.update({"amd": a, "amd_per_element": round(a["instructions"] / ept, 2)})
        out["_asm"] = {"ttgir": k.asm["ttgir"], "amdgcn": k.asm["amdgcn"]}
    return out


def _retiled(backend, target, launches, tiles):
    """The element-wise launches of ``launches`` again with each tile config of ``tiles``
    ("16x256w4": block_r x block_k, warps) in place of the backend's."""
    from portable_mx.backends.triton.launch import TileConfig

    for text in tiles:
        m = re.fullmatch(r"(\d+)x(\d+)w(\d+)", text.strip())
        if not m:
            raise SystemExit(f"bad tile {text!r}; want e.g. 16x256w4")
        config = TileConfig(int(m.group(1)), int(m.group(2)), num_warps=int(m.group(3)))
        backend.tile_config = lambda op, t, r, c=config: c  # instance attribute: this process only
        try:
            for launch in backend.launches(target):
                if launch.kernel != "gemm":
                    yield launch
        finally:
            del backend.tile_config


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="sm_90")
    p.add_argument("--kernel", default=None, help="quantize, dequantize or decompose (default all three)")
    p.add_argument("--match", default=None, help="substring of the launch label")
    p.add_argument("--dump", default=None, help="folder to write the TTGIR/PTX/SASS of each launch")
    p.add_argument("--json", default=None)
    p.add_argument("--tiles", default=None,
                   help="comma-separated tile configs to compile instead of the backend's, e.g. 16x256w4,8x512w8")
    args = p.parse_args(argv)

    from portable_mx import registry
    from portable_mx.backends.targets import TARGETS

    target = TARGETS[args.target]
    backend = registry.get("cuda" if target.vendor == "nvidia" else "rocm")
    launches = backend.launches(target)
    if args.tiles:
        launches = list(_retiled(backend, target, launches, args.tiles.split(",")))
    rows = []
    for launch in launches:
        if launch.kernel == "gemm" or (args.kernel and launch.kernel != args.kernel):
            continue
        if args.match and args.match not in launch.label:
            continue
        r = report(launch, target)
        asm = r.pop("_asm")
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            stem = re.sub(r"[^A-Za-z0-9]+", "_", f"{launch.kernel}_{launch.label}").strip("_")
            for ext, text in asm.items():
                with open(os.path.join(args.dump, f"{stem}.{ext}"), "w") as f:
                    f.write(text)
        rows.append(r)
        if target.triton_backend == "cuda":
            s = r["sass"]
            print(f"{r['kernel']:<10} {r['label']:<48} reg {r['registers']:>3} stack {r['stack']:>3} "
                  f"sass {s['instructions']:>5} ({r['sass_per_element']:>6}/elem) ld {s['loads']} st {s['stores']} "
                  f"shfl {sum(s['shuffles'].values())} lds/sts {sum(s['shared'].values())} neg.f32 {r['ptx_neg_f32']}")
        else:
            a = r["amd"]
            print(f"{r['kernel']:<10} {r['label']:<48} vgpr {a.get('NumVgprs')} scratch {a.get('ScratchSize')} "
                  f"occ {a.get('Occupancy')} instr {a['instructions']} ({r['amd_per_element']}/elem) "
                  f"ld {a['loads']} st {a['stores']} lds {sum(a['lds'].values())}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
