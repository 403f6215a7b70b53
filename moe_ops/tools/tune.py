"""Tune moe.dispatch kernel configurations for this GPU and write them to its table.

    moe-ops-tune --shapes qwen3_30b_a3b olmoe --tokens 1 8 32 128 512 2048 8192
    moe-ops-tune --shape 4096,14336,8,2 --tokens 1 64    # H,I,E,K
    moe-ops-tune --quick --shapes mixtral_8x7b             # ~10 candidates per T

Every candidate's output is checked against the heuristic config's output before it is timed
(CUDA-graph replay, median of triton.testing.do_bench: no host overhead in the figure). The best
per token count is merged into <device>.json in --out-dir, else $MOE_OPS_TUNING_DIR, else
~/.cache/moe_ops/tuning (moe_ops.tuning.tables), which `moe.dispatch` then uses (nearest
measured token count; a table in $MOE_OPS_TUNING_DIR is read only while that is set).
`--device cpu` with TRITON_INTERPRET=1 runs a smoke test through the interpreter, timed with the
host clock.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import sys
import time

import torch

import moe_ops  # noqa: F401  (registers the ops)
from moe_ops.tools._cli import device as cli_device
from moe_ops.tools._cli import output_dir, token_count
from moe_ops.launch.dispatch import dispatch_triton
from moe_ops.ops.samples import make_dispatch_inputs
from moe_ops.tuning.configs import DispatchConfig
from moe_ops.tuning.heuristics import heuristic_config, neighbours
from moe_ops.tuning.shapes import SHAPES
from moe_ops.tuning.tables import config_to_dict, read_table, write_table


def candidates(T, E, K, H, I, dtype, device_type, quick=False):
    base = heuristic_config(T, E, K, H, I, device_type, dtype)
    if device_type != "cuda":
        return [base, dataclasses.replace(base, gate_up_block_n=16, down_block_n=16)]
    if quick:
        return list(neighbours(base, dtype).values())
    rows = T * K / max(E, 1)
    block_ms = sorted({m for m in (16, 32, 64, 128) if m <= max(16, 2 * rows)} | {base.block_m})
    out = {base}
    for bm, (bn1, bk1), (bn2, bk2), (warps, stages) in itertools.product(
            block_ms, [(32, 128), (64, 64), (64, 128), (128, 64)], [(64, 128), (128, 64), (256, 64)],
            [(4, 3), (4, 4), (8, 3)]):
        if dtype == torch.float32:
            bk1, bk2 = min(bk1, 32), min(bk2, 32)
        out.add(DispatchConfig(block_m=bm, gate_up_block_n=bn1, gate_up_block_k=bk1,
                               down_block_n=bn2, down_block_k=bk2, num_warps=warps,
                               num_stages=stages, group_m=base.group_m))
    return sorted(out, key=lambda c: dataclasses.astuple(c))


def _time(fn, device_type):
    if device_type != "cuda":
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton

    from moe_ops.tools._timing import capture_graph

    fn()
    graph, _ = capture_graph(fn)
    return triton.testing.do_bench(graph.replay, warmup=5, rep=20, return_mode="median")


def tune_shape(H, I, E, K, tokens, dtype, device, progress, quick=False):
    configs = {}
    for T in tokens:
        args = make_dispatch_inputs(T, H, I, E, K, dtype=dtype, device=device, weight_std=0.02)
        ref = dispatch_triton(*args, config=heuristic_config(T, E, K, H, I, device.type, dtype))
        best = None
        for cfg in candidates(T, E, K, H, I, dtype, device.type, quick):
            progress(f"H={H} I={I} E={E} K={K} T={T}")
            try:
                out = dispatch_triton(*args, config=cfg)
                err = ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()
                if not err <= (1e-2 if dtype != torch.float32 else 1e-4):
                    print(f"  rejected {cfg}: relative difference {err:.1e}", file=sys.stderr)
                    continue
                ms = _time(functools.partial(dispatch_triton, *args, config=cfg), device.type)
            except Exception as exc:  # noqa: BLE001 - a config that fails to compile or launch is skipped
                print(f"  skipped {cfg}: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
                continue
            if best is None or ms < best[0]:
                best = (ms, cfg)
        if best is None:
            raise RuntimeError(
                f"moe-ops-tune: every candidate config failed or was rejected at H={H} I={I} "
                f"E={E} K={K} T={T} (the reasons are printed above); no table was written")
        print(f"H={H} I={I} E={E} K={K} T={T}: best {best[0] * 1e3:.1f} us {best[1]}")
        configs[str(T)] = config_to_dict(best[1])
        del args, ref
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"H": H, "I": I, "E": E, "K": K, "dtype": str(dtype).removeprefix("torch."),
            "configs": configs}


def _shape(parser, text):
    """--shape H,I,E,K: four ints >= 1 with K <= E (what moe.dispatch accepts)."""
    try:
        H, I, E, K = (int(v) for v in text.split(","))
    except ValueError:
        parser.error(f"--shape {text}: expected four ints H,I,E,K")
    if min(H, I, E, K) < 1 or K > E:
        parser.error(f"--shape {text}: needs H, I, E, K >= 1 and K <= E")
    return H, I, E, K


def main(argv=None):
    p = argparse.ArgumentParser(prog="moe-ops-tune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="*", default=[], choices=sorted(SHAPES))
    p.add_argument("--shape", action="append", default=[], help="H,I,E,K")
    p.add_argument("--tokens", nargs="+", type=token_count, default=[1, 8, 32, 128, 512, 2048, 8192])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--out-dir", default=None, help="where the table goes (default: "
                   "$MOE_OPS_TUNING_DIR, else ~/.cache/moe_ops/tuning)")
    p.add_argument("--quick", action="store_true",
                   help="only the heuristic's neighbours (~10 candidates per token count instead "
                        "of ~100; moe_ops.tuning.heuristics.neighbours)")
    args = p.parse_args(argv)
    shapes = [SHAPES[n] for n in args.shapes] + [_shape(p, s) for s in args.shape]
    if not shapes:
        p.error("give --shapes and/or --shape H,I,E,K")
    device = cli_device(p, args.device)
    output_dir(p, "--out-dir", args.out_dir)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu-interpreter"
    try:   # a broken table there would fail the write, after every measurement was made
        read_table(name, args.out_dir)
    except (ValueError, RuntimeError) as e:
        p.error(str(e))
    dtype = getattr(torch, args.dtype)
    if device.type == "cpu":
        from moe_ops._runtime import interpret_enabled
        from moe_ops.launch._common import require_interpreter

        if not interpret_enabled():
            p.error("on CPU, set TRITON_INTERPRET=1 (a smoke test through Triton's interpreter)")
        require_interpreter()
    total = sum(len(candidates(T, E, K, H, I, dtype, device.type, args.quick))
                for H, I, E, K in shapes for T in args.tokens)
    done = [0]
    try:
        from tqdm import tqdm
        bar = tqdm(total=total, unit="cfg")

        def progress(desc):
            bar.set_description(desc)
            bar.update(1)
    except ImportError:
        bar = None

        def progress(desc):
            done[0] += 1
            print(f"[{done[0]}/{total}] {desc}", end="\r", file=sys.stderr)
    entries = [tune_shape(H, I, E, K, args.tokens, dtype, device, progress, args.quick)
               for H, I, E, K in shapes]
    if bar is not None:
        bar.close()
    import triton

    path = write_table(name, entries, args.out_dir, triton.__version__)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
