"""Compile moe_ops' kernels for Hopper (sm_90) on any machine, GPU or not.

The launchers run on small CPU tensors with a given config, but every kernel launch is captured
instead of run (no kernel executes, nothing is read back); each captured launch is then compiled
with `triton.compile` for `GPUTarget("cuda", 90, 128)`, with the argument specialisation Triton's
JIT would apply on a GPU (pointers and integers divisible by 16 marked so, integers equal to 1
made constants) and the launch's own warps and stages. What it catches: code that the
interpreter runs but the compiler rejects (DispatchConfig.tma_pair did not compile for a whole
run because only the interpreter had run it), shared memory over the limit, and where the
tensor-core (wgmma) and async-copy instructions went. It does not prove a kernel correct or fast.

    python -m moe_ops.tools.compile_check [--shapes qwen3_30b_a3b ...] [--tokens 1 2048] [--dtype bfloat16]
        [--neighbours] [--dump DIR]

needs a Triton whose NVIDIA backend carries ptxas (the PyPI wheels do)."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import os
import re
import sys
from typing import Iterator

import torch

from moe_ops.launch._common import SMEM_LIMIT as SHARED_LIMIT   # bytes per program on sm_90

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
           torch.int32: "i32", torch.int64: "i64", torch.bool: "i1", torch.uint8: "u8",
           torch.float8_e4m3fn: "fp8e4nv"}


@dataclasses.dataclass
class Launch:
    kernel: object          # the @triton.jit function
    args: tuple
    kwargs: dict

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__


@dataclasses.dataclass
class Compiled:
    name: str
    key: str
    shared: int
    wgmma: int
    mma: int
    cp_async: int
    tma: int
    ptx: str
    warps: int = 0   # warps per program as compiled (a warp-specialised kernel adds its groups)
    ttgir: str = ""


@contextlib.contextmanager
def capture(extra_patches=()) -> Iterator[list]:
    """Inside the block, the launchers record their kernel launches (moe_ops' Hopper paths on:
    programmatic dependent launch, the fence of the folded combine) instead of running them.
    extra_patches: more (module, attribute, value) set for the block and restored after it.
    The records keep the launches' arguments alive, so under it autograd's AccumulateGrad
    copies gradients it would otherwise take over: do not time an autograd step inside it."""
    from moe_ops.launch import alignment, dispatch, dispatch_backward, quant

    launches: list = []

    def kernel_for(kernel, device, key=None):
        class _Grid:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    if "FENCE" in kwargs:   # the folded combine's fence, compiled code only
                        kwargs["FENCE"] = True
                    launches.append(Launch(kernel, args, kwargs))
                return launch
        return _Grid()

    def pdl_args(pdl, device):
        return dict(USE_PDL=True, launch_pdl=True) if pdl else {}

    patches = [(m, "kernel_for", kernel_for)
               for m in (alignment, dispatch, dispatch_backward, quant)]
    patches += [(m, "pdl_args", pdl_args) for m in (alignment, dispatch, quant)]
    patches += list(extra_patches)
    saved = [(m, name, getattr(m, name)) for m, name, _ in patches]
    try:
        for m, name, value in patches:
            setattr(m, name, value)
        yield launches
    finally:
        for m, name, value in saved:
            setattr(m, name, value)


def _signature(launch: Launch):
    """(signature, constexprs, attrs, options) of a captured launch, as Triton's JIT on a GPU
    would specialise it."""
    from triton.runtime.jit import JITFunction
    from triton.tools.tensor_descriptor import TensorDescriptor

    fn = launch.kernel
    if not isinstance(fn, JITFunction):
        raise RuntimeError(f"{launch.name} is {type(fn).__name__}, not a JITFunction: its module "
                           "was first imported with TRITON_INTERPRET=1 set, and Triton keeps it "
                           "interpreted for the whole process; import moe_ops.launch.* before "
                           "setting it")
    params = list(inspect.signature(fn.fn).parameters.values())
    names = [p.name for p in params]
    constexpr = {p.name for p in params if "constexpr" in str(p.annotation)}
    kwargs = dict(launch.kwargs)
    from moe_ops.launch._common import COMPILE_OPTIONS

    options = dict(COMPILE_OPTIONS, num_warps=kwargs.pop("num_warps", 4),
                   num_stages=kwargs.pop("num_stages", 3))
    for name in COMPILE_OPTIONS:
        options[name] = kwargs.pop(name, options[name])
    kwargs.pop("launch_pdl", None)
    bound = dict(zip(names, launch.args))
    bound.update(kwargs)
    sig, consts, attrs = {}, {}, {}
    for i, p in enumerate(params):
        v = bound[p.name] if p.name in bound else p.default
        if v is inspect.Parameter.empty:
            raise TypeError(f"{fn.fn.__name__}: no value for {p.name}")
        if p.name in constexpr or v is None or isinstance(v, str):
            sig[p.name] = "constexpr"
            consts[(i,)] = v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = "*" + _DTYPES[v.dtype]
            if v.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, TensorDescriptor):
            block = ",".join(str(b) for b in v.block_shape)
            sig[p.name] = f"tensordesc<{_DTYPES[v.base.dtype]}[{block}]>"
        elif isinstance(v, bool):
            sig[p.name] = "constexpr"
            consts[(i,)] = v
        elif isinstance(v, int):
            if v == 1:
                sig[p.name] = "constexpr"
                consts[(i,)] = 1
            else:
                sig[p.name] = "i32" if -2**31 <= v < 2**31 else "i64"
                if v % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[p.name] = "fp32"
        else:
            raise TypeError(f"{fn.fn.__name__}: cannot specialise {p.name}={type(v).__name__}")
    return sig, consts, attrs, options


def compile_launch(launch: Launch) -> Compiled:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, consts, attrs, options = _signature(launch)
    key = repr((launch.name, sorted(sig.items()), sorted(consts.items()), sorted(attrs),
                sorted(options.items())))
    src = ASTSource(fn=launch.kernel, signature=sig, constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 128), options=options)
    ptx = k.asm["ptx"]
    return Compiled(launch.name, key, k.metadata.shared, ptx.count("wgmma.mma_async"),
                    ptx.count("mma.sync"), ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
                    ptx.count("cp.async.bulk.tensor"), ptx, k.metadata.num_warps,
                    k.asm.get("ttgir", ""))


def ptxas_log(ptx: str) -> str | None:
    """What Triton's own ptxas prints (-v) assembling a kernel's PTX for sm_90a: registers,
    spills and warnings such as C7515 (wgmma serialized). None where that ptxas cannot run."""
    import subprocess
    import tempfile

    try:
        from triton.backends.nvidia.compiler import get_ptxas

        found = get_ptxas(90)
        path = getattr(found, "path", found)
        with tempfile.TemporaryDirectory() as d:
            src = os.path.join(d, "k.ptx")
            with open(src, "w") as f:
                f.write(ptx)
            r = subprocess.run([path, "-arch=sm_90a", "-v", src, "-o", os.path.join(d, "k.o")],
                               capture_output=True, text=True, timeout=300)
    except Exception:  # noqa: BLE001 - no NVIDIA backend or ptxas here
        return None
    return r.stdout + r.stderr


def _layouts(ttgir: str) -> dict:
    """The TTGIR's layout aliases: name -> its attribute text."""
    return dict(re.findall(r"^(#\w+) = (#ttg\.\w+<\{.*\}>)\s*$", ttgir, flags=re.M))


def _bases(attr: str, key: str) -> list:
    m = re.search(key + r" = (\[\[[-\d, \[\]]*\]\]|\[\])", attr)
    return [] if m is None else [list(map(int, b.split(","))) if b.strip() else []
                                 for b in re.findall(r"\[([-\d, ]*)\]", m.group(1)[1:-1])]


def word_operands(ttgir: str, marker: str = "0x81C081C0") -> list[bool]:
    """For each inline-asm op of the compiled kernel whose asm contains `marker` (the MXFP4
    mma-layout word decode, quant_gemm._MXFP4_MMA_WORD_ASM, packed 4 bytes per register):
    whether its uint8 operand's layout gives every thread whole 4-byte words of consecutive
    bytes along the last dimension, starting at multiples of 4 (what packing 4 elements per
    32-bit register must read as one word). A layout that split a word would decode other
    bytes' codes: tests/test_compile_sm90.py checks this for the installed Triton."""
    layouts = _layouts(ttgir)
    out = []
    for line in ttgir.splitlines():
        if "elementwise_inline_asm" not in line or marker not in line:
            continue
        m = re.search(r":\s*tensor<([\dx]+)xi8, (#\w+)>", line)
        if m is None:
            out.append(False)
            continue
        rank = len(m.group(1).split("x"))
        attr = layouts.get(m.group(2), "")
        if attr.startswith("#ttg.blocked"):
            order = re.search(r"order = \[([\d, ]*)\]", attr)
            spt = list(map(int, re.search(r"sizePerThread = \[([\d, ]*)\]",
                                          attr).group(1).split(",")))
            first = int(order.group(1).split(",")[0]) if order else -1
            out.append(spt[-1] % 4 == 0 and first == rank - 1)
        elif attr.startswith("#ttg.linear"):
            reg = _bases(attr, "register")
            others = reg[2:] + _bases(attr, "lane") + _bases(attr, "warp") + _bases(attr, "block")
            unit = [0] * (rank - 1)
            ok = len(reg) >= 2 and reg[0] == unit + [1] and reg[1] == unit + [2]
            out.append(ok and all(b[-1] % 4 == 0 for b in others if b))
        else:
            out.append(False)
    return out


def forward_launches(shape, T, cfg, dtype, backward=False, rows_per_expert=None,
                     activation="silu", ungated=False) -> list[Launch]:
    """The launches of one moe.dispatch forward (and its backward, saved-z mode) with `cfg`, for
    shape (H, I, E, K) scaled down to small H and I (the kernels' constants depend on the
    config and on K, E and the divisibility of the sizes, not on the sizes themselves).
    rows_per_expert: what the backward's config is chosen for (default: this call's T*K/E).
    ungated: ReLU-squared experts as transformers' integration passes them (w13 = w3 = up
    [E, I, H], activation "relu")."""
    from moe_ops.launch.dispatch import dispatch_triton
    from moe_ops.launch.dispatch_backward import dispatch_backward_triton
    from moe_ops.tuning.heuristics import backward_config

    H, I, E, K = shape
    full_I = I
    H, I = min(H, 512), min(I, 256)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(T, H, dtype=dtype, generator=g)
    w13 = torch.randn(E, 2 * I, H, dtype=dtype, generator=g)
    w2 = torch.randn(E, H, I, dtype=dtype, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, K, generator=g)
    kw = dict(activation=activation)
    if ungated:
        w13 = w13[:, :I]
        kw.update(activation="relu", w3=w13)
    with capture() as launches:
        _, z = dispatch_triton(hidden, w13, w2, w, ids, config=cfg, save_z=True, **kw)
        if backward:
            rpe = T * K / E if rows_per_expert is None else rows_per_expert
            bc = backward_config(cfg, "cuda", dtype, rows_per_expert=rpe, inter_size=full_I)
            dispatch_backward_triton(torch.randn(T, H, dtype=dtype, generator=g), hidden, w13,
                                     w2, w, ids, z=z, config=cfg, bwd_config=bc, **kw)
    return launches


def quant_launches(fmt, shape, T, quant_a=True, config=None, gpt_oss=False,
                   mxfp4_layout="plain") -> list[Launch]:
    """The launches of one quantized moe.dispatch forward (FP8 block-scaled with [128, 128]
    blocks, or MXFP4) as compiled for sm_90: CPU tensors standing for CUDA ones (the launcher's
    interpreter switch and the inline-PTX check answer as on an H100), shape (H, I, E, K)
    scaled down to H, I <= 512 with their remainders modulo 128 kept (what the kernels'
    K-tail and scale-block constants depend on; gpt-oss's 2880 -> 448). gpt_oss: its biases,
    activation and interleaved rows. config: the heuristic's for the full shape by default.
    mxfp4_layout "mma": the MXFP4 weights swizzled (moe_ops.mxfp4_layout)."""
    from moe_ops import _features
    from moe_ops.launch import quant
    from moe_ops.tools.quant_baselines import random_quantized

    H, I, E, K = shape
    full = (H, I)
    H, I = (min(n, 384 + n % 128 if n % 128 else 512) for n in (H, I))
    g = torch.Generator().manual_seed(0)
    w13, w2, s13, s2 = random_quantized(E, H, I, fmt, "cpu", g)
    hidden = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, K, generator=g)
    kw = dict(w13_scale=s13, w2_scale=s2)
    if fmt == "fp8":
        kw.update(block_shape=[128, 128], quantize_activations=quant_a)
    if gpt_oss:
        kw.update(activation="swiglu_oai", gate_up_interleaved=True,
                  w13_bias=torch.zeros(E, 2 * I).bfloat16(), w2_bias=torch.zeros(E, H).bfloat16())
    cfg = config or quant.quant_dispatch_config(T, E, K, *full, fmt, 128 if fmt == "fp8" else 32,
                                                "cuda", quant_a=fmt == "fp8" and quant_a)
    as_on_h100 = [(quant, "_interpreted", lambda device: False),
                  (_features, "inline_ptx", lambda device: True)]
    if mxfp4_layout == "mma":
        from moe_ops.mxfp4_layout import swizzle_mxfp4

        w13, w2 = swizzle_mxfp4(w13), swizzle_mxfp4(w2)
        kw["mxfp4_layout"] = "mma"
    with capture(as_on_h100) as launches:
        quant.dispatch_quantized(hidden, w13, w2, w, ids, **kw, config=cfg)
    return launches


def main(argv=None) -> int:
    from moe_ops.tools._cli import token_count
    from moe_ops.tuning.heuristics import heuristic_config, neighbours
    from moe_ops.tuning.shapes import SHAPES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--tokens", nargs="+", type=token_count, default=[1, 8, 512, 2048, 8192])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--neighbours", action="store_true", help="also every sweep neighbour")
    p.add_argument("--backward", action="store_true", help="also the backward's kernels")
    p.add_argument("--dump", help="write each compiled kernel's PTX into this folder")
    args = p.parse_args(argv)
    from moe_ops._runtime import interpret_enabled

    if interpret_enabled():   # the kernels would be interpreted functions, not compilable
        p.error("compile_check compiles the kernels for sm_90: unset TRITON_INTERPRET")
    if args.dump:
        try:
            os.makedirs(args.dump, exist_ok=True)
        except OSError as exc:
            p.error(f"--dump {args.dump}: {exc.strerror}")
    dtype = getattr(torch, args.dtype)
    seen, failed = set(), 0
    print(f"{'kernel':<32} {'config':<28} {'shared':>7} {'wgmma':>5} {'mma':>5} {'cp.async':>8} "
          f"{'tma':>4} {'warps':>5}")
    for name in args.shapes:
        H, I, E, K = SHAPES[name]
        for T in args.tokens:
            base = heuristic_config(T, E, K, H, I, "cuda", dtype)
            cfgs = neighbours(base, dtype) if args.neighbours else {"heuristic": base}
            for vname, cfg in cfgs.items():
                small_T = 1 if cfg.direct_rows else 16
                for launch in forward_launches((H, I, E, K), small_T, cfg, dtype, args.backward,
                                               rows_per_expert=T * K / E):
                    try:
                        c = compile_launch(launch)
                    except Exception as exc:   # report every failure, then exit 1
                        failed += 1
                        print(f"{launch.name:<32} {name}:{T} {vname}: FAILED "
                              f"{type(exc).__name__}: {str(exc)[-300:]}")
                        continue
                    if c.key in seen:
                        continue
                    seen.add(c.key)
                    over = " OVER LIMIT" if c.shared > SHARED_LIMIT else ""
                    print(f"{c.name:<32} {f'{name}:{T} {vname}'[:28]:<28} {c.shared:>7} "
                          f"{c.wgmma:>5} {c.mma:>5} {c.cp_async:>8} {c.tma:>4} {c.warps:>5}{over}",
                          flush=True)
                    failed += bool(over)
                    if args.dump:
                        os.makedirs(args.dump, exist_ok=True)
                        with open(os.path.join(args.dump, f"{c.name}_{len(seen)}.ptx"), "w") as f:
                            f.write(c.ptx)
    print(f"{len(seen)} distinct kernels compiled for sm_90, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
