"""Forward benchmark of moe.dispatch against the baselines of shared/BENCHMARK.md.

For every (shape, T): route with torch.ops.moe.route, check every implementation against a float64
reference, time it with triton.testing.do_bench (median) eagerly and, for T <= 128 (all T with
--graph-all), as a CUDA-graph replay; measure the copy-bandwidth and matmul ceilings in the same
run and report floor / time. The table comes last; --plot draws floor / time against T.

    moe-ops-bench                       # full run (H200: ~8 minutes)
    moe-ops-bench --shapes olmoe --tokens 1 128 --impls moe_ops torch_grouped_mm
    moe-ops-bench --tiny                # tiny shapes, CPU smoke test
    moe-ops-bench --csv out.csv --md out.md --plot out.png   # --plot needs matplotlib

(`python benchmarks/bench_moe.py` runs the same, from a source checkout.)
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import gc
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Callable, Optional

import torch

import moe_ops  # registers torch.ops.moe.*
from moe_ops import _env, _features
from moe_ops.tools import baselines as bl
from moe_ops.tools._timing import capture_graph  # noqa: F401  (re-exported)
from moe_ops.tools._cli import device as cli_device
from moe_ops.tools._cli import output_file, positive, token_count
from moe_ops.reference import dispatch_reference


# --------------------------------------------------------------------------------------------
# Problem shapes
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    H: int
    I: int
    E: int
    K: int
    scoring: str = "softmax"
    renormalize: bool = True
    num_groups: int = 1
    topk_groups: int = 1
    scale: float = 1.0
    zipf: float = 0.0          # > 0: logits drawn so expert load falls off like Zipf(zipf)
    bias: bool = False         # DeepSeek-V3 e_score_correction_bias
    # gpt-oss experts: biases, swiglu_oai, interleaved gate/up rows, weights as transposed views
    # of the checkpoint's [E, H, 2I] / [E, I, H] storage (moe_ops only: the baselines compute
    # Mixtral-style experts)
    gpt_oss_experts: bool = False


SHAPES = {
    "mixtral_8x7b": Shape("mixtral_8x7b", 4096, 14336, 8, 2),
    "qwen3_30b_a3b": Shape("qwen3_30b_a3b", 2048, 768, 128, 8),
    "qwen3_30b_a3b_zipf": Shape("qwen3_30b_a3b_zipf", 2048, 768, 128, 8, zipf=1.2),
    "deepseek_v3_routed": Shape("deepseek_v3_routed", 7168, 2048, 256, 8, scoring="sigmoid",
                                num_groups=8, topk_groups=4, scale=2.5, bias=True),
    "olmoe": Shape("olmoe", 2048, 1024, 64, 8, renormalize=False),
    "gpt_oss_20b": Shape("gpt_oss_20b", 2880, 2880, 32, 4, gpt_oss_experts=True),
}
# Same experts, top-k and routing; H and I cut down (odd I on purpose) so a CPU runs them in seconds.
TINY_HI = {"mixtral_8x7b": (64, 56), "qwen3_30b_a3b": (32, 24), "qwen3_30b_a3b_zipf": (32, 24),
           "deepseek_v3_routed": (64, 40), "olmoe": (32, 24), "gpt_oss_20b": (32, 24)}
TOKENS = [1, 8, 32, 128, 512, 2048, 8192]
TINY_TOKENS = [1, 8, 33]

IMPLS = ["moe_ops", "torch_grouped_mm", "expert_loop", "hf_eager", "hf_grouped_mm", "hf_batched_mm"]
SHORT = {"moe_ops": "moe_ops", "torch_grouped_mm": "torch_gmm", "expert_loop": "loop",
         "hf_eager": "hf_eager", "hf_grouped_mm": "hf_gmm", "hf_batched_mm": "hf_bmm"}
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 5e-3}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def moe_ops_dispatch(hidden, w13, w2, topk_weights, topk_ids, **variant):
    return torch.ops.moe.dispatch(hidden, w13, w2, topk_weights, topk_ids, **variant)


def implementations() -> dict[str, bl.Baseline]:
    impls = {"moe_ops": bl.Baseline("moe_ops", moe_ops_dispatch, capturable=True)}
    for b in bl.baselines():
        impls[b.name] = b
    return impls


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------

class Timer:
    """Median milliseconds per call: triton.testing.do_bench on CUDA (L2 flushed between calls),
    time.perf_counter around synchronised calls elsewhere. On CUDA at least `min_samples` timed
    calls: do_bench times rep_ms / (its estimate) calls, a single one for a call longer than
    rep_ms, so rep (and warm-up) are stretched to the call's duration."""

    def __init__(self, device: torch.device, warmup_ms: float, rep_ms: float, min_samples: int = 5):
        self.device, self.warmup_ms, self.rep_ms = device, warmup_ms, rep_ms
        self.min_samples = min_samples

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, fn: Callable[[], object]) -> float:
        if self.device.type == "cuda":
            import triton.testing

            warmup, rep = self.warmup_ms, self.rep_ms
            if self.min_samples > 1:
                est = self.once(fn)
                if est * self.min_samples > rep:
                    rep = 1.1 * est * self.min_samples
                    warmup = max(warmup, est)
            return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep,
                                                 return_mode="median"))
        t_end = time.perf_counter() + self.warmup_ms * 1e-3
        fn()
        while time.perf_counter() < t_end:
            fn()
        times = []
        t_end = time.perf_counter() + self.rep_ms * 1e-3
        while len(times) < 3 or (time.perf_counter() < t_end and len(times) < 1000):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    def once(self, fn: Callable[[], object]) -> float:
        """Milliseconds of one synchronised call (for the time budget)."""
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return (time.perf_counter() - t0) * 1e3


# --------------------------------------------------------------------------------------------
# Environment and ceilings
# --------------------------------------------------------------------------------------------

def log(msg: str = "") -> None:
    print(msg, flush=True)


def start_run(device: torch.device, opts, cpu_note: str):
    """The opening of a benchmark run (moe-ops-bench, benchmarks/bench_train.py): prints the
    environment (and `cpu_note` off CUDA), measures the ceilings. Returns (env, timer, copy
    bandwidth, matmul rate); env ends with the ceilings entry."""
    env = environment(device)
    for k, v in env:
        log(f"{k:13s} {v}")
    if device.type != "cuda":
        log(f"{'note':13s} {cpu_note}")
        if not opts.tiny:
            log(f"{'warning':13s} full-size shapes on CPU are very slow; --tiny is the CPU smoke test")
    timer = Timer(device, opts.warmup_ms, opts.rep_ms)
    bw, rate, ceil_desc = measure_ceilings(device, timer, opts.tiny)
    env.append(("ceilings", ceil_desc))
    log(f"{'ceilings':13s} {ceil_desc}")
    return env, timer, bw, rate


def kernel_times_us(fn: Callable[[], object], n: int = 3, name_len: int = 28) -> dict[str, float]:
    """GPU time per call of each CUDA kernel `fn` launches (also inside a CUDA-graph replay),
    in microseconds, from torch.profiler over n calls; largest first."""
    import collections

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    acc = collections.defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            acc[ev.name.split("(")[0][:name_len]] += ev.device_time_total / n
    return dict(sorted(acc.items(), key=lambda kv: -kv[1]))


def git_sha() -> str:
    """The checkout's commit (with -dirty for uncommitted changes to tracked files), when moe_ops
    is imported from a git checkout; "unknown" for an installed copy (whose site-packages may sit
    inside some other repository)."""
    if _env.commit():   # a copied tree without .git
        return _env.commit()
    root = os.path.dirname(os.path.dirname(os.path.abspath(moe_ops.__file__)))
    try:
        git = lambda *a: subprocess.run(["git", *a], cwd=root, capture_output=True,  # noqa: E731
                                        text=True, check=True).stdout.strip()
        if os.path.realpath(git("rev-parse", "--show-toplevel")) != os.path.realpath(root):
            return "unknown"
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return git("rev-parse", "--short=12", "HEAD") + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def environment(device: torch.device) -> list[tuple[str, str]]:
    import triton

    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        dev = f"{p.name} ({p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB)"
        cuda = torch.version.cuda or "?"
    else:
        dev = f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"
        cuda = "-"
    return [
        ("date", datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")),
        ("device", dev),
        ("torch", f"{torch.__version__} (CUDA {cuda})"),
        ("triton", triton.__version__),
        ("triton features", ", ".join(f"{k}={v}" for k, v in _features.summary().items()
                                      if k != "triton")),
        ("transformers", bl.transformers_version() or "not installed"),
        ("moe_ops", f"{moe_ops.__version__} @ {git_sha()}"),
        ("python", platform.python_version()),
    ]


def _copy_bandwidth(device, timer: Timer, n_bytes: int) -> float:
    src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * n_bytes / (timer(lambda: dst.copy_(src)) * 1e-3)


def _matmul_rate(device, timer: Timer, n: int) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    c = torch.empty(n, n, dtype=torch.bfloat16, device=device)
    return 2 * n ** 3 / (timer(lambda: torch.mm(a, b, out=c)) * 1e-3)


def measure_ceilings(device: torch.device, timer: Timer, tiny: bool) -> tuple[float, float, str]:
    """(copy bandwidth bytes/s counting read + write, bf16 matmul FLOP/s, description), each the
    best of three timings: the first matmul timing of a fresh process on the H200 came out
    692 TFLOP/s against 744-791 for the next five (2026-12-02), which would have inflated every
    roofline fraction of that run by ~13%."""
    n_bytes = (64 << 20) if tiny else (1 << 30)
    n = 1024 if tiny else 8192
    bw = max(_copy_bandwidth(device, timer, n_bytes) for _ in range(3))
    rate = max(_matmul_rate(device, timer, n) for _ in range(3))
    desc = (f"copy {n_bytes >> 20} MiB d2d: {bw / 1e12:.3f} TB/s (read+write); "
            f"bf16 {n}^3 matmul: {rate / 1e12:.1f} TFLOP/s")
    return bw, rate, desc


# --------------------------------------------------------------------------------------------
# Problem data
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Weights:
    w13: torch.Tensor
    w2: torch.Tensor
    gate: torch.Tensor                 # [H, E] float32 router
    bias: Optional[torch.Tensor]       # [E] float32
    zipf_logp: Optional[torch.Tensor]  # [E] log-probabilities of the Zipf load
    w13_bias: Optional[torch.Tensor] = None   # gpt-oss experts: [E, 2I]
    w2_bias: Optional[torch.Tensor] = None    # gpt-oss experts: [E, H]

    def expert_kwargs(self, s: Shape) -> dict:
        """moe.dispatch's variant arguments for the shape's experts ({} for Mixtral-style)."""
        if not s.gpt_oss_experts:
            return {}
        return dict(activation="swiglu_oai", gate_up_interleaved=True, w13_bias=self.w13_bias,
                    w2_bias=self.w2_bias)


def make_weights(s: Shape, device, dtype, seed: int) -> Weights:
    g = torch.Generator(device=device).manual_seed(seed)
    if s.gpt_oss_experts:   # the checkpoint's storage, passed as transposed views (no copy)
        w13 = torch.randn(s.E, s.H, 2 * s.I, generator=g, device=device,
                          dtype=dtype).mul_(0.02).transpose(1, 2)
        w2 = torch.randn(s.E, s.I, s.H, generator=g, device=device,
                         dtype=dtype).mul_(0.02).transpose(1, 2)
    else:
        w13 = torch.randn(s.E, 2 * s.I, s.H, generator=g, device=device, dtype=dtype).mul_(0.02)
        w2 = torch.randn(s.E, s.H, s.I, generator=g, device=device, dtype=dtype).mul_(0.02)
    # std 1/sqrt(H): logits of standard-normal tokens come out ~N(0, 1).
    gate = torch.randn(s.H, s.E, generator=g, device=device).div_(math.sqrt(s.H))
    # A real e_score_correction_bias balances the load; a random one of sigmoid-score size would
    # skew it (std 0.1 left 24 of 256 experts idle at T=8192), so keep it tiny: routing stays
    # near-uniform, as in BENCHMARK.md's floors, and the op's bias argument is still exercised.
    bias = torch.randn(s.E, generator=g, device=device).mul_(1e-3) if s.bias else None
    zipf_logp = None
    if s.zipf > 0:
        ranks = torch.randperm(s.E, generator=g, device=device).double() + 1  # hot experts scattered
        p = ranks.pow(-s.zipf)
        zipf_logp = (p / p.sum()).log().float()
    biases = {}
    if s.gpt_oss_experts:
        biases = dict(
            w13_bias=torch.randn(s.E, 2 * s.I, generator=g, device=device).mul_(0.02).to(dtype),
            w2_bias=torch.randn(s.E, s.H, generator=g, device=device).mul_(0.02).to(dtype))
    return Weights(w13, w2, gate, bias, zipf_logp, **biases)


def make_tokens(s: Shape, wt: Weights, T: int, device, dtype, seed: int):
    """(hidden [T, H], router_logits [T, E] float32)."""
    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(T, s.H, generator=g, device=device, dtype=dtype)
    if wt.zipf_logp is not None:
        # Gumbel top-k: log p + Gumbel noise selects K distinct experts per token with
        # probabilities proportional to p (sampling without replacement), so per-expert load
        # follows the Zipf law (flattened at the head by the at-most-once-per-token rule).
        u = torch.rand(T, s.E, generator=g, device=device).clamp_(1e-20, 1 - 1e-7)
        logits = wt.zipf_logp[None, :] - torch.log(-torch.log(u))
    else:
        logits = hidden.float() @ wt.gate
    return hidden, logits


def route(s: Shape, logits: torch.Tensor, bias: Optional[torch.Tensor]):
    return torch.ops.moe.route(logits, s.K, s.scoring, s.renormalize, bias, s.num_groups,
                               s.topk_groups, s.scale)


@dataclasses.dataclass
class CellInputs:
    """One (shape, T) cell's benchmark inputs, routed (benchmarks/ scripts time these)."""
    name: str
    T: int
    shape: Shape
    weights: Weights
    hidden: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor


def cell_inputs(cell: str, device, dtype, weights: Optional[Weights] = None) -> CellInputs:
    """'shape:T' -> that cell's inputs as the bench makes them (weights seed 0, tokens seed 1,
    the shape's routing); `weights` reuses weights already made for the shape."""
    name, T = cell.split(":")
    T = int(T)
    s = SHAPES[name]
    wt = make_weights(s, device, dtype, seed=0) if weights is None else weights
    hidden, logits = make_tokens(s, wt, T, device, dtype, seed=1)
    tw, ids = route(s, logits, wt.bias)
    return CellInputs(name, T, s, wt, hidden, tw, ids)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    num = (out.double() - ref).norm().item()
    den = ref.norm().item()
    return num / den if den > 0 else num


# --------------------------------------------------------------------------------------------
# One cell
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Result:
    shape: str
    T: int
    impl: str
    status: str = "ok"        # ok | FAIL | skip | n/a | ERR | OOM
    note: str = ""
    rel_err: Optional[float] = None
    graph_rel_err: Optional[float] = None
    eager_us: Optional[float] = None
    graph_us: Optional[float] = None

    @property
    def best_us(self) -> Optional[float]:
        ts = [t for t in (self.eager_us, self.graph_us) if t is not None]
        return min(ts) if ts else None

    @property
    def best_how(self) -> str:
        if self.best_us is None:
            return ""
        return "graph" if self.graph_us is not None and self.graph_us == self.best_us else "eager"


@dataclasses.dataclass
class Cell:
    shape: str
    T: int
    floor_us: float
    bytes: int
    flops: int
    hit: int
    max_load: float               # busiest expert's slots / mean slots per hit expert
    route_eager_us: Optional[float]
    route_graph_us: Optional[float]
    checked: bool
    results: dict


def _short_exc(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:120] if str(exc).strip() else ''}"


def run_impl(name: str, b: bl.Baseline, args_for: Callable, ref: Optional[torch.Tensor], tol: float,
             timer: Timer, use_graph: bool, opts, s: Shape, T: int, skip_reason: Optional[str]) -> Result:
    r = Result(s.name, T, name)
    if skip_reason:
        r.status, r.note = "skip", skip_reason
        return r
    call_args = args_for(b)
    fn = lambda: b.fn(*call_args)  # noqa: E731
    try:
        out = fn()
        timer.sync()
        if ref is not None:
            r.rel_err = rel_err(out, ref)
            if not (r.rel_err <= tol):
                r.status, r.note = "FAIL", f"rel err {r.rel_err:.2e} > {tol:.0e}"
        del out
        one = timer.once(fn)
        if one > opts.max_call_ms:
            r.status, r.note = "skip", f"one call {one:.0f} ms > budget {opts.max_call_ms:.0f} ms"
            return r
        r.eager_us = timer(fn) * 1e3
    except torch.cuda.OutOfMemoryError as exc:
        r.status, r.note = "OOM", _short_exc(exc)
        return r
    except Exception as exc:  # noqa: BLE001 - a baseline's failure is a result, not a crash
        r.status, r.note = "ERR", _short_exc(exc)
        return r
    if use_graph and b.capturable:
        graph = out = None
        try:
            graph, out = capture_graph(fn)
            graph.replay()
            timer.sync()
            if ref is not None:
                r.graph_rel_err = rel_err(out, ref)
                if not (r.graph_rel_err <= tol):
                    r.status = "FAIL"
                    r.note = (r.note + "; " if r.note else "") + f"graph rel err {r.graph_rel_err:.2e}"
            r.graph_us = timer(graph.replay) * 1e3
        except Exception as exc:  # noqa: BLE001
            r.note = (r.note + "; " if r.note else "") + "graph: " + _short_exc(exc)
        finally:
            del graph, out
    return r


def floor_terms(s: Shape, T: int, experts_hit: int, esize: int) -> tuple[int, int]:
    """(bytes, flops) of one forward call, BENCHMARK.md's floor: the weights of the experts hit
    plus the activations in and out; 2*T*K*3*H*I flops."""
    n_bytes = 3 * s.H * s.I * esize * experts_hit + 2 * T * s.H * esize
    return n_bytes, 2 * T * s.K * 3 * s.H * s.I


def run_cell(s: Shape, wt: Weights, T: int, impls: dict, unavailable: dict, over_budget: dict,
             opts, device, dtype, timer: Timer, bw: float, rate: float, log) -> Cell:
    """Routes T tokens, times routing, checks and times every implementation on them."""
    hidden, logits = make_tokens(s, wt, T, device, dtype, seed=opts.seed * 1000 + T)
    topk_weights, topk_ids = route(s, logits, wt.bias)
    ids64 = topk_ids.long()
    counts = torch.bincount(ids64.flatten(), minlength=s.E)
    hit = int((counts > 0).sum().item())
    max_load = counts.max().item() / (T * s.K / hit)
    esize = hidden.element_size()
    n_bytes, flops = floor_terms(s, T, hit, esize)
    floor_us = max(n_bytes / bw, flops / rate) * 1e6
    use_graph = device.type == "cuda" and not opts.no_graph and (opts.graph_all or T <= 128)

    # Routing, timed on its own.
    route_eager = route_graph = None
    try:
        route_eager = timer(lambda: route(s, logits, wt.bias)) * 1e3
        if use_graph:
            graph, _ = capture_graph(lambda: route(s, logits, wt.bias))
            route_graph = timer(graph.replay) * 1e3
    except Exception as exc:  # noqa: BLE001
        log(f"  route timing failed: {_short_exc(exc)}")

    # The float64 reference (bf16 weights are converted expert by expert, on the device).
    ref = None
    checked = flops <= opts.check_max_gflop * 1e9
    if checked:
        ref = dispatch_reference(hidden.double(), wt.w13, wt.w2, topk_weights, topk_ids,
                                 **wt.expert_kwargs(s))

    def args_for(b: bl.Baseline):
        return (hidden, wt.w13, wt.w2, topk_weights, ids64 if b.int64_ids else topk_ids)

    results = {}
    variant = wt.expert_kwargs(s)
    for name, b in impls.items():
        if name in unavailable:
            results[name] = Result(s.name, T, name, status="n/a", note=unavailable[name])
            continue
        if variant and name != "moe_ops":
            results[name] = Result(s.name, T, name, status="n/a",
                                   note="computes Mixtral-style experts only")
            continue
        if variant:
            b = dataclasses.replace(b, fn=lambda *a, _fn=b.fn: _fn(*a, **variant))
        skip = over_budget.get(name)
        if skip is None and b.gathers_weights:
            gathered = T * s.K * 3 * s.H * s.I * esize
            if gathered > opts.max_gather_gib * 2**30:
                skip = f"would gather {gathered / 2**30:.1f} GiB of weights > {opts.max_gather_gib} GiB"
        r = run_impl(name, b, args_for, ref, TOLERANCE[dtype], timer, use_graph, opts, s, T, skip)
        if r.status == "skip" and name not in over_budget and "budget" in r.note:
            over_budget[name] = f"over budget at T={T}"
        if r.status == "OOM" and device.type == "cuda":
            torch.cuda.empty_cache()
        results[name] = r
    return Cell(s.name, T, floor_us, n_bytes, flops, hit, max_load, route_eager, route_graph,
                checked, results)


def run_shape(s: Shape, tokens: list[int], impls: dict, unavailable: dict, opts, device, dtype,
              timer: Timer, bw: float, rate: float, log) -> list[Cell]:
    """Every T of one shape on one set of weights (made here, freed on return)."""
    t0 = time.perf_counter()
    wt = make_weights(s, device, dtype, seed=opts.seed)
    mib = (wt.w13.nbytes + wt.w2.nbytes) / 2**20
    log(f"\n== {s.name}: H={s.H} I={s.I} E={s.E} K={s.K} {s.scoring}"
        f"{' zipf(%.1f)' % s.zipf if s.zipf else ''}  weights {mib:.1f} MiB"
        f" ({time.perf_counter() - t0:.1f} s to make)")
    over_budget: dict[str, str] = {}   # impl -> reason: once too slow, larger T are skipped too
    cells = []
    for T in tokens:
        cell = run_cell(s, wt, T, impls, unavailable, over_budget, opts, device, dtype, timer, bw,
                        rate, log)
        cells.append(cell)
        log(format_progress(cell) + f"  [{time.perf_counter() - opts.t_start:.0f} s]")
    return cells


def free_memory(device: torch.device) -> None:
    """Between shapes: drop the transformers modules (they hold the weights) and cached blocks."""
    bl.clear_caches()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------

def fmt_us(t: Optional[float]) -> str:
    if t is None:
        return "-"
    return f"{t:.0f}" if t >= 100 else f"{t:.1f}"


def fmt_result(r: Result, both: bool = False) -> str:
    if r.status in ("skip", "n/a", "ERR", "OOM"):
        return r.status
    if r.status == "FAIL":
        return "FAIL"
    if both:
        return f"{fmt_us(r.eager_us)}/{fmt_us(r.graph_us)}"
    return fmt_us(r.best_us) + ("g" if r.best_how == "graph" else "")


def best_baseline(cell: Cell) -> Optional[Result]:
    ok = [r for n, r in cell.results.items() if n != "moe_ops" and r.status == "ok" and r.best_us]
    return min(ok, key=lambda r: r.best_us) if ok else None


def summary_row(cell: Cell, impl_names: list[str]) -> list[str]:
    mo = cell.results.get("moe_ops")
    bb = best_baseline(cell)
    row = [cell.shape, str(cell.T), fmt_us(cell.floor_us),
           f"{fmt_us(cell.route_eager_us)}/{fmt_us(cell.route_graph_us)}"]
    for n in impl_names:
        r = cell.results[n]
        row.append(fmt_result(r, both=(n == "moe_ops")))
    mo_ok = mo is not None and mo.status == "ok" and mo.best_us
    row.append(f"{SHORT[bb.impl]} {fmt_us(bb.best_us)}" if bb else "-")
    row.append(f"{bb.best_us / mo.best_us:.2f}x" if (mo_ok and bb) else "-")
    row.append(f"{100 * cell.floor_us / mo.best_us:.0f}%" if mo_ok else "-")
    return row


def summary_header(impl_names: list[str]) -> list[str]:
    cols = ["shape", "T", "floor", "route e/g"]
    for n in impl_names:
        cols.append("moe_ops e/g" if n == "moe_ops" else SHORT[n])
    return cols + ["best baseline", "speedup", "floor/moe_ops"]


def text_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(header[i]), *(len(r[i]) for r in rows)) if rows else len(header[i])
              for i in range(len(header))]
    line = lambda cols: "  ".join(c.rjust(w) if i > 0 else c.ljust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(cols, widths)))
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def md_table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def format_progress(cell: Cell) -> str:
    parts = []
    for n, r in cell.results.items():
        if r.status == "ok":
            parts.append(f"{SHORT[n]} {fmt_us(r.eager_us)}/{fmt_us(r.graph_us)}")
        else:
            parts.append(f"{SHORT[n]} {r.status}")
    err = ""
    mo = cell.results.get("moe_ops")
    if mo is not None and mo.rel_err is not None:
        err = f" err {mo.rel_err:.1e}"
    return (f"  T={cell.T:<5} hit {cell.hit:>3} max/mean load {cell.max_load:4.1f} "
            f"floor {fmt_us(cell.floor_us)} us"
            f" route {fmt_us(cell.route_eager_us)}/{fmt_us(cell.route_graph_us)}{err} | " + ", ".join(parts))


def detail_rows(cells: list[Cell], impl_names: list[str]) -> list[list[str]]:
    rows = []
    for c in cells:
        for n in impl_names:
            r = c.results[n]
            rows.append([c.shape, str(c.T), n, r.status, fmt_us(r.eager_us), fmt_us(r.graph_us),
                         f"{r.rel_err:.1e}" if r.rel_err is not None else "-",
                         f"{100 * c.floor_us / r.best_us:.0f}%" if r.best_us else "-", r.note])
    return rows


DETAIL_HEADER = ["shape", "T", "impl", "status", "eager us", "graph us", "rel err", "floor/time", "note"]


def write_csv_rows(path: str, env, header: list[str], rows) -> None:
    """The CSV layout of the benchmarks: `# key, value` environment lines, a header, the rows."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        for k, v in env:
            w.writerow([f"# {k}", v])
        w.writerow(header)
        w.writerows(rows)


def write_csv(path: str, cells: list[Cell], impl_names: list[str], env) -> None:
    header = ["shape", "T", "impl", "status", "eager_us", "graph_us", "best_us", "best_how",
              "rel_err", "graph_rel_err", "floor_us", "floor_fraction", "bytes", "flops",
              "experts_hit", "max_over_mean_load", "route_eager_us", "route_graph_us", "note"]
    rows = ([c.shape, c.T, n, r.status, _num(r.eager_us), _num(r.graph_us), _num(r.best_us),
             r.best_how, _num(r.rel_err), _num(r.graph_rel_err), _num(c.floor_us),
             _num(c.floor_us / r.best_us if r.best_us else None), c.bytes, c.flops, c.hit,
             _num(c.max_load), _num(c.route_eager_us), _num(c.route_graph_us), r.note]
            for c in cells for n in impl_names for r in (c.results[n],))
    write_csv_rows(path, env, header, rows)


def _num(x) -> str:
    return "" if x is None else f"{x:.6g}"


# --------------------------------------------------------------------------------------------
# Plot (--plot; matplotlib is optional and imported only here)
# --------------------------------------------------------------------------------------------

def roofline_series(cells: list[Cell], impl_names: list[str]) -> dict[str, dict[str, tuple]]:
    """{shape: {impl: (Ts, floor / best time)}} in run order: the table's figures (each impl's
    better of eager and graph replay). A cell without a checked timing (skip, n/a, ERR, OOM, FAIL)
    is NaN, a gap in the line; an impl with no timing in a shape has no line there."""
    out: dict[str, dict[str, tuple]] = {}
    for shape in dict.fromkeys(c.shape for c in cells):
        of_shape = [c for c in cells if c.shape == shape]
        lines = out[shape] = {}
        for n in impl_names:
            fracs = [c.floor_us / r.best_us if r.status == "ok" and r.best_us else math.nan
                     for c in of_shape for r in [c.results[n]]]
            if any(not math.isnan(f) for f in fracs):
                lines[n] = ([c.T for c in of_shape], fracs)
    return out


def write_plot(path: str, cells: list[Cell], impl_names: list[str], env, dtype: str) -> None:
    """One subplot per shape: floor / time against T (log2), one line per implementation."""
    from matplotlib.figure import Figure   # no pyplot: no GUI backend, no global state
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter, NullLocator

    series = roofline_series(cells, impl_names)
    ncols = max(1, min(len(series), 3))
    nrows = max(1, math.ceil(len(series) / ncols))
    fig = Figure(figsize=(5.2 * ncols, 3.8 * nrows + 1.0), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    handles = {}
    for ax, (shape, lines) in zip(axes, series.items()):
        Ts = sorted({c.T for c in cells if c.shape == shape})
        ax.set_title(shape)
        ax.set_xlabel("T (tokens)")
        ax.set_ylabel("floor / time")
        ax.set_xscale("log", base=2)
        ax.set_xticks(Ts, [str(T) for T in Ts])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlim(Ts[0] / 1.3, Ts[-1] * 1.3)   # every T of the run, timed or not
        if not lines:
            ax.text(0.5, 0.5, "no timings", ha="center", va="center", transform=ax.transAxes)
            ax.set_yticks([])
            continue
        for n, (xs, ys) in lines.items():
            (h,) = ax.plot(xs, ys, marker="o", markersize=4, color=f"C{IMPLS.index(n)}",
                           linewidth=2.4 if n == "moe_ops" else 1.3, label=n)
            handles.setdefault(n, h)
        ax.axhline(1.0, color="0.4", linestyle="--", linewidth=0.8)   # at the floor
        ax.set_yscale("log")   # baselines sit 1-3 decades below moe_ops at small T
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{100 * y:.3g}%"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.grid(True, which="major", alpha=0.3)
    for ax in axes[len(series):]:
        ax.set_visible(False)
    e = dict(env)
    fig.suptitle(f"moe_ops forward, {dtype}: floor / time (better of eager and CUDA-graph replay)\n"
                 f"{e.get('device', '?')}, moe_ops {e.get('moe_ops', '?')}, {e.get('date', '')}",
                 fontsize=10)
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="outside lower center",
                   ncols=min(len(handles), 6), frameon=False)
    fig.savefig(path, dpi=120)


# --------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="moe-ops-bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), help="default: all")
    p.add_argument("--tokens", nargs="+", type=token_count,
                   help=f"default: {TOKENS} ({TINY_TOKENS} with --tiny)")
    p.add_argument("--impls", nargs="+", choices=IMPLS, help="default: all")
    p.add_argument("--tiny", action="store_true",
                   help="tiny H and I (same E, K, routing), few reps: a smoke test that runs on CPU")
    p.add_argument("--no-graph", action="store_true", help="no CUDA-graph timing")
    p.add_argument("--graph-all", action="store_true", help="CUDA-graph timing at every T (default T <= 128)")
    p.add_argument("--csv", metavar="PATH", help="write every (shape, T, impl) result as CSV")
    p.add_argument("--md", metavar="PATH", help="write the environment and tables as Markdown")
    p.add_argument("--plot", metavar="PATH.png",
                   help="plot floor / time against T, one subplot per shape and one line per "
                        "implementation (needs matplotlib: pip install matplotlib)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--warmup-ms", type=float, default=None,
                   help="do_bench warmup (default 10; 2 with --tiny)")
    p.add_argument("--rep-ms", type=float, default=None, help="do_bench rep (default 50; 20 with --tiny)")
    p.add_argument("--max-call-ms", type=float, default=None,
                   help="per-impl time budget: an impl whose single call takes longer is skipped at "
                        "this T and at every larger T of the shape (default 300 on CUDA, 3000 on CPU)")
    p.add_argument("--max-gather-gib", type=float, default=16.0,
                   help="skip transformers batched_mm when its gathered weight copy exceeds this "
                        "(default 16)")
    p.add_argument("--check-max-gflop", type=float, default=None,
                   help="skip the float64 check above this many GFLOP per call "
                        "(default: no limit on CUDA, 20 on CPU)")
    p.add_argument("--seed", type=int, default=0)
    opts = p.parse_args(argv)
    opts.device = cli_device(p, opts.device)
    positive(p, opts, "warmup_ms", "rep_ms", "max_call_ms")
    # Refuse before benchmarking (minutes) what would fail only when the results are written.
    plot_types = None
    if opts.plot:
        try:
            import matplotlib.figure
        except ImportError:
            p.error("--plot needs matplotlib: pip install matplotlib")
        plot_types = tuple(matplotlib.figure.Figure().canvas.get_supported_filetypes())
    output_file(p, "--csv", opts.csv)
    output_file(p, "--md", opts.md)
    output_file(p, "--plot", opts.plot, plot_types)
    return opts


def resolve_device(name) -> torch.device:
    """The device to benchmark on (CUDA when present), with its index made current."""
    device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def main(argv=None) -> int:
    opts = parse_args(argv)
    device = resolve_device(opts.device)
    dtype = DTYPES[opts.dtype]
    if opts.warmup_ms is None:
        opts.warmup_ms = 2.0 if opts.tiny else 10.0
    if opts.rep_ms is None:
        opts.rep_ms = 20.0 if opts.tiny else 50.0
    if opts.max_call_ms is None:
        opts.max_call_ms = 300.0 if device.type == "cuda" else 3000.0
    if opts.check_max_gflop is None:
        opts.check_max_gflop = math.inf if device.type == "cuda" else 20.0
    shape_names = opts.shapes or list(SHAPES)
    shapes = [SHAPES[n] for n in shape_names]
    if opts.tiny:
        shapes = [dataclasses.replace(s, H=TINY_HI[s.name][0], I=TINY_HI[s.name][1]) for s in shapes]
    tokens = opts.tokens or (TINY_TOKENS if opts.tiny else TOKENS)
    impl_names = opts.impls or IMPLS
    impl_names = [n for n in IMPLS if n in impl_names]

    env, timer, bw, rate = start_run(
        device, opts, "no CUDA: timing with time.perf_counter, no CUDA-graph timing; moe_ops runs "
        "its CPU path (torch reference, or the Triton interpreter with TRITON_INTERPRET=1)")

    all_impls = implementations()
    impls = {n: all_impls[n] for n in impl_names}
    unavailable = {}                    # impl -> why it cannot run here
    for n, b in impls.items():
        ok, why = (True, "") if n == "moe_ops" else bl.availability(b, device, dtype)
        if not ok:
            unavailable[n] = why
            log(f"{'unavailable':13s} {n}: {why}")
    graph_desc = ("off" if opts.no_graph or device.type != "cuda"
                  else ("every T" if opts.graph_all else "T <= 128"))
    run_desc = (f"{opts.dtype}, tol {TOLERANCE[dtype]:.0e}, do_bench warmup {opts.warmup_ms:g} ms "
                f"rep {opts.rep_ms:g} ms (median), graph replay {graph_desc}, budget "
                f"{opts.max_call_ms:g} ms/call{', tiny shapes' if opts.tiny else ''}")
    env.append(("run", run_desc))
    log(f"{'run':13s} {run_desc}")

    t_start = opts.t_start = time.perf_counter()
    cells: list[Cell] = []
    for s in shapes:
        cells += run_shape(s, tokens, impls, unavailable, opts, device, dtype, timer, bw, rate, log)
        free_memory(device)
    elapsed = time.perf_counter() - t_start

    header = summary_header(impl_names)
    rows = [summary_row(c, impl_names) for c in cells]
    unchecked = [f"{c.shape} T={c.T}" for c in cells if not c.checked]
    legend = ("times in us (median); 'e/g' = eager/CUDA-graph replay; a baseline shows its better "
              "figure, 'g' = graph; floor = max(bytes/bw, flops/rate); speedup = best baseline / "
              "moe_ops best; FAIL = rel err above tolerance; skip/n/a: see detail")
    log_finish(cells, elapsed, log, "not checked against the float64 reference (over "
               "--check-max-gflop): " + ", ".join(unchecked) if unchecked else "")
    log("")
    log(legend)
    log(text_table(header, rows))

    if opts.csv:
        write_csv(opts.csv, cells, impl_names, env)
    if opts.md:
        write_md(opts.md, "moe_ops forward benchmark", env, legend, md_table(header, rows),
                 md_table(DETAIL_HEADER, detail_rows(cells, impl_names)),
                 "Not checked against the float64 reference: " + ", ".join(unchecked)
                 if unchecked else "")
    if opts.plot:
        write_plot(opts.plot, cells, impl_names, env, opts.dtype)
    return 0


def log_finish(cells, elapsed: float, log, extra: str = "") -> None:
    """The end of a benchmark run's log (moe-ops-bench and benchmarks/bench_train.py): the run
    time, an `extra` line, and a note for every result that is not plainly ok."""
    notes = [f"{c.shape} T={c.T} {r.impl}: {r.status} {r.note}".rstrip()
             for c in cells for r in c.results.values() if r.status != "ok" or r.note]
    log("")
    log(f"finished in {elapsed:.0f} s")
    if extra:
        log(extra)
    if notes:
        log("notes:")
        for n in notes:
            log("  " + n)


def write_md(path, title: str, env, legend: str, summary_md: str, detail_md: str,
             extra: str = "") -> None:
    """A benchmark run as Markdown: the environment, the summary table under its legend, every
    implementation's detail table, and an `extra` closing line."""
    with open(path, "w") as f:
        f.write(f"# {title}\n\n")
        f.write("\n".join(f"- {k}: {v}" for k, v in env) + "\n\n")
        f.write(legend + "\n\n" + summary_md + "\n\n")
        f.write("## Every implementation\n\n" + detail_md + "\n")
        if extra:
            f.write("\n" + extra + "\n")


if __name__ == "__main__":
    sys.exit(main())
