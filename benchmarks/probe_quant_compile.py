"""Do the quantized expert GEMM kernels compile for sm_90 with this Triton? Compiles
quant_gate_up_kernel and quant_down_kernel for the H200 (no GPU needed: Triton compiles for a
target) in each weight format and variant, with the GPU configs' tiles, and prints the MMA
instructions they use (wgmma: Hopper's warp-group MMA; mma.sync: the Ampere path)."""
import re
import sys

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moe_ops.kernels.quant_gemm import quant_down_kernel, quant_gate_up_kernel

PTR = {"bf16": "*bf16", "f16": "*fp16", "fp8": "*fp8e4nv", "u8": "*u8", "f32": "*fp32",
       "i32": "*i32"}


# As Triton's launcher specialises them for contiguous weights and 16-aligned sizes (H, I, E*):
# unit strides become constants, pointers and these ints carry divisibility 16 (without the
# hints the compiler cannot vectorise the loads nor pipeline them with cp.async).
UNIT = ("stride_xh", "stride_wk", "stride_sk", "stride_bn")
# (stride_as = I / bk is not a multiple of 16 in general: no hint)
DIV16 = ("H", "I", "stride_xt", "stride_we", "stride_wn", "stride_se", "stride_am", "stride_ym",
         "stride_be")


def _sig(kernel, types, consts):
    names = kernel.arg_names
    sig, cst, attrs = {}, {}, {}
    for i, n in enumerate(names):
        if n in consts or n in UNIT:
            sig[n] = "constexpr"
            cst[(i,)] = consts.get(n, 1)
        else:
            sig[n] = types.get(n, "i32")
            if sig[n].startswith("*") or n in DIV16:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, cst, attrs


def compile_one(kernel, types, consts, num_warps, num_stages):
    sig, cst, attrs = _sig(kernel, types, consts)
    k = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=cst, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=num_warps, num_stages=num_stages))
    ptx = k.asm["ptx"]
    return (f"{len(re.findall('wgmma.mma_async', ptx))} wgmma, "
            f"{len(re.findall('mma.sync', ptx))} mma.sync, {ptx.count('cp.async')} cp.async, "
            f"{k.metadata.shared} B shared")


def main():
    print(f"triton {triton.__version__}, target sm_90")
    failures = 0
    for fmt, quant_a, act_dtype in (("fp8", True, "bf16"), ("fp8", False, "bf16"),
                                    ("mxfp4", False, "bf16"), ("mxfp4_dot_scaled", False, "bf16"),
                                    ("fp8", True, "f32"), ("fp8", False, "f32"),
                                    ("mxfp4", False, "f32"), ("fp8", True, "f16"),
                                    ("mxfp4_dot_scaled", False, "f16")):
        w = "fp8" if fmt == "fp8" else "u8"
        s = "f32" if fmt == "fp8" else "u8"
        op = {"bf16": tl.bfloat16, "f16": tl.float16, "f32": tl.float32}[act_dtype]
        block_k = 128
        for block_m in (16, 64):
            common = dict(WFMT={"fp8": 1, "mxfp4": 2}.get(fmt, 3), QUANT_A=quant_a, EMULATE=False,
                          OP_DTYPE=op, DOT_PRECISION="ieee" if act_dtype == "f32" else "tf32",
                          BLOCK_M=block_m, BLOCK_K=block_k, GROUP_M=8, DIRECT=block_m == 16)
            variants = [dict(ACTIVATION=0, INTERLEAVED=False, HAS_BIAS=False,
                             WEIGHTS_ON_INPUT=False)]
            if fmt.startswith("mxfp4"):
                variants.append(dict(ACTIVATION=4, INTERLEAVED=True, HAS_BIAS=True,
                                     WEIGHTS_ON_INPUT=False))
            for var in variants:
                # W8A8: act is e4m3 with float32 scales per bk group, the gate+up tile bk wide
                act = PTR["fp8"] if quant_a else PTR[act_dtype]
                types = dict(x_ptr=PTR[act_dtype], w_ptr=PTR[w], s_ptr=PTR[s], bias_ptr=PTR["f32"],
                             tw_ptr=PTR["f32"], act_ptr=act, sorted_ptr=PTR["i32"],
                             block_expert_ptr=PTR["i32"], num_rows_ptr=PTR["i32"],
                             alpha="fp32", limit="fp32", act_scale_ptr=PTR["f32"],
                             ids_ptr=PTR["i32"])
                what = f"gate_up {fmt} {'W8A8' if quant_a else 'A16'} {act_dtype} BM={block_m} {var}"
                nw = 4 if block_m < 64 else 8
                try:
                    print(f"  {what}: {compile_one(quant_gate_up_kernel, types, {**common, **var, 'BLOCK_N': 128 if quant_a else 64}, nw, 3)}")
                except Exception as exc:  # noqa: BLE001 - the answer is the failure
                    failures += 1
                    print(f"  {what}: FAILS {type(exc).__name__}: {str(exc)[:2000]}")
            types = dict(act_ptr=PTR["fp8"] if quant_a else PTR[act_dtype], w_ptr=PTR[w],
                         s_ptr=PTR[s], bias_ptr=PTR["f32"], tw_ptr=PTR["f32"],
                         y_ptr=PTR[act_dtype], sorted_ptr=PTR["i32"],
                         block_expert_ptr=PTR["i32"], num_rows_ptr=PTR["i32"],
                         act_scale_ptr=PTR["f32"], ids_ptr=PTR["i32"])
            what = f"down {fmt} {'W8A8' if quant_a else 'A16'} {act_dtype} BM={block_m}"
            try:
                print(f"  {what}: {compile_one(quant_down_kernel, types, {**common, 'HAS_BIAS': fmt != 'fp8', 'HAS_WEIGHTS': True, 'BLOCK_N': 128}, 4 if block_m < 64 else 8, 3)}")
            except Exception as exc:  # noqa: BLE001
                failures += 1
                print(f"  {what}: FAILS {type(exc).__name__}: {str(exc)[:2000]}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
