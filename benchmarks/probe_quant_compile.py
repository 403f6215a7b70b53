"""Do the quantized expert GEMM kernels compile for sm_90 with this Triton, with which MMA, how
much shared memory and how many registers? No GPU needed: the launches of one quantized
moe.dispatch forward are captured from CPU tensors as the launcher specialises them for CUDA
(moe_ops.tools.compile_check.quant_launches: the heuristic's config for the full shape, or a
variant of it) and compiled for GPUTarget("cuda", 90); registers and spill bytes come from the
ptxas Triton uses for sm_90.

    PYTHONPATH=. python benchmarks/probe_quant_compile.py
    PYTHONPATH=. python benchmarks/probe_quant_compile.py --cells gpt_oss_20b:1,2048 \\
        --mxfp4 "" "block_k=256" --fp8 "" "w8a16=1"

A variant is a comma-separated list of QuantDispatchConfig field=value (ints; 0/1 for flags;
"" is the heuristic itself); w8a16=1 runs FP8 weights with quantize_activations=False.
Exit status 1 if a launch fails to compile."""
from __future__ import annotations

import argparse
import dataclasses
import re
import sys

import triton

from moe_ops.launch.quant import quant_dispatch_config
from moe_ops.tools import compile_check as cc

SHAPES = {  # (H, I, E, K), format, gpt-oss variant (biases, swiglu_oai, interleaved rows)
    "deepseek_v3": ((7168, 2048, 256, 8), "fp8", False),
    "qwen3_30b_a3b": ((2048, 768, 128, 8), "fp8", False),
    "gpt_oss_20b": ((2880, 2880, 32, 4), "mxfp4", True),
    "gpt_oss_120b": ((2880, 2880, 128, 4), "mxfp4", True),
}


def ptxas_report(ptx: str) -> tuple[str, str]:
    """(registers, spill store bytes) of a kernel's PTX for sm_90a from Triton's own ptxas
    ('?' where that ptxas cannot be run here)."""
    log = cc.ptxas_log(ptx) or ""
    regs = re.findall(r"Used (\d+) registers", log)
    spill = re.findall(r"(\d+) bytes spill stores", log)
    return (regs[0] if regs else "?"), (spill[0] if spill else "?")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", nargs="+", default=["deepseek_v3:1,2048,8192",
                                                   "qwen3_30b_a3b:1,512,8192",
                                                   "gpt_oss_20b:1,512,8192"])
    p.add_argument("--fp8", nargs="*", default=[""], help="FP8 variants (field=value,...)")
    p.add_argument("--mxfp4", nargs="*", default=[""], help="MXFP4 variants")
    opts = p.parse_args()
    print(f"triton {triton.__version__}, target sm_90")
    failures = 0
    for cell in opts.cells:
        name, tokens = cell.split(":")
        (H, I, E, K), fmt, gpt_oss = SHAPES[name]
        for T in (int(t) for t in tokens.split(",")):
            for spec in (opts.fp8 if fmt == "fp8" else opts.mxfp4):
                fields = dict((k.strip(), int(v)) for k, v in
                              (item.split("=") for item in filter(None, spec.split(","))))
                quant_a = not fields.pop("w8a16", 0)
                base = quant_dispatch_config(T, E, K, H, I, fmt, 128 if fmt == "fp8" else 32,
                                             "cuda", quant_a=fmt == "fp8" and quant_a)
                label = f"{name} T={T} {spec or 'heuristic'}"
                try:
                    cfg = dataclasses.replace(base, **{
                        k: bool(v) if isinstance(getattr(base, k), bool) else v
                        for k, v in fields.items()})
                    launches = cc.quant_launches(fmt, (H, I, E, K), T, quant_a=quant_a,
                                                 config=cfg, gpt_oss=gpt_oss)
                    for launch in launches:
                        if not launch.name.startswith("quant_"):
                            continue
                        c = cc.compile_launch(launch)
                        regs, spill = ptxas_report(c.ptx)
                        print(f"  {label} {launch.name}: {c.wgmma} wgmma, {c.mma} mma.sync, "
                              f"{c.cp_async} cp.async, {c.shared} B shared, {regs} registers, "
                              f"{spill} B spilled")
                except Exception as exc:  # noqa: BLE001 - the answer is the failure
                    failures += 1
                    print(f"  {label}: FAILS {type(exc).__name__}: {str(exc)[:2000]}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
