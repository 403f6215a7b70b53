"""gpt-oss-20b on CUDA: bf16 moe_ops on the experts dequantized, MXFP4 plain and mma layout
(graph replay, one run), and the relative difference of the bf16 and mma outputs."""
import torch, sys
sys.path.insert(0, "benchmarks")
from sweep_quant import make_weights
from moe_ops.launch.quant import dispatch_quantized
from moe_ops.launch.dispatch import dispatch_triton
from moe_ops.mxfp4_layout import swizzle_mxfp4
from moe_ops.tools._timing import capture_graph
from moe_ops.tools.bench import Timer
from moe_ops.reference.quant import dequantize_mxfp4
dev = torch.device("cuda")
timer = Timer(dev, warmup_ms=10, rep_ms=15)
E, K, H, I = 32, 4, 2880, 2880
g = torch.Generator(device="cuda").manual_seed(0)
w13, w2, qkw = make_weights(E, H, I, "mxfp4", True, g)
m13, m2 = swizzle_mxfp4(w13), swizzle_mxfp4(w2)
d13 = torch.stack([dequantize_mxfp4(w13[e], qkw["w13_scale"][e], torch.bfloat16) for e in range(E)])
d2 = torch.stack([dequantize_mxfp4(w2[e], qkw["w2_scale"][e], torch.bfloat16) for e in range(E)])
fkw = {k: v for k, v in qkw.items() if k not in ("w13_scale", "w2_scale")}
for T in (1, 128, 2048, 8192):
    hidden = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    w, ids = torch.randn(T, E, device="cuda", generator=g).softmax(-1).topk(K, -1)
    tw, ids = (w / w.sum(-1, keepdim=True)).float(), ids.int()
    fb = lambda: dispatch_triton(hidden, d13, d2, tw, ids, **fkw)
    fm = lambda: dispatch_quantized(hidden, m13, m2, tw, ids, **qkw, mxfp4_layout="mma")
    fp = lambda: dispatch_quantized(hidden, w13, w2, tw, ids, **qkw)
    ob, om = fb().float(), fm().float()
    diff = float((ob - om).norm() / ob.norm())
    res = []
    for f in (fb, fp, fm):
        gr, _ = capture_graph(f)
        res.append(timer(gr.replay) * 1e3)
    print(f"T={T} bf16 {res[0]:.1f} us, mxfp4 plain {res[1]:.1f}, mma {res[2]:.1f}; "
          f"mma/bf16 speed {res[0] / res[2]:.2f}x, plain {res[0] / res[1]:.2f}x; rel diff {diff:.1e}", flush=True)
