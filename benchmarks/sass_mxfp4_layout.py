"""sm_90 SASS of the MXFP4 launches (gpt-oss-20b shape, heuristic configs), plain layout
against the mma layout (moe_ops.mxfp4_layout): K-loop instruction mix per step, compiled on the
CPU with the installed Triton (no GPU). Usage: python benchmarks/sass_mxfp4_layout.py 1 8 2048"""
import collections, os, re, subprocess, sys, tempfile, dataclasses
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moe_ops import _features
from moe_ops.launch import quant
from moe_ops.tools.compile_check import capture, _signature
from moe_ops.tools.quant_baselines import random_quantized

from moe_ops.mxfp4_layout import swizzle_mxfp4
NVD = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/nvdisasm")

def sass(launch):
    sig, consts, attrs, options = _signature(launch)
    k = triton.compile(ASTSource(fn=launch.kernel, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 128), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    out = subprocess.run([NVD, "-c", "-hex", f.name], capture_output=True, text=True).stdout
    return out, k.metadata

def loop_mix(txt):
    lines = [l for l in txt.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/", l)]
    # the longest backward branch = the K loop: find BRA targets
    addr = lambda l: int(re.search(r"/\*([0-9a-f]{4,})\*/", l).group(1), 16)
    best = None
    for l in lines:
        m = re.search(r"BRA\s+(?:\S+\s+)?`?\(?\.L_x_(\d+)", l)
        m2 = re.search(r"BRA.*?0x([0-9a-f]+)", l)
    # fallback: labels
    lab = {}
    cur = None
    for l in txt.splitlines():
        m = re.match(r"\.L_x_(\d+):", l.strip())
        if m: cur = m.group(1)
        mm = re.search(r"/\*([0-9a-f]{4,})\*/", l)
        if mm and cur is not None and cur not in lab: lab[cur] = int(mm.group(1), 16)
    for l in lines:
        m = re.search(r"BRA\s.*\.L_x_(\d+)", l)
        if m and m.group(1) in lab and lab[m.group(1)] < addr(l):
            span = addr(l) - lab[m.group(1)]
            if best is None or span > best[0]: best = (span, lab[m.group(1)], addr(l))
    if best is None: return None
    body = [l for l in lines if best[1] <= addr(l) <= best[2]]
    ops = collections.Counter()
    for l in body:
        ins = re.sub(r"^.*?\*/\s*", "", l).strip().lstrip("{").strip()
        ins = re.sub(r"^@!?U?P\w+\s+", "", ins)
        op = ins.split()[0].rstrip(";") if ins else "?"
        ops[op.split(".")[0]] += 1
    return len(body), ops


def launches(T, mma, H=2880, I=2880, E=32, K=4):
    g = torch.Generator().manual_seed(0)
    w13, w2, s13, s2 = random_quantized(E, H, I, "mxfp4", "cpu", g)
    if mma:
        w13, w2 = swizzle_mxfp4(w13), swizzle_mxfp4(w2)
    hidden = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, K, generator=g)
    kw = dict(w13_scale=s13, w2_scale=s2, activation="swiglu_oai", gate_up_interleaved=True,
              w13_bias=torch.zeros(E, 2 * I).bfloat16(), w2_bias=torch.zeros(E, H).bfloat16())
    cfg = quant.quant_dispatch_config(T, E, K, H, I, "mxfp4", 32, "cuda")
    pat = [(quant, "_interpreted", lambda device: False), (_features, "inline_ptx", lambda device: True)]
    with capture(pat) as ls:
        quant.dispatch_quantized(hidden, w13, w2, w, ids, **kw, config=cfg,
                                 mxfp4_layout="mma" if mma else "plain")
    return ls

keys = ["BAR", "LDS", "LDSM", "STS", "LDG", "LDGSTS", "HMUL2", "LOP3", "IMAD", "SHF", "PRMT",
        "WARPGROUP", "HGMMA", "SYNCS", "MOV", "IADD3", "UMOV"]
Ts = [int(t) for t in sys.argv[1:]] or [1, 8, 2048]
for T in Ts:
    for mma in (False, True):
        for l in launches(T, mma, E=32):
            if "gate_up" not in l.name and "down" not in l.name:
                continue
            txt, md = sass(l)
            n, ops = loop_mix(txt)
            lds = collections.Counter(re.findall(r"\b((?:LDS|STS|LDSM|LDG|LDGSTS)(?:\.[A-Z0-9.]+)*)", txt))
            print(f"T={T} mma={int(mma)} {l.name[:20]:20s} regs={getattr(md, 'num_regs', '?')} "
                  f"spill={getattr(md, 'n_spills', '?')} loop={n}: "
                  + " ".join(f"{k}={ops.get(k, 0)}" for k in keys), flush=True)
            print("    mem ops (whole kernel):", dict(lds), flush=True)
