"""A/B of the multi-program alignment (the T*K > one tile path) on one GPU: its variants
(moe_ops.launch.alignment: TRI_RANK, place's in-chunk ranks by a triangular compare instead of a
cumulative sum; COLUMNS_MIN_CHUNKS, from how many chunks per program the three-launch path
(count, column scan, place) replaces count + place), each checked to give the first variant's
table exactly, timed as CUDA-graph replays of the alignment alone and (--dispatch-cells) of the
whole forward (dispatch_triton, whose alignment launches with PDL), alternating rounds, best of
the rounds. Not part of the test suite.

    PYTHONPATH=. python benchmarks/ab_align.py [--cells qwen3_30b_a3b:8192 ...] [--rounds 3]
"""
from __future__ import annotations

import argparse

import torch

import moe_ops.launch.alignment as la
from moe_ops import bench
from moe_ops.launch.dispatch import dispatch_triton
from moe_ops.tuning.heuristics import heuristic_config

NEVER = 1 << 30
VARIANTS = {"2L cumsum": dict(TRI_RANK=False, COLUMNS_MIN_CHUNKS=NEVER),
            "2L tri": dict(TRI_RANK=True, COLUMNS_MIN_CHUNKS=NEVER),
            "3L cumsum": dict(TRI_RANK=False, COLUMNS_MIN_CHUNKS=1),
            "3L tri": dict(TRI_RANK=True, COLUMNS_MIN_CHUNKS=1),
            "default": {}}


def table(al):
    """The alignment's outputs that kernels read (rows past num_rows are never read)."""
    n = int(al.num_rows.item())
    return (al.sorted_slots[:n].clone(), al.block_expert.clone(), al.num_rows.clone(),
            al.expert_ends.clone(), al.valid_ends.clone())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cells", nargs="+", default=[
        "qwen3_30b_a3b:512", "qwen3_30b_a3b:2048", "qwen3_30b_a3b:8192", "qwen3_30b_a3b_zipf:8192",
        "olmoe:8192", "deepseek_v3_routed:8192", "mixtral_8x7b:8192", "qwen3_30b_a3b:32768"])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dispatch-cells", nargs="*", default=["qwen3_30b_a3b:8192", "olmoe:8192"],
                   help="cells where the whole forward is timed too")
    args = p.parse_args()
    dev = torch.device("cuda")
    dt = torch.bfloat16
    timer = bench.Timer(dev, warmup_ms=10, rep_ms=50)
    saved = {k: getattr(la, k) for k in ("TRI_RANK", "COLUMNS_MIN_CHUNKS")}
    rows = []
    for cell in args.cells:
        c = bench.cell_inputs(cell, dev, dt)
        s, T, wt, hidden, tw, ids = c.shape, c.T, c.weights, c.hidden, c.topk_weights, c.topk_ids
        cfg = heuristic_config(T, s.E, s.K, s.H, s.I, "cuda", dt)
        res = {v: [] for v in args.variants}
        ref = ref_out = None
        for _round in range(args.rounds):
            for v in args.variants:
                for k, val in {**saved, **VARIANTS[v]}.items():
                    setattr(la, k, val)
                got = table(la.align_triton(ids, s.E, cfg.block_m))
                ref = got if ref is None else ref
                for a, b in zip(got, ref):
                    assert torch.equal(a, b), (cell, v, "alignment differs from the first variant")
                ga, _ = bench.capture_graph(lambda: la.align_triton(ids, s.E, cfg.block_m))
                ua = timer(ga.replay) * 1e3
                ga = None
                ud = float("nan")
                if cell in args.dispatch_cells:
                    g, out = bench.capture_graph(
                        lambda: dispatch_triton(hidden, wt.w13, wt.w2, tw, ids, config=cfg))
                    ud = timer(g.replay) * 1e3
                    ref_out = out.clone() if ref_out is None else ref_out
                    assert torch.equal(out, ref_out), (cell, v, "output differs")
                    g = out = None
                res[v].append((ua, ud))
        for k, val in saved.items():
            setattr(la, k, val)
        for v, times in res.items():
            ua = min(t[0] for t in times)
            ud = min(t[1] for t in times)
            rows.append((cell, v, ua, ud))
            print(f"{cell} {v}: alignment {ua:.1f} us, dispatch {ud:.1f} us "
                  f"(rounds: {', '.join(f'{a:.1f}/{d:.1f}' for a, d in times)})", flush=True)
        torch.cuda.empty_cache()
    print(f"\n{'cell':<26} {'variant':<13} {'align us':>9} {'dispatch us':>12}")
    for cell, v, ua, ud in rows:
        print(f"{cell:<26} {v:<13} {ua:9.1f} {ud:12.1f}")


if __name__ == "__main__":
    main()
