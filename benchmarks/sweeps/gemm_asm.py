"""Static evidence for the sm_90 GEMM (no GPU needed): compile the launches the cuda
backend makes on sm_90 and read the assembly.

    python benchmarks/sweeps/gemm_asm.py [--json PATH] [CONFIG ...]

For each launch: registers, spilled bytes and local memory (ptxas -v, ld.local), shared
memory (and per pipeline stage), whether wgmma takes the weight from registers (the PTX
form ``wgmma.mma_async ... {d}, {a registers}, b_descriptor``), the width of the code
loads (``cp.async.cg.shared.global`` 16-byte copies, ``ld.shared.v4``), whether ptxas
serialized the wgmma chain (its C7515 note), and the SASS of the K loop (the folded
decode's, where the kernel carries both) per 8
weight values (all instructions; HMUL2; integer ops: LOP3, SHF, IMAD.SHL, PRMT, ISETP,
SEL). CONFIG (optional) is ``kind:M:bm,bn,bk,warps,stages,split`` (kind w4a16, a4w4 or
a4w4-tokens: bf16 tokens the kernel quantizes) for extra launches; by default the
backend's defaults at M = 1, 128 and 4096 (a4w4-tokens: M = 1).
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

_CLASSES = ("HMUL2", "HGMMA", "IMAD.SHL", "LOP3", "SHF", "PRMT", "ISETP", "SEL")  # the rest: "other"


def _sass_loops(sass: str) -> list[Counter]:
    """Opcode counts of the K loops: the backward-branch loops of 100 instructions or more
    (one, or two where the kernel carries the folded and the exact decode: the folded
    one, with fewer HMUL2, first)."""
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2).strip()))
    loops = []
    for addr, text in ins:
        m = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            loops.append((int(m.group(1), 16), addr))
    out = []
    for start, end in loops:
        body = [t for a, t in ins if start <= a <= end]
        if len(body) >= 100:
            out.append(Counter(re.match(r"(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*(?:\.[A-Z0-9_]+)*)", t).group(1)
                               for t in body))
    return sorted(out, key=lambda c: sum(v for op, v in c.items() if op.startswith("HMUL2"))) or [Counter()]


def facts(launch, target) -> dict:
    import triton
    from triton.compiler import ASTSource

    from portable_mx.aot import WGMMA_SERIALIZED, ptxas_log

    k = triton.compile(ASTSource(launch.fn, dict(launch.signature), constexprs=dict(launch.constexprs),
                                 attrs=launch.attrs()), target=target.gpu_target(), options=dict(launch.options))
    ptx, c = k.asm["ptx"], launch.constexprs
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(k.asm["cubin"])
        log = ptxas_log(k, tmp)
        sass = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "-sass", cubin], capture_output=True,
                              text=True).stdout
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores", log)
    wgmma = re.search(r"(wgmma\.mma_async\S*) \{[^}]*\}, (\{|%rd)", ptx)
    loops = _sass_loops(sass)
    loop = loops[0]
    threads = launch.options["num_warps"] * 32
    values = c["BLOCK_N"] * c["BLOCK_K"] // threads  # weight values a thread decodes per K step
    per8 = Counter()
    for op, v in loop.items():
        per8[next((c for c in _CLASSES if op.startswith(c)), "other")] += v
    per8 = {name: round(8 * v / values, 2) for name, v in per8.items()}
    exact = round(8 * sum(loops[-1].values()) / values, 1) if len(loops) > 1 else None
    return {
        "label": launch.label, "registers": int(regs.group(1)) if regs else None,
        "spill_bytes": int(spill.group(1)) if spill else None, "local_memory": "ld.local" in ptx or "st.local" in ptx,
        "shared_bytes": k.metadata.shared, "shared_per_stage": k.metadata.shared // max(1, launch.options["num_stages"]),
        "wgmma": wgmma.group(1) if wgmma else None, "wgmma_a_from_registers": bool(wgmma) and wgmma.group(2) == "{",
        "cp_async_16B": ptx.count("cp.async.cg.shared.global"), "ld_shared_v4": ptx.count("ld.shared.v4"),
        "narrow_global_loads": len(re.findall(r"ld\.global\.(?:b8|b16)\b", ptx)),
        "wgmma_serialized": WGMMA_SERIALIZED in log,
        "loop_instructions_per_8_values": round(8 * sum(loop.values()) / values, 1),
        "exact_decode_loop_instructions_per_8_values": exact,
        "loop_per_8_values": per8, "loop_top": dict(loop.most_common(12)),
        "values_per_thread_per_k_step": values,
    }


def main(argv=None) -> int:
    os.environ.pop("TRITON_INTERPRET", None)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None)
    p.add_argument("configs", nargs="*")
    args = p.parse_args(argv)
    import torch

    from portable_mx import registry
    from portable_mx.backends.targets import TARGETS
    from portable_mx.backends.triton.gemm import Operand
    from portable_mx.backends.triton.launch import GemmConfig

    target, cuda = TARGETS["sm_90"], registry.get("cuda")
    ops = {"w4a16": Operand(torch.bfloat16, None, 0), "a4w4": Operand(None, None, 0),
           "a4w4-tokens": Operand(torch.bfloat16, None, 0, 0)}  # bf16 tokens the kernel quantizes (decode)
    launches = []
    for kind, a in ops.items():
        for m in (1, 128, 4096) if a.quant is None else (1,):
            config = cuda.default_gemm_config(target, m, a.format, False)
            launches.append(cuda.gemm_launch_spec(target, a, Operand(None, None, 0), config, m=m,
                                                  out_dtype=torch.bfloat16))
    for spec in args.configs:
        kind, m, rest = spec.split(":")
        bm, bn, bk, w, s, sk = map(int, rest.split(","))
        config = GemmConfig(bm, bn, bk, num_warps=w, num_stages=s, split_k=sk)
        launches.append(cuda.gemm_launch_spec(target, ops[kind], Operand(None, None, 0), config, m=int(m),
                                              out_dtype=torch.bfloat16))
    import triton

    out = {"triton": triton.__version__, "target": "sm_90", "launches": [facts(l, target) for l in launches]}
    for f in out["launches"]:
        print(f"{f['label']}\n  regs {f['registers']} spill {f['spill_bytes']} local {f['local_memory']} "
              f"shared {f['shared_bytes']} ({f['shared_per_stage']}/stage)  {f['wgmma']} A from registers: "
              f"{f['wgmma_a_from_registers']}  serialized: {f['wgmma_serialized']}\n"
              f"  16B cp.async {f['cp_async_16B']}, ld.shared.v4 {f['ld_shared_v4']}, narrow global loads "
              f"{f['narrow_global_loads']}; K loop per 8 weight values: {f['loop_instructions_per_8_values']} "
              f"instructions {f['loop_per_8_values']}"
              + (f" (folded decode; the exact decode's loop: {f['exact_decode_loop_instructions_per_8_values']})"
                 if f["exact_decode_loop_instructions_per_8_values"] else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
