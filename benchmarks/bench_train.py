"""Training benchmark: forward + backward of the MoE expert computation (grads for hidden, w13, w2
and topk_weights) for moe_ops against the `torch._grouped_mm` pipeline under autograd and
transformers' "grouped_mm" experts.

For every (shape, T): bf16 weights (std 0.02, requires_grad), standard-normal hidden
(requires_grad), topk_weights from torch.ops.moe.route on random logits (float32, requires_grad),
a random bf16 grad_out. Per implementation: one warm-up step; at the smallest T of each shape
(every T with --check-all) the four gradients are compared with a float32 reference
(moe_ops.reference.dispatch_backward_reference, run expert chunk by expert chunk so its float32
buffers stay small), relative error <= 3e-2 per gradient, else FAIL; one step measured for peak
memory (torch.cuda.max_memory_allocated delta around the step, retained gradients included);
then timed with triton.testing.do_bench (median; the step sets .grad = None itself). Roofline
fraction = (3 x forward flops) / matmul rate / time, forward flops = 2*T*K*3*H*I, with the
matmul rate measured in the same run. The table comes last.

    python benchmarks/bench_train.py                      # full run (H200: a few minutes)
    python benchmarks/bench_train.py --shapes qwen3_30b_a3b --tokens 8192 --impls moe_ops torch_grouped_mm
    python benchmarks/bench_train.py --tiny               # tiny shapes, CPU smoke test (< 1 min)
    python benchmarks/bench_train.py --md train.md --csv train.csv
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import statistics
import sys
import time
from typing import Callable, Optional

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)   # this checkout's moe_ops, without PYTHONPATH or an install

import moe_ops  # noqa: E402  (registers torch.ops.moe.*)
from moe_ops.tools import baselines as bl  # noqa: E402
from moe_ops.tools import bench as bm  # noqa: E402
from moe_ops.tools._cli import device as cli_device  # noqa: E402
from moe_ops.tools._cli import output_file, positive, token_count  # noqa: E402
from moe_ops.reference import dispatch_backward_reference  # noqa: E402

SHAPE_NAMES = ["mixtral_8x7b", "qwen3_30b_a3b", "qwen3_30b_a3b_zipf", "deepseek_v3_routed"]
TOKENS = [2048, 8192, 16384, 32768]
TINY_TOKENS = [64, 256]
IMPLS = ["moe_ops", "moe_ops_recompute", "torch_grouped_mm", "hf_grouped_mm"]
SHORT = {"moe_ops": "moe_ops", "moe_ops_recompute": "mo_recomp", "torch_grouped_mm": "torch_gmm",
         "hf_grouped_mm": "hf_gmm"}
OURS = ("moe_ops", "moe_ops_recompute")
GRAD_NAMES = ["hidden", "w13", "w2", "weights"]
TOLERANCE = 3e-2            # relative error per gradient against the float32 reference
DTYPE = torch.bfloat16
GiB = 2 ** 30


# --------------------------------------------------------------------------------------------
# Implementations: make(hidden, w13, w2, topk_weights, ids32, ids64) -> (forward () -> out,
# the four leaves whose .grad are d hidden, d w13, d w2, d topk_weights)
# --------------------------------------------------------------------------------------------

def _make_moe_ops(hidden, w13, w2, tw, ids32, ids64):
    return (lambda: torch.ops.moe.dispatch(hidden, w13, w2, tw, ids32)), [hidden, w13, w2, tw]


def _make_moe_ops_recompute(hidden, w13, w2, tw, ids32, ids64):
    # moe_ops.set_recompute(True) while the forward runs: only the inputs are saved and the
    # backward recomputes z = W13_e x (the memory/compute trade the peak column measures).
    def forward():
        previous = moe_ops.set_recompute(True)
        try:
            return torch.ops.moe.dispatch(hidden, w13, w2, tw, ids32)
        finally:
            moe_ops.set_recompute(previous)
    return forward, [hidden, w13, w2, tw]


def _make_torch_gmm(hidden, w13, w2, tw, ids32, ids64):
    # The same function as the forward benchmark's baseline; differentiable through
    # torch._grouped_mm (GroupedMmBackward0), index_select, silu, mul and index_add_.
    return (lambda: bl.torch_grouped_mm(hidden, w13, w2, tw, ids32)), [hidden, w13, w2, tw]


def _make_hf_gmm(hidden, w13, w2, tw, ids32, ids64):
    # A transformers MixtralExperts dispatching to "grouped_mm" whose parameters alias w13 / w2
    # (bl.build_hf_experts, no copy); its parameters are the leaves that receive the gradients.
    # Called with grad enabled (bl.make_hf_baseline runs under no_grad: forward only).
    experts = bl.build_hf_experts(w13.detach(), w2.detach(), ids64.shape[1], "grouped_mm").train()
    experts.gate_up_proj.requires_grad_(True)
    experts.down_proj.requires_grad_(True)
    return (lambda: experts(hidden, ids64, tw)), [hidden, experts.gate_up_proj, experts.down_proj, tw]


@dataclasses.dataclass
class TrainImpl:
    name: str
    make: Callable
    # Rough peak-memory model of one step beyond the resident inputs, bytes per routed slot
    # (S = T*K) as (a * H + b * I), plus c x the weight bytes; see estimate_delta().
    per_slot_h: int
    per_slot_i: int
    weight_mult: float


TRAIN_IMPLS = {
    # Plain-torch backward today: float32 dW13/dW2 (2x the bf16 weight bytes) before the cast;
    # a Triton backward needs far less (the linear fit from measured steps takes over).
    "moe_ops": TrainImpl("moe_ops", _make_moe_ops, 4, 8, 2.0),
    "moe_ops_recompute": TrainImpl("moe_ops_recompute", _make_moe_ops_recompute, 4, 8, 2.0),
    # saved x, h, silu(g), a, y (bf16) + float32 y*w and its grad + grads of y, a, h, x
    "torch_grouped_mm": TrainImpl("torch_grouped_mm", _make_torch_gmm, 16, 16, 0.0),
    # as above plus float32 weighted_out and its permuted copy ([S, H] each) and their grads
    "hf_grouped_mm": TrainImpl("hf_grouped_mm", _make_hf_gmm, 24, 16, 0.0),
}


def availability(name: str, device: torch.device) -> tuple[bool, str]:
    if name in OURS:
        return True, ""
    ok, why = bl.grouped_mm_status(device, DTYPE)
    if not ok:
        return False, why
    if name == "hf_grouped_mm":
        if bl.transformers_version() is None:
            return False, "transformers not installed"
        if "grouped_mm" not in bl.hf_experts_implementations():
            return False, f"no grouped_mm experts in transformers {bl.transformers_version()}"
    return True, ""


# --------------------------------------------------------------------------------------------
# Memory estimate (the --max-gib guard)
# --------------------------------------------------------------------------------------------

def resident_bytes(s: bm.Shape, T: int, esize: int) -> int:
    """Weights, hidden, grad_out, router logits and routing of one cell."""
    return 3 * s.E * s.H * s.I * esize + 2 * T * s.H * esize + T * s.E * 4 + T * s.K * 24


def estimate_delta(impl: TrainImpl, s: bm.Shape, T: int, esize: int,
                   measured: list[tuple[int, int]]) -> int:
    """Peak bytes one step adds to the resident ones. With two measured steps of the impl on
    this shape (smaller T), their linear fit (x1.1 on the growth); else the analytic model:
    weight grads + c x weights + output and d hidden + S * (a*H + b*I)."""
    if len(measured) >= 2:
        (t1, p1), (t2, p2) = measured[-2], measured[-1]
        slope = max(0.0, (p2 - p1) / (t2 - t1)) if t2 != t1 else 0.0
        return int(p2 + 1.1 * slope * max(0, T - t2))
    w = 3 * s.E * s.H * s.I * esize
    S = T * s.K
    return int(w * (1 + impl.weight_mult) + 2 * T * s.H * esize + S * 8
               + S * (impl.per_slot_h * s.H + impl.per_slot_i * s.I))


# --------------------------------------------------------------------------------------------
# Gradient check against the float32 reference, expert chunk by expert chunk
# --------------------------------------------------------------------------------------------

def reference_errors(grads, grad_out, hidden, w13, w2, tw, ids, chunk_bytes: int) -> list[float]:
    """Relative errors (L2) of grads = (d hidden, d w13, d w2, d weights) against
    dispatch_backward_reference in float32. The reference runs on groups of experts (ids outside
    a group's range are ignored by it), so its float32 weight-gradient buffers hold one group;
    d hidden and d weights are the sums of the groups' float32 contributions."""
    E, H, I = w13.shape[0], w13.shape[2], w2.shape[2]
    per_expert = 3 * H * I * 6                  # float32 buffers + their bf16 casts
    n = max(1, min(E, chunk_bytes // per_expert))
    hidden32 = hidden.detach().float()           # float32 hidden: d hidden comes back in float32
    dx = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    dw = torch.zeros(tw.shape, dtype=torch.float32, device=hidden.device)
    num = {"w13": 0.0, "w2": 0.0}
    den = {"w13": 0.0, "w2": 0.0}
    g13, g2 = grads[1], grads[2]
    with torch.no_grad():
        for e0 in range(0, E, n):
            e1 = min(E, e0 + n)
            rx, r13, r2, rw = dispatch_backward_reference(
                grad_out, hidden32, w13.detach()[e0:e1], w2.detach()[e0:e1], tw.detach(), ids - e0)
            dx += rx
            dw += rw
            for key, g, r in (("w13", g13[e0:e1], r13), ("w2", g2[e0:e1], r2)):
                r = r.float()
                num[key] += (g.float() - r).norm().item() ** 2
                den[key] += r.norm().item() ** 2
            del rx, r13, r2, rw

    def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
        d = ref.norm().item()
        e = (a.float() - ref).norm().item()
        return e / d if d > 0 else e

    def rel2(key: str) -> float:
        return math.sqrt(num[key] / den[key]) if den[key] > 0 else math.sqrt(num[key])

    return [rel(grads[0], dx), rel2("w13"), rel2("w2"), rel(grads[3], dw)]


# --------------------------------------------------------------------------------------------
# One cell
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Result:
    shape: str
    T: int
    impl: str
    status: str = "ok"          # ok | FAIL | skip | n/a | ERR | oom
    note: str = ""
    errs: Optional[list] = None  # relative errors of d hidden, d w13, d w2, d weights
    ms: Optional[float] = None
    how: str = ""               # do_bench | perf_counter (no CUDA) | once (median of 3 single steps)
    peak_gib: Optional[float] = None
    est_gib: Optional[float] = None

    @property
    def timed(self) -> bool:
        return self.ms is not None


@dataclasses.dataclass
class Cell:
    shape: str
    T: int
    flops: int                  # training flops = 3 x forward
    floor_ms: float
    hit: int
    max_load: float
    checked: bool
    results: dict


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def run_impl(impl: TrainImpl, s: bm.Shape, T: int, data: dict, timer: bm.Timer, opts, device,
             check: bool, r: Result, measured: list) -> None:
    fwd = leaves = None
    grad_out = data["grad_out"]

    def step():
        for t in leaves:
            t.grad = None
        fwd().backward(grad_out)

    try:
        fwd, leaves = impl.make(data["hidden"], data["w13"], data["w2"], data["tw"],
                                data["ids32"], data["ids64"])
        step()                                   # warm-up (compilation, autotuning)
        timer.sync()
        if check:
            grads = [t.grad for t in leaves]
            if any(g is None for g in grads):
                missing = [n for n, g in zip(GRAD_NAMES, grads) if g is None]
                r.status, r.note = "FAIL", "no gradient for " + ", ".join(missing)
            else:
                r.errs = reference_errors(grads, grad_out, data["hidden"], data["w13"], data["w2"],
                                          data["tw"], data["ids32"], opts.ref_chunk_bytes)
                bad = [f"{n} {e:.1e}" for n, e in zip(GRAD_NAMES, r.errs) if not e <= TOLERANCE]
                if bad:
                    r.status, r.note = "FAIL", "rel err > %.0e: %s" % (TOLERANCE, ", ".join(bad))
            del grads
        for t in leaves:
            t.grad = None
        _free(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        one = timer.once(step)
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device) - base
            r.peak_gib = peak / GiB
            measured.append((T, peak))
        if one > opts.max_step_ms:
            # Long steps: launch overhead and cache state are noise; median of 3 single steps
            # (this one included) instead of do_bench's 5 estimation + warm-up + timed calls.
            r.ms = statistics.median([one, timer.once(step), timer.once(step)])
            r.how = "once"
        else:
            r.ms = timer(step)
            r.how = "do_bench" if device.type == "cuda" else "perf_counter"
    except torch.cuda.OutOfMemoryError as exc:
        r.status, r.note = "oom", bm._short_exc(exc)
    except Exception as exc:  # noqa: BLE001 - an implementation's failure is a result
        if "out of memory" in str(exc).lower():
            r.status, r.note = "oom", bm._short_exc(exc)
        else:
            r.status, r.note = "ERR", bm._short_exc(exc)
    finally:
        for t in leaves or []:
            t.grad = None
        fwd = leaves = None          # drop the closure's references (a transformers module) now
        _free(device)


def run_cell(s: bm.Shape, wt: bm.Weights, T: int, impl_names: list[str], unavailable: dict,
             state: dict, opts, device, timer: bm.Timer, rate: float, check: bool) -> Cell:
    hidden, logits = bm.make_tokens(s, wt, T, device, DTYPE, seed=opts.seed * 1000 + T)
    topk_weights, topk_ids = bm.route(s, logits, wt.bias)
    del logits
    g = torch.Generator(device=device).manual_seed(opts.seed * 1000 + T + 1)
    grad_out = torch.randn(T, s.H, generator=g, device=device, dtype=DTYPE)
    data = {"hidden": hidden.requires_grad_(), "w13": wt.w13, "w2": wt.w2,
            "tw": topk_weights.detach().requires_grad_(), "ids32": topk_ids,
            "ids64": topk_ids.long(), "grad_out": grad_out}
    counts = torch.bincount(data["ids64"].flatten(), minlength=s.E)
    hit = int((counts > 0).sum().item())
    max_load = counts.max().item() / (T * s.K / hit)
    flops = 3 * 2 * T * s.K * 3 * s.H * s.I
    floor_ms = flops / rate * 1e3
    esize = hidden.element_size()
    resident = resident_bytes(s, T, esize)

    results = {}
    for name in impl_names:
        r = Result(s.name, T, name)
        results[name] = r
        if name in unavailable:
            r.status, r.note = "n/a", unavailable[name]
            continue
        if name in state["oom"]:
            r.status, r.note = "skip", state["oom"][name]
            continue
        impl = TRAIN_IMPLS[name]
        measured = state["measured"].setdefault(name, [])
        est = resident + estimate_delta(impl, s, T, esize, measured)
        r.est_gib = est / GiB
        if r.est_gib > opts.max_gib:
            r.status, r.note = "skip", f"estimated {fmt_gib(r.est_gib)} GiB > --max-gib {opts.max_gib:g}"
            continue
        run_impl(impl, s, T, data, timer, opts, device, check, r, measured)
        if r.status == "oom":
            state["oom"][name] = f"oom at T={T}"
    del data, hidden, grad_out, topk_weights, topk_ids
    _free(device)
    return Cell(s.name, T, flops, floor_ms, hit, max_load, check, results)


# --------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------

def fmt_ms(t: Optional[float]) -> str:
    if t is None:
        return "-"
    return f"{t:.1f}" if t >= 10 else (f"{t:.2f}" if t >= 1 else f"{t:.3f}")


def fmt_gib(x: Optional[float]) -> str:
    return "-" if x is None else (f"{x:.1f}" if x >= 1 else f"{x:.2f}")


def fmt_cell(c: Cell, r: Result) -> str:
    if not r.timed:
        return r.status
    out = f"{fmt_ms(r.ms)} ({100 * c.floor_ms / r.ms:.0f}%)"
    return out + " FAIL" if r.status == "FAIL" else out


def best_baseline(c: Cell) -> Optional[Result]:
    ok = [r for n, r in c.results.items() if n not in OURS and r.status == "ok" and r.timed]
    return min(ok, key=lambda r: r.ms) if ok else None


def summary_header(impl_names: list[str]) -> list[str]:
    return (["shape", "T", "floor ms"] + [SHORT[n] for n in impl_names]
            + ["best baseline", "speedup", "peak GiB " + "/".join(SHORT[n] for n in impl_names)])


def summary_row(c: Cell, impl_names: list[str]) -> list[str]:
    row = [c.shape, str(c.T), fmt_ms(c.floor_ms)]
    row += [fmt_cell(c, c.results[n]) for n in impl_names]
    bb = best_baseline(c)
    mo = c.results.get("moe_ops")
    row.append(f"{SHORT[bb.impl]} {fmt_ms(bb.ms)}" if bb else "-")
    row.append(f"{bb.ms / mo.ms:.2f}x" if (bb and mo is not None and mo.status == "ok" and mo.timed)
               else "-")
    row.append("/".join(fmt_gib(c.results[n].peak_gib) for n in impl_names))
    return row


DETAIL_HEADER = ["shape", "T", "impl", "status", "ms", "how", "roofline", "peak GiB", "est GiB",
                 "err hidden", "err w13", "err w2", "err weights", "note"]


def detail_rows(cells: list[Cell], impl_names: list[str]) -> list[list[str]]:
    rows = []
    for c in cells:
        for n in impl_names:
            r = c.results[n]
            errs = [f"{e:.1e}" for e in r.errs] if r.errs else ["-"] * 4
            rows.append([c.shape, str(c.T), n, r.status, fmt_ms(r.ms), r.how or "-",
                         f"{100 * c.floor_ms / r.ms:.0f}%" if r.timed else "-",
                         fmt_gib(r.peak_gib), fmt_gib(r.est_gib)] + errs + [r.note])
    return rows


def format_progress(c: Cell, elapsed: float) -> str:
    parts = []
    for n, r in c.results.items():
        txt = f"{SHORT[n]} {fmt_ms(r.ms)} ms" if r.timed else f"{SHORT[n]} {r.status}"
        if r.timed and r.status != "ok":
            txt += f" {r.status}"
        if r.peak_gib is not None:
            txt += f" {fmt_gib(r.peak_gib)} GiB"
        if r.errs:
            txt += " err " + "/".join(f"{e:.0e}" for e in r.errs)
        parts.append(txt)
    return (f"  T={c.T:<5} hit {c.hit:>3} max/mean load {c.max_load:4.1f} floor {fmt_ms(c.floor_ms)} ms"
            f" | " + ", ".join(parts) + f"  [{elapsed:.0f} s]")


def write_csv(path: str, cells: list[Cell], impl_names: list[str], env) -> None:
    num = bm._num
    header = ["shape", "T", "impl", "status", "ms", "how", "floor_ms", "roofline_fraction",
              "train_flops", "peak_gib", "est_gib", "checked", "err_hidden", "err_w13", "err_w2",
              "err_weights", "experts_hit", "max_over_mean_load", "note"]
    rows = ([c.shape, c.T, n, r.status, num(r.ms), r.how, num(c.floor_ms),
             num(c.floor_ms / r.ms if r.timed else None), c.flops, num(r.peak_gib),
             num(r.est_gib), int(c.checked)]
            + ([num(e) for e in r.errs] if r.errs else [""] * 4) + [c.hit, num(c.max_load), r.note]
            for c in cells for n in impl_names for r in (c.results[n],))
    bm.write_csv_rows(path, env, header, rows)


# --------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", choices=list(bm.SHAPES),
                   help=f"default: {' '.join(SHAPE_NAMES)}")
    p.add_argument("--tokens", nargs="+", type=token_count,
                   help=f"default: {TOKENS} ({TINY_TOKENS} with --tiny)")
    p.add_argument("--impls", nargs="+", choices=IMPLS, help="default: all")
    p.add_argument("--tiny", action="store_true",
                   help="tiny H and I (same E, K, routing), few reps: a smoke test that runs on CPU")
    p.add_argument("--csv", metavar="PATH", help="write every (shape, T, impl) result as CSV")
    p.add_argument("--md", metavar="PATH", help="write the environment and tables as Markdown")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--max-gib", type=float, default=100.0,
                   help="skip an impl at a cell whose estimated peak memory (inputs + one step) "
                        "exceeds this (default 100)")
    p.add_argument("--check-all", action="store_true",
                   help="check gradients at every T (default: the smallest T of each shape)")
    p.add_argument("--warmup-ms", type=float, default=None, help="do_bench warmup (default 5; 2 with --tiny)")
    p.add_argument("--rep-ms", type=float, default=None, help="do_bench rep (default 25; 20 with --tiny)")
    p.add_argument("--max-step-ms", type=float, default=None,
                   help="a step longer than this is timed as the median of 3 single synchronised "
                        "steps instead of do_bench (default 400 on CUDA, 2000 on CPU)")
    p.add_argument("--ref-chunk-gib", type=float, default=2.0,
                   help="float32 reference run on expert groups of about this many GiB (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--x-chunks", type=int, default=None, metavar="N",
                   help="moe_ops backward: BackwardConfig.x_chunks for every config (0: "
                        "automatic, the configs' default)")
    opts = p.parse_args(argv)
    opts.device = cli_device(p, opts.device)
    positive(p, opts, "warmup_ms", "rep_ms", "max_step_ms", "max_gib", "ref_chunk_gib")
    output_file(p, "--csv", opts.csv)   # checked now: the run can take an hour
    output_file(p, "--md", opts.md)
    return opts


def main(argv=None) -> int:
    opts = parse_args(argv)
    device = bm.resolve_device(opts.device)
    if opts.warmup_ms is None:
        opts.warmup_ms = 2.0 if opts.tiny else 5.0
    if opts.rep_ms is None:
        opts.rep_ms = 20.0 if opts.tiny else 25.0
    if opts.max_step_ms is None:
        opts.max_step_ms = 400.0 if device.type == "cuda" else 2000.0
    opts.ref_chunk_bytes = int(opts.ref_chunk_gib * GiB)
    if opts.x_chunks is not None:
        from moe_ops.tuning import BackwardConfig, update_config_constraints

        update_config_constraints(BackwardConfig, x_chunks=opts.x_chunks)
    shapes = [bm.SHAPES[n] for n in (opts.shapes or SHAPE_NAMES)]
    if opts.tiny:
        shapes = [dataclasses.replace(s, H=bm.TINY_HI[s.name][0], I=bm.TINY_HI[s.name][1])
                  for s in shapes]
    tokens = sorted(set(opts.tokens or (TINY_TOKENS if opts.tiny else TOKENS)))
    impl_names = [n for n in IMPLS if n in (opts.impls or IMPLS)]

    log = bm.log
    env, timer, _bw, rate = bm.start_run(
        device, opts, "no CUDA: timing with time.perf_counter, no peak memory; moe_ops runs its "
        "CPU path (torch reference)")
    unavailable = {}
    for n in impl_names:
        ok, why = availability(n, device)
        if not ok:
            unavailable[n] = why
            log(f"{'unavailable':13s} {n}: {why}")
    run_desc = (f"bf16 fwd+bwd, grads checked (rel err <= {TOLERANCE:.0e} vs float32 reference) at "
                f"{'every T' if opts.check_all else 'the smallest T of each shape'}, do_bench warmup "
                f"{opts.warmup_ms:g} ms rep {opts.rep_ms:g} ms (median), steps > {opts.max_step_ms:g} ms "
                f"timed once x3, --max-gib {opts.max_gib:g}{', tiny shapes' if opts.tiny else ''}"
                f"{'' if opts.x_chunks is None else f', backward x_chunks={opts.x_chunks}'}")
    env.append(("run", run_desc))
    log(f"{'run':13s} {run_desc}")

    t_start = time.perf_counter()
    cells: list[Cell] = []
    for s in shapes:
        t0 = time.perf_counter()
        wt = bm.make_weights(s, device, DTYPE, seed=opts.seed)
        wt.w13.requires_grad_()
        wt.w2.requires_grad_()
        log(f"\n== {s.name}: H={s.H} I={s.I} E={s.E} K={s.K} {s.scoring}"
            f"{' zipf(%.1f)' % s.zipf if s.zipf else ''}  weights "
            f"{(wt.w13.nbytes + wt.w2.nbytes) / GiB:.2f} GiB ({time.perf_counter() - t0:.1f} s to make)")
        state = {"measured": {}, "oom": {}}     # per shape: measured peaks, impls that ran out
        for i, T in enumerate(tokens):
            cell = run_cell(s, wt, T, impl_names, unavailable, state, opts, device, timer, rate,
                            check=opts.check_all or i == 0)
            cells.append(cell)
            log(format_progress(cell, time.perf_counter() - t_start))
        del wt
        _free(device)
    elapsed = time.perf_counter() - t_start

    header = summary_header(impl_names)
    rows = [summary_row(c, impl_names) for c in cells]
    legend = ("fwd+bwd ms (median) and, in parentheses, the compute roofline fraction: floor = "
              "3 x 2*T*K*3*H*I flops at the measured matmul rate; speedup = best baseline / moe_ops; "
              "FAIL = a gradient off the float32 reference by > 3e-2 (checked at "
              f"{'every T' if opts.check_all else 'the smallest T of each shape'}); peak = "
              "max_memory_allocated delta of one step (gradients included); skip = estimated over "
              "--max-gib; oom = ran out of memory (larger T then skipped)")
    bm.log_finish(cells, elapsed, log)
    log("")
    log(bm.text_table(DETAIL_HEADER, detail_rows(cells, impl_names)))
    log("")
    log(legend)
    log(bm.text_table(header, rows))

    if opts.csv:
        write_csv(opts.csv, cells, impl_names, env)
    if opts.md:
        bm.write_md(opts.md, "moe_ops training benchmark (forward + backward)", env, legend,
                    bm.md_table(header, rows),
                    bm.md_table(DETAIL_HEADER, detail_rows(cells, impl_names)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
