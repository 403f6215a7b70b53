"""Expert-parallel benchmark: per MoE layer and rank, the all-to-all (token shuffle) time, the
expert compute time, the combine time (results back + sum), the whole layer, tokens/s, and the
single-device moe_ops time of the same local work (tokens/s ratio).

GPUs (NCCL), one process per GPU:
    torchrun --nproc-per-node 8 benchmarks/bench_ep.py --shapes deepseek_v3 --tokens 1 128 2048 8192
CPU smoke (gloo, spawned processes, tiny shapes):
    python benchmarks/bench_ep.py --tiny --nprocs 2 --tokens 1 16

Shapes: qwen3_30b_a3b (H=2048, I=768, E=128, K=8), deepseek_v3 (routed experts: H=7168, I=2048,
E=256, K=8), tiny (H=64, I=32, E=8, K=2). Routing: uniform random top-K per token (distinct
experts), the same statistics on every rank.

Phases, timed separately with a barrier before each repetition (CUDA events on GPUs): "a2a" is the
exchange plan (on the default path including its one host read of the split sizes) and the
all-to-all of the rows and their routing; "compute" is moe.dispatch on the local experts of the
received rows; "combine" is the all-to-all back and the per-token sum ("pipelined": the default
form with --pipeline-chunks token ranges whose exchanges overlap compute; layer time only).
"layer" is the whole
expert_parallel_dispatch call, timed on its own (unpipelined, the layer is the phases' sum plus
launch gaps). "single" is moe_ops.dispatch on one device with T tokens and K
slots each over this rank's E_local experts (K capped at E_local): the same flops as the
average local work. With --cuda-graph, the sync-free layer is also captured in a CUDA graph at
decode sizes (T <= --graph-max-tokens) and its replay timed.

This script sets no NCCL or NVLS environment variable: the machine's settings stand."""
from __future__ import annotations

import argparse
import csv
import datetime
import os
import statistics
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)   # this checkout's moe_ops, without PYTHONPATH or an install

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

SHAPES = {
    "qwen3_30b_a3b": dict(H=2048, I=768, E=128, K=8),
    "deepseek_v3": dict(H=7168, I=2048, E=256, K=8),
    "tiny": dict(H=64, I=32, E=8, K=2),
}
FIELDS = ["shape", "mode", "W", "rank", "T", "E_local", "rows_in", "a2a_us", "compute_us",
          "combine_us", "layer_us", "graph_us", "single_us", "tok_per_s", "single_tok_per_s",
          "ratio"]


def _timer(device):
    """run(fn, iters, warmup) -> median us per call, every repetition after a barrier: CUDA events
    on a GPU, the host clock on the CPU."""
    cuda = device.type == "cuda"

    def once(fn):
        if cuda:
            torch.cuda.synchronize()
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b) * 1e3
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6

    def run(fn, iters, warmup):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            dist.barrier()
            times.append(once(fn))
        return statistics.median(times)
    return run


def _routing(T, E, K, device, gen):
    ids = torch.rand(T, E, generator=gen, device="cpu").topk(K, dim=1).indices
    w = torch.rand(T, K, generator=gen).softmax(-1)
    return w.to(device), ids.to(torch.int32).to(device)


def bench_case(shape, T, mode, args, device, dtype, timer):
    from moe_ops import dispatch
    from moe_ops.distributed import (
        ExpertParallelGroup,
        _combine,
        _dispatch_local,
        _exchange_plan,
        _shuffle,
        even_shard,
        expert_parallel_dispatch,
    )

    rank, W = dist.get_rank(), dist.get_world_size()
    H, I, E, K = (SHAPES[shape][k] for k in "HIEK")
    first, count = even_shard(E, W, rank)
    gen = torch.Generator().manual_seed(1234 + rank)
    w13 = (torch.randn(count, 2 * I, H, generator=gen) / H ** 0.5).to(device, dtype)
    w2 = (torch.randn(count, H, I, generator=gen) / I ** 0.5).to(device, dtype)
    x = torch.randn(T, H, generator=gen).to(device, dtype)
    w, ids = _routing(T, E, K, device, gen)
    epg = ExpertParallelGroup.setup(w13, w2, first_expert=first, num_experts=E)
    sync_free = mode == "sync_free"
    m = "replicated" if mode == "replicated" else "all_to_all"
    kw = dict(first_expert=first, num_experts=E, group=epg, mode=m, sync_free=sync_free)
    if mode == "pipelined":
        kw["pipeline_chunks"] = args.pipeline_chunks
    it, wu = args.iters, args.warmup
    row = dict(shape=shape, mode=mode, W=W, rank=rank, T=T, E_local=count)
    with torch.no_grad():
        row["layer_us"] = timer(lambda: expert_parallel_dispatch(x, w13, w2, w, ids, **kw), it, wu)
        if mode in ("all_to_all", "sync_free"):   # (the pipelined layer has no separate phases)
            owner_of, starts = epg.owner_table(device)
            idl = ids.long()
            owner = torch.where(idl >= 0, owner_of[idl.clamp(min=0)], -1)

            def a2a():
                plan = _exchange_plan(owner, epg, epg.group_name, sync_free, None)
                return plan, _shuffle(x, w, idl, owner, starts, plan, epg.group_name)

            plan, (rx, rw, rids) = a2a()
            row["rows_in"] = int((rids >= 0).any(1).sum())
            row["a2a_us"] = timer(a2a, it, wu)
            local = _dispatch_local(rx, w13, w2, rw, rids, {})
            row["compute_us"] = timer(lambda: _dispatch_local(rx, w13, w2, rw, rids, {}), it, wu)
            row["combine_us"] = timer(lambda: _combine(local, plan, epg.group_name, dtype), it, wu)
        # the same local work on one device: T tokens x K slots over the E_local local experts
        Kl = max(1, min(K, count))
        if count:
            lw, lids = _routing(T, count, Kl, device, gen)
            row["single_us"] = timer(lambda: dispatch(x, w13, w2, lw, lids), it, wu)
        if (args.cuda_graph and device.type == "cuda" and sync_free
                and T <= args.graph_max_tokens):
            row["graph_us"] = _graph_time(lambda: expert_parallel_dispatch(x, w13, w2, w, ids, **kw),
                                          it)
    row["tok_per_s"] = T / (row["layer_us"] * 1e-6) if row["layer_us"] else None
    if row.get("single_us"):
        row["single_tok_per_s"] = T / (row["single_us"] * 1e-6)
        row["ratio"] = row["single_us"] / row["layer_us"]
    return row


def _graph_time(fn, iters):
    from moe_ops.tools._timing import capture_graph

    g, _ = capture_graph(fn)
    times = []
    for _ in range(iters):
        dist.barrier()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def _fmt(v):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.3e}"
    return str(v)


def run(args):
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    timer = _timer(device)
    rows = []
    shapes = ["tiny"] if args.tiny else args.shapes
    for shape in shapes:
        for T in args.tokens:
            for mode in args.modes:
                try:
                    row = bench_case(shape, T, mode, args, device, dtype, timer)
                except torch.OutOfMemoryError as e:
                    row = dict(shape=shape, mode=mode, T=T, rank=dist.get_rank(),
                               W=dist.get_world_size(), layer_us=None, note=str(e)[:80])
                    torch.cuda.empty_cache()
                rows.append(row)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    if dist.get_rank() == 0:
        allrows = sorted((r for rs in gathered for r in rs),
                         key=lambda r: (r["shape"], r["mode"], r["T"], r["rank"]))
        print(f"# bench_ep: {dist.get_world_size()} ranks, backend {dist.get_backend()}, "
              f"{device.type} {torch.cuda.get_device_name() if cuda else ''}, dtype {dtype}, "
              f"torch {torch.__version__}; times: median of {args.iters} (us)")
        print(" | ".join(FIELDS))
        for r in allrows:
            print(" | ".join(_fmt(r.get(f)) for f in FIELDS))
        if args.csv:
            with open(args.csv, "w", newline="") as f:
                wr = csv.DictWriter(f, fieldnames=FIELDS + ["note"], extrasaction="ignore")
                wr.writeheader()
                wr.writerows(allrows)


def _worker(rank, W, store, args):
    dist.init_process_group("gloo", store=dist.FileStore(store, W), rank=rank, world_size=W,
                            timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    try:
        run(args)
    finally:
        dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["qwen3_30b_a3b", "deepseek_v3"],
                   choices=sorted(SHAPES))
    p.add_argument("--tiny", action="store_true", help="the tiny shape only (CPU smoke)")
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 128, 2048, 8192],
                   help="tokens per rank")
    p.add_argument("--modes", nargs="+", default=["all_to_all", "sync_free"],
                   choices=["all_to_all", "sync_free", "pipelined", "replicated"])
    p.add_argument("--pipeline-chunks", type=int, default=4,
                   help="token ranges of the 'pipelined' mode (all-to-all overlapping compute)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--cuda-graph", action="store_true",
                   help="also time the sync-free layer replayed from a CUDA graph")
    p.add_argument("--graph-max-tokens", type=int, default=128)
    p.add_argument("--nprocs", type=int, default=0,
                   help="without torchrun: spawn this many gloo CPU processes")
    p.add_argument("--cpu", action="store_true", help="CPU tensors even where CUDA exists")
    p.add_argument("--csv")
    args = p.parse_args(argv)
    if args.nprocs:
        import torch.multiprocessing as mp

        args.cpu = True
        store = tempfile.mktemp(prefix="bench_ep_store_")
        mp.spawn(_worker, args=(args.nprocs, store, args), nprocs=args.nprocs)
        return 0
    if "RANK" not in os.environ:
        p.error("run under torchrun (GPUs, NCCL) or pass --nprocs N (gloo on the CPU)")
    cuda = torch.cuda.is_available() and not args.cpu
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        run(args)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
