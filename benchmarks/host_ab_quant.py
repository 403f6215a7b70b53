"""Eager host time per quantized moe.dispatch call, fast launch off/on (A/B alternating in one
process), and the graph replay time; PYTHONPATH=. python benchmarks/host_ab_quant.py (GPU)."""
import os, sys, time, statistics, cProfile, pstats, io
import torch
sys.path.insert(0, "tests")
from test_quant_gpu import fp8_weights, mxfp4_weights, _route, SHAPES
torch.manual_seed(0)
os.environ["MOE_OPS_VERIFY_LAUNCH"] = "0"   # (conftest, imported above, turns it on)
rows = []
def cell(name, fmt, T, w):
    E, K, H, I = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(T)
    hidden = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    tw, ids = _route(T, E, K, g)
    if fmt == "fp8":
        q13, q2, s13, s2 = w; kw = dict(w13_scale=s13, w2_scale=s2)
    else:
        q13, q2, s13, s2 = w; kw = dict(w13_scale=s13, w2_scale=s2, activation="swiglu_oai", gate_up_interleaved=True)
    f = lambda: torch.ops.moe.dispatch(hidden, q13, q2, tw, ids, **kw)
    res = {}
    outs = {}
    for mode in ("0", "1"):
        os.environ["MOE_OPS_FAST_LAUNCH"] = mode
        for _ in range(5): outs[mode] = f()
    assert torch.equal(outs["0"], outs["1"])
    N = 200
    samples = {"0": ([], []), "1": ([], [])}
    for rep in range(5):
        for mode in ("0", "1"):
            os.environ["MOE_OPS_FAST_LAUNCH"] = mode
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(N): f()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            samples[mode][0].append((t1 - t0) / N * 1e6)
            samples[mode][1].append((t2 - t0) / N * 1e6)
    # GPU time: CUDA graph replay
    os.environ["MOE_OPS_FAST_LAUNCH"] = "1"
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        f()
    torch.cuda.current_stream().wait_stream(s)
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        f()
    import triton
    replay = triton.testing.do_bench(gr.replay, warmup=25, rep=100)*1e3
    r = dict(shape=name, fmt=fmt, T=T,
             host_off=statistics.median(samples["0"][0]), host_on=statistics.median(samples["1"][0]),
             eager_off=statistics.median(samples["0"][1]), eager_on=statistics.median(samples["1"][1]),
             replay=replay)
    rows.append(r)
    print(r, flush=True)
    if T == 1:
        pr = cProfile.Profile(); pr.enable()
        for _ in range(200): f()
        pr.disable(); torch.cuda.synchronize()
        st = io.StringIO(); pstats.Stats(pr, stream=st).sort_stats("tottime").print_stats(18)
        print(st.getvalue()[:6000])

g = torch.Generator(device="cuda").manual_seed(0)
E, K, H, I = SHAPES["qwen3_30b_a3b"]
w = fp8_weights(E, H, I, g)
for T in (1, 8, 128): cell("qwen3_30b_a3b", "fp8", T, w)
del w
E, K, H, I = SHAPES["gpt_oss_20b"]
w = mxfp4_weights(E, H, I, g)
for T in (1, 8, 128): cell("gpt_oss_20b", "mxfp4", T, w)
print("\n| shape | weights | T | host us off | host us on | eager us off | eager us on | on/off eager | replay us |")
print("|---|---|---|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r['shape']} | {r['fmt']} | {r['T']} | {r['host_off']:.0f} | {r['host_on']:.0f} | {r['eager_off']:.0f} | {r['eager_on']:.0f} | {r['eager_off']/r['eager_on']:.2f}x | {r['replay']:.1f} |")
import csv
with open(os.path.join(os.environ.get("OUT", "."), "host_ab.csv"), "w", newline="") as fh:
    wr = csv.DictWriter(fh, fieldnames=list(rows[0])); wr.writeheader(); wr.writerows(rows)
