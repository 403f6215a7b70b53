"""Tune moe.dispatch kernel configurations for this GPU and write them to its table.

    moe-ops-tune --shapes qwen3_30b_a3b olmoe --tokens 1 8 32 128 512 2048 8192
    moe-ops-tune --shape 4096,14336,8,2 --tokens 1 64    # H,I,E,K
    moe-ops-tune --quick --shapes mixtral_8x7b             # ~10 candidates per T
    moe-ops-tune --weights mxfp4-mma --shapes gpt_oss_20b --tokens 1 8 128 2048

--weights fp8|fp8-w8a16|mxfp4|mxfp4-mma tunes the quantized expert GEMMs (QuantDispatchConfig)
on random quantized experts of the shape (FP8: [128, 128] blocks; MXFP4: gpt-oss's expert
variant, biases, swiglu_oai and interleaved gate/up rows). A quantized candidate is kept only if
its output is bitwise equal to the built-in heuristic's: the heuristics run one MMA kind at
every T, so a token's output does not depend on the batch, and a tuned table keeps that.

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
from moe_ops.tools import quant_baselines as qb
from moe_ops.tools.bench import SHAPES as _BENCH_SHAPES
from moe_ops.tools._cli import device as cli_device
from moe_ops.tools._cli import output_dir, token_count
from moe_ops.launch.dispatch import dispatch_triton
from moe_ops.launch.quant import dispatch_quantized
from moe_ops.ops.samples import make_dispatch_inputs
from moe_ops.tuning.configs import DispatchConfig
from moe_ops.tuning.heuristics import (heuristic_config, neighbours, quant_heuristic_config,
                                       quant_weights_name)
from moe_ops.tuning.shapes import SHAPES as _TUNING_SHAPES
from moe_ops.tuning.tables import config_to_dict, read_table, write_table

# the tuning shapes and every benchmark shape (gpt-oss's among them), name -> (H, I, E, K)
SHAPES = dict(_TUNING_SHAPES, **{n: (s.H, s.I, s.E, s.K) for n, s in _BENCH_SHAPES.items()})


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


def _fastest(label, cands, run, reject, device_type, progress):
    """The fastest of the configs `cands` whose output `run(config=c)` `reject` passes (it
    returns None, or the reason to drop the config); configs that fail to compile or launch are
    skipped. Raises naming `label` (the shape and T) when none is left."""
    best = None
    for cfg in cands:
        progress(label)
        try:
            reason = reject(run(config=cfg))
            if reason:
                print(f"  rejected {cfg}: {reason}", file=sys.stderr)
                continue
            ms = _time(functools.partial(run, config=cfg), device_type)
        except Exception as exc:  # noqa: BLE001 - a config that fails to compile or launch is skipped
            print(f"  skipped {cfg}: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
            continue
        if best is None or ms < best[0]:
            best = (ms, cfg)
    if best is None:
        raise RuntimeError(f"moe-ops-tune: every candidate config failed or was rejected at "
                           f"{label} (the reasons are printed above); no table was written")
    print(f"{label}: best {best[0] * 1e3:.1f} us {best[1]}")
    return best[1]


def tune_shape(H, I, E, K, tokens, dtype, device, progress, quick=False):
    configs = {}
    tol = 1e-2 if dtype != torch.float32 else 1e-4
    for T in tokens:
        args = make_dispatch_inputs(T, H, I, E, K, dtype=dtype, device=device, weight_std=0.02)
        ref = dispatch_triton(*args, config=heuristic_config(T, E, K, H, I, device.type, dtype))

        def reject(out, ref=ref):
            err = ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()
            return None if err <= tol else f"relative difference {err:.1e}"

        best = _fastest(f"H={H} I={I} E={E} K={K} T={T}",
                        candidates(T, E, K, H, I, dtype, device.type, quick),
                        functools.partial(dispatch_triton, *args), reject, device.type, progress)
        configs[str(T)] = config_to_dict(best)
        del args, ref, reject
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"H": H, "I": I, "E": E, "K": K, "dtype": str(dtype).removeprefix("torch."),
            "configs": configs}


def quant_candidates(T, E, K, H, I, qf, device_type, quick=False):
    """QuantDispatchConfig candidates around the heuristic's (first) for the quantized format
    `qf` (moe_ops.tools.quant_baselines.FORMATS): one field changed at a time (`quick`), or
    also the product of the row block, the down tile, the stages and the warps. Invalid ones
    fail at their launch and are skipped; tune_quant_shape keeps those whose output is bitwise
    the heuristic's."""
    fmt, quant_a = qf.fmt, qf.quantize_activations
    bk = qb.BLOCK_SHAPE[1] if fmt == "fp8" else 32
    base = quant_heuristic_config(T, E, K, H, I, fmt, bk, device_type, quant_a)
    r = dataclasses.replace
    if device_type != "cuda":
        return [base, r(base, block_n2=16)]
    rows = T * K / max(E, 1)
    out = [base]
    single = [r(base, num_stages=s) for s in (2, 3, 4, 5)]
    single += [r(base, num_warps=w) for w in (4, 8)]
    single += [r(base, block_n2=n) for n in (64, 128, 256)]
    single += [r(base, group_m=g) for g in (4, 8, 16)]
    single += [r(base, dependent_launch=not base.dependent_launch)]
    block_ms = [m for m in (16, 32, 64, 128, 256) if m <= max(16, 2 * rows)]
    if fmt == "mxfp4":
        single += [r(base, block_k=k) for k in (64, 128, 256)]
        single += [r(base, block_n1=n) for n in (32, 64, 128)]
        # (not mxfp4_one_factor: its outputs were bit-equal on some data and not on other data
        # at T = 2048 with the mma layout, so one tuning input cannot vouch for it)
        single += [r(base, mxfp4_stacked_gate_up=not base.mxfp4_stacked_gate_up)]
    else:
        block_ms = [m for m in block_ms if m >= 64] or [64]
        if quant_a and rows <= 32:
            single += [r(base, fp8_swap_ab=not base.fp8_swap_ab, block_m=m) for m in (16, 32, 64)]
        if not quant_a:
            single += [r(base, block_n1=n) for n in (64, 128)]
    single += [r(base, block_m=m) for m in block_ms]
    out += single
    if not quick:
        for bm, bn2, stages, warps in itertools.product(block_ms, (64, 128), (3, 4), (4, 8)):
            out.append(r(base, block_m=bm, block_n2=bn2, num_stages=stages, num_warps=warps))
    seen, unique = set(), []
    for c in out:
        if c not in seen:
            seen.add(c)
            unique.append(c)
    return unique


def quant_inputs(T, H, I, E, K, qf, dtype, device, seed=0):
    """(args, kwargs) of launch.quant.dispatch_quantized on random quantized experts: K distinct
    experts per token, MXFP4 with gpt-oss's expert variant."""
    g = torch.Generator(device=device).manual_seed(seed)
    q13, q2, s13, s2 = qb.random_quantized(E, H, I, qf.fmt, device, g)
    if qf.mxfp4_layout == "mma":
        from moe_ops.mxfp4_layout import swizzle_mxfp4

        q13, q2 = swizzle_mxfp4(q13), swizzle_mxfp4(q2)
    hidden = torch.randn(T, H, generator=g, device=device).to(dtype)
    ids = torch.rand(T, E, generator=g, device=device).argsort(-1)[:, :K].to(torch.int32)
    w = torch.rand(T, K, generator=g, device=device).softmax(-1)
    kw = qb.FORMATS[qf.name].dispatch_kwargs(s13, s2)
    if qf.fmt == "mxfp4":
        kw.update(activation="swiglu_oai", gate_up_interleaved=True,
                  w13_bias=(torch.randn(E, 2 * I, generator=g, device=device) * 0.02).to(dtype),
                  w2_bias=(torch.randn(E, H, generator=g, device=device) * 0.02).to(dtype))
    return (hidden, q13, q2, w, ids), kw


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The output's bit patterns (bitwise comparison: NaN == NaN of the same bits)."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def tune_quant_shape(H, I, E, K, tokens, dtype, device, progress, qf, quick=False):
    """The table entry of the quantized format `qf` at one shape: per token count, the fastest
    candidate whose output is bitwise equal to the heuristic config's."""
    bk = qb.BLOCK_SHAPE[1] if qf.fmt == "fp8" else 32
    configs = {}
    for T in tokens:
        args, kw = quant_inputs(T, H, I, E, K, qf, dtype, device)
        run = functools.partial(dispatch_quantized, *args, **kw)
        base = quant_heuristic_config(T, E, K, H, I, qf.fmt, bk, device.type,
                                      qf.quantize_activations)
        ref = _bits(run(config=base))

        def reject(out, ref=ref):
            diff = int((_bits(out) != ref).sum())
            return f"{diff} of {ref.numel()} outputs differ from the heuristic config's bits" \
                if diff else None

        best = _fastest(f"{qf.name} H={H} I={I} E={E} K={K} T={T}",
                        quant_candidates(T, E, K, H, I, qf, device.type, quick), run, reject,
                        device.type, progress)
        configs[str(T)] = config_to_dict(best)
        del args, kw, run, ref, reject
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"H": H, "I": I, "E": E, "K": K, "dtype": str(dtype).removeprefix("torch."),
            "weights": quant_weights_name(qf.fmt, qf.quantize_activations,
                                          qf.mxfp4_layout == "mma"),
            "block_shape": list(qb.BLOCK_SHAPE) if qf.fmt == "fp8" else None,
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
    p.add_argument("--weights", default=None, choices=sorted(qb.FORMATS),
                   help="tune the quantized expert GEMMs of this weight format instead "
                        "(moe-ops-bench's --weights formats)")
    args = p.parse_args(argv)
    shapes = [SHAPES[n] for n in args.shapes] + [_shape(p, s) for s in args.shape]
    if not shapes:
        p.error("give --shapes and/or --shape H,I,E,K")
    qf = qb.FORMATS[args.weights] if args.weights else None
    if qf is not None and qf.fmt == "mxfp4":
        mult = 64 if qf.mxfp4_layout == "mma" else 32
        for H, I, _, _ in shapes:
            if H % mult or I % mult:
                p.error(f"--weights {qf.name} needs H and I multiples of {mult}, got H={H} I={I}")
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
    def cands(T, E, K, H, I):
        if qf is not None:
            return quant_candidates(T, E, K, H, I, qf, device.type, args.quick)
        return candidates(T, E, K, H, I, dtype, device.type, args.quick)

    total = sum(len(cands(T, E, K, H, I)) for H, I, E, K in shapes for T in args.tokens)
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
    if qf is not None:
        entries = [tune_quant_shape(H, I, E, K, args.tokens, dtype, device, progress, qf,
                                    args.quick) for H, I, E, K in shapes]
    else:
        entries = [tune_shape(H, I, E, K, args.tokens, dtype, device, progress, args.quick)
                   for H, I, E, K in shapes]
    if bar is not None:
        bar.close()
    import triton

    path = write_table(name, entries, args.out_dir, triton.__version__)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
