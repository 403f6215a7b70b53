"""Forward benchmark of moe.dispatch against the baselines of shared/BENCHMARK.md.

For every (shape, T): route with torch.ops.moe.route, check every implementation against a float64
reference, time it with triton.testing.do_bench (median) eagerly and, for T <= 128 (all T with
--graph-all), as a CUDA-graph replay; measure the copy-bandwidth and matmul ceilings in the same
run and report floor / time. The table comes last; --plot draws floor / time against T.

    moe-ops-bench                       # full run (H200: ~8 minutes)
    moe-ops-bench --shapes olmoe --tokens 1 128 --impls moe_ops torch_grouped_mm
    moe-ops-bench --tiny                # tiny shapes, CPU smoke test
    moe-ops-bench --csv out.csv --md out.md --plot out.png   # --plot needs matplotlib
    moe-ops-bench --weights fp8         # FP8 block-scaled experts (W8A8); also fp8-w8a16, mxfp4,
                                        # mxfp4-mma (moe_ops on the mma layout of the blocks)

--weights fp8|fp8-w8a16|mxfp4|mxfp4-mma benchmarks quantized expert weights (issue 42): moe_ops on the
quantized weights, dequantize-then-bf16 moe_ops (the dequantization timed), bf16 moe_ops on
weights dequantized ahead of time (a reference point, not a baseline) and rowwise-FP8
torch._scaled_grouped_mm (FP8 only). Errors: against float64 on the dequantized weights with
unquantized activations, and for W8A8 also against the W8A8 reference. Floor: the quantized
bytes (weights of the experts hit + scales + activations in/out) at the copy rate, the flops at
the FP8 torch._scaled_mm rate measured in the run (W8A8) or the bf16 matmul rate (W8A16, MXFP4:
their MMAs run in bf16).

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
from moe_ops.tools import quant_baselines as qb
from moe_ops.tools._timing import capture_graph  # noqa: F401  (re-exported)
from moe_ops.tools._cli import device as cli_device
from moe_ops.tools._cli import output_file, positive, token_count
from moe_ops.reference import dispatch_reference
from moe_ops.reference.quant import quantized_dispatch_reference


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
    # of the checkpoint's [E, H, 2I] / [E, I, H] storage (the baselines are gpt-oss's:
    # baselines.gpt_oss_baselines)
    gpt_oss_experts: bool = False


SHAPES = {
    "mixtral_8x7b": Shape("mixtral_8x7b", 4096, 14336, 8, 2),
    "qwen3_30b_a3b": Shape("qwen3_30b_a3b", 2048, 768, 128, 8),
    "qwen3_30b_a3b_zipf": Shape("qwen3_30b_a3b_zipf", 2048, 768, 128, 8, zipf=1.2),
    "deepseek_v3_routed": Shape("deepseek_v3_routed", 7168, 2048, 256, 8, scoring="sigmoid",
                                num_groups=8, topk_groups=4, scale=2.5, bias=True),
    "olmoe": Shape("olmoe", 2048, 1024, 64, 8, renormalize=False),
    "gpt_oss_20b": Shape("gpt_oss_20b", 2880, 2880, 32, 4, gpt_oss_experts=True),
    "gpt_oss_120b": Shape("gpt_oss_120b", 2880, 2880, 128, 4, gpt_oss_experts=True),
}
# The shapes a run without --shapes takes, per --weights (bf16: every shape but gpt_oss_120b,
# whose experts are gpt_oss_20b's, four times as many).
DEFAULT_SHAPES = {
    "bf16": [n for n in SHAPES if n != "gpt_oss_120b"],
    "fp8": ["deepseek_v3_routed", "qwen3_30b_a3b"],
    "fp8-w8a16": ["deepseek_v3_routed", "qwen3_30b_a3b"],
    "mxfp4": ["gpt_oss_20b", "gpt_oss_120b"],
    "mxfp4-mma": ["gpt_oss_20b", "gpt_oss_120b"],
}
WEIGHTS = list(DEFAULT_SHAPES)
# Same experts, top-k and routing; H and I cut down (odd I on purpose) so a CPU runs them in seconds.
TINY_HI = {"mixtral_8x7b": (64, 56), "qwen3_30b_a3b": (32, 24), "qwen3_30b_a3b_zipf": (32, 24),
           "deepseek_v3_routed": (64, 40), "olmoe": (32, 24), "gpt_oss_20b": (32, 24),
           "gpt_oss_120b": (32, 24)}
TOKENS = [1, 8, 32, 128, 512, 2048, 8192]
TINY_TOKENS = [1, 8, 33]

IMPLS = ["moe_ops", "torch_grouped_mm", "expert_loop", "hf_eager", "hf_grouped_mm", "hf_batched_mm"]
# --weights fp8 | fp8-w8a16 | mxfp4 | mxfp4-mma
QUANT_IMPLS = ["moe_ops", "deq_moe_ops", "predequantized", "scaled_grouped_mm"]
ALL_IMPLS = IMPLS + QUANT_IMPLS[1:]
SHORT = {"moe_ops": "moe_ops", "torch_grouped_mm": "torch_gmm", "expert_loop": "loop",
         "hf_eager": "hf_eager", "hf_grouped_mm": "hf_gmm", "hf_batched_mm": "hf_bmm",
         "deq_moe_ops": "deq+moe_ops", "predequantized": "predeq", "scaled_grouped_mm": "scaled_gmm"}
# Reference points: shown, never the "best baseline" (predequantized: bf16 weights held in memory)
REFERENCE_POINTS = {"predequantized"}
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 5e-3}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def moe_ops_dispatch(hidden, w13, w2, topk_weights, topk_ids, **variant):
    return torch.ops.moe.dispatch(hidden, w13, w2, topk_weights, topk_ids, **variant)


def implementations() -> dict[str, bl.Baseline]:
    impls = {"moe_ops": bl.Baseline("moe_ops", moe_ops_dispatch, capturable=True)}
    for b in bl.baselines():
        impls[b.name] = b
    return impls


def gpt_oss_peers() -> dict[str, bl.Baseline]:
    """The baselines of a gpt_oss_experts shape: gpt-oss's arithmetic, by the same names."""
    return {b.name: b for b in bl.gpt_oss_baselines()}


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


@dataclasses.dataclass
class QuantWeights:
    """--weights fp8 | fp8-w8a16 | mxfp4: the quantized experts, with `dense` holding the router,
    the biases and the weights dequantized ahead of time (moe.dispatch's [E, 2I, H] / [E, H, I]
    layouts, hidden's dtype: the predequantized reference point and the float64 check)."""
    fmt: qb.QuantFormat
    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor
    w2_scale: torch.Tensor
    dense: Weights
    rowwise: Optional[tuple] = None   # (q13, s13, q2, s2) rowwise FP8 for scaled_grouped_mm
    mma: Optional[tuple] = None       # (w13, w2) in the mma layout, for moe_ops (mxfp4-mma)

    def quant_kwargs(self) -> dict:
        return self.fmt.dispatch_kwargs(self.w13_scale, self.w2_scale)


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
    return _with_router(s, w13, w2, g, device, dtype)


def make_quant_weights(s: Shape, fmt: qb.QuantFormat, device, dtype, seed: int,
                       rowwise: bool) -> QuantWeights:
    """Random quantized experts (quant_baselines.random_quantized), their dense copies, the
    shape's router and biases; `rowwise`: also the rowwise-FP8 copies for scaled_grouped_mm."""
    g = torch.Generator(device=device).manual_seed(seed)
    q13, q2, s13, s2 = qb.random_quantized(s.E, s.H, s.I, fmt.fmt, device, g)
    bs = qb.BLOCK_SHAPE if fmt.fmt == "fp8" else None
    d13 = qb.dequantize(q13, s13, bs, dtype)
    d2 = qb.dequantize(q2, s2, bs, dtype)
    rw = None
    if rowwise:
        rw = (*qb.rowwise_fp8(d13), *qb.rowwise_fp8(d2))
    mma = None
    if fmt.mxfp4_layout == "mma":
        from moe_ops.mxfp4_layout import swizzle_mxfp4

        mma = (swizzle_mxfp4(q13), swizzle_mxfp4(q2))
    return QuantWeights(fmt, q13, q2, s13, s2, _with_router(s, d13, d2, g, device, dtype), rw,
                        mma)


def _with_router(s: Shape, w13, w2, g, device, dtype) -> Weights:
    """The experts' Weights with the router, correction bias, Zipf load and biases drawn next
    from `g`."""
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
    w8a8_rel_err: Optional[float] = None   # --weights fp8, moe_ops: vs the W8A8 reference

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
    weights: str = "bf16"


def _short_exc(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:120] if str(exc).strip() else ''}"


def run_impl(name: str, b: bl.Baseline, args_for: Callable, ref: Optional[torch.Tensor], tol: float,
             timer: Timer, use_graph: bool, opts, s: Shape, T: int, skip_reason: Optional[str],
             w8a8_ref: Optional[tuple] = None) -> Result:
    """Checks `b` against `ref` (and the (W8A8 reference, tolerance) `w8a8_ref`), then times it
    eagerly and, where `use_graph` and it captures, as a graph replay. A wrong output is FAIL
    and has no time."""
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
            if not (r.rel_err <= tol):   # a wrong output is reported, never timed
                r.status, r.note = "FAIL", f"rel err {r.rel_err:.2e} > {tol:.0e} (not timed)"
                return r
        if w8a8_ref is not None and w8a8_ref[0] is not None:
            r.w8a8_rel_err = rel_err(out, w8a8_ref[0])
            if not (r.w8a8_rel_err <= w8a8_ref[1]):
                r.status, r.note = "FAIL", (f"W8A8-reference rel err {r.w8a8_rel_err:.2e} > "
                                            f"{w8a8_ref[1]:.0e} (not timed)")
                return r
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
                if not (r.graph_rel_err <= tol):   # wrong in a graph: no time is reported
                    r.status, r.eager_us = "FAIL", None
                    r.note = ((r.note + "; " if r.note else "")
                              + f"graph rel err {r.graph_rel_err:.2e} > {tol:.0e} (not timed)")
                    return r
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


@dataclasses.dataclass
class Routed:
    """One cell's tokens, routing and routing statistics (and routing's own times)."""
    hidden: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    ids64: torch.Tensor
    hit: int
    max_load: float
    route_eager_us: Optional[float]
    route_graph_us: Optional[float]
    use_graph: bool


def route_cell(s: Shape, wt: Weights, T: int, opts, device, dtype, timer: Timer, log) -> Routed:
    """Makes and routes T tokens, counts the experts hit, times routing on its own."""
    hidden, logits = make_tokens(s, wt, T, device, dtype, seed=opts.seed * 1000 + T)
    topk_weights, topk_ids = route(s, logits, wt.bias)
    ids64 = topk_ids.long()
    counts = torch.bincount(ids64.flatten(), minlength=s.E)
    hit = int((counts > 0).sum().item())
    max_load = counts.max().item() / (T * s.K / hit)
    use_graph = device.type == "cuda" and not opts.no_graph and (opts.graph_all or T <= 128)
    route_eager = route_graph = None
    try:
        route_eager = timer(lambda: route(s, logits, wt.bias)) * 1e3
        if use_graph:
            graph, _ = capture_graph(lambda: route(s, logits, wt.bias))
            route_graph = timer(graph.replay) * 1e3
    except Exception as exc:  # noqa: BLE001
        log(f"  route timing failed: {_short_exc(exc)}")
    return Routed(hidden, topk_weights, topk_ids, ids64, hit, max_load, route_eager, route_graph,
                  use_graph)


def run_cell(s: Shape, wt: Weights, T: int, impls: dict, unavailable: dict, over_budget: dict,
             opts, device, dtype, timer: Timer, bw: float, rate: float, log) -> Cell:
    """Routes T tokens, times routing, checks and times every implementation on them."""
    rt = route_cell(s, wt, T, opts, device, dtype, timer, log)
    hidden, topk_weights, topk_ids, ids64 = rt.hidden, rt.topk_weights, rt.topk_ids, rt.ids64
    esize = hidden.element_size()
    n_bytes, flops = floor_terms(s, T, rt.hit, esize)
    floor_us = max(n_bytes / bw, flops / rate) * 1e6

    # The float64 reference (bf16 weights are converted expert by expert, on the device).
    ref = None
    checked = flops <= opts.check_max_gflop * 1e9
    if checked:
        ref = dispatch_reference(hidden.double(), wt.w13, wt.w2, topk_weights, topk_ids,
                                 **wt.expert_kwargs(s))

    def args_for(b: bl.Baseline):
        ids = ids64 if b.int64_ids else topk_ids
        if b.experts == "gpt_oss":   # the checkpoint's [E, H, 2I] / [E, I, H] storage
            return (hidden, wt.w13.transpose(1, 2), wt.w13_bias, wt.w2.transpose(1, 2),
                    wt.w2_bias, topk_weights, ids)
        return (hidden, wt.w13, wt.w2, topk_weights, ids)

    results = {}
    variant = wt.expert_kwargs(s)
    peers = gpt_oss_peers() if s.gpt_oss_experts else {}
    for name, b in impls.items():
        if name in unavailable:
            results[name] = Result(s.name, T, name, status="n/a", note=unavailable[name])
            continue
        if variant and name == "moe_ops":
            b = dataclasses.replace(b, fn=lambda *a, _fn=b.fn: _fn(*a, **variant))
        elif s.gpt_oss_experts:
            b = peers[name]
            ok, why = bl.availability(b, device, dtype)
            if not ok:
                results[name] = Result(s.name, T, name, status="n/a", note=why)
                continue
        skip = over_budget.get(name)
        if skip is None and b.gathers_weights:
            gathered = T * s.K * 3 * s.H * s.I * esize
            if gathered > opts.max_gather_gib * 2**30:
                skip = f"would gather {gathered / 2**30:.1f} GiB of weights > {opts.max_gather_gib} GiB"
        r = run_impl(name, b, args_for, ref, TOLERANCE[dtype], timer, rt.use_graph, opts, s, T,
                     skip)
        _after_impl(name, r, over_budget, device, T)
        results[name] = r
    return Cell(s.name, T, floor_us, n_bytes, flops, rt.hit, rt.max_load, rt.route_eager_us,
                rt.route_graph_us, checked, results)


def _after_impl(name: str, r: Result, over_budget: dict, device, T: int) -> None:
    if r.status == "skip" and name not in over_budget and "budget" in r.note:
        over_budget[name] = f"over budget at T={T}"
    if r.status == "OOM" and device.type == "cuda":
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------
# Quantized weights (--weights fp8 | fp8-w8a16 | mxfp4 | mxfp4-mma)
# --------------------------------------------------------------------------------------------

def quant_floor_terms(s: Shape, T: int, experts_hit: int, esize: int,
                      fmt: qb.QuantFormat) -> tuple[int, int]:
    """(bytes, flops) of one forward call on quantized experts (issue 42): the quantized weights
    of the experts hit with their scales, the activations in and out; 2*T*K*3*H*I flops."""
    n_bytes = qb.quantized_bytes_per_expert(fmt.fmt, s.H, s.I) * experts_hit + 2 * T * s.H * esize
    return n_bytes, 2 * T * s.K * 3 * s.H * s.I


def quant_implementations(qw: QuantWeights, variant: dict) -> dict[str, bl.Baseline]:
    """The implementations of a quantized cell, each called with (hidden, topk_weights,
    topk_ids)."""
    qkw = qw.quant_kwargs()   # (mxfp4_layout: moe_ops' call on qw.mma only)
    bs = qkw["block_shape"]
    dense = qw.dense

    w13, w2 = qw.mma if qw.mma is not None else (qw.w13, qw.w2)

    def moe_ops_quant(hidden, tw, ids):
        return torch.ops.moe.dispatch(hidden, w13, w2, tw, ids, **variant, **qkw)

    def deq_moe_ops(hidden, tw, ids):
        d13 = qb.dequantize(qw.w13, qw.w13_scale, bs, hidden.dtype)
        d2 = qb.dequantize(qw.w2, qw.w2_scale, bs, hidden.dtype)
        return torch.ops.moe.dispatch(hidden, d13, d2, tw, ids, **variant)

    def predequantized(hidden, tw, ids):
        return torch.ops.moe.dispatch(hidden, dense.w13, dense.w2, tw, ids, **variant)

    def scaled_gmm(hidden, tw, ids):
        return qb.scaled_grouped_mm_moe(hidden, *qw.rowwise, tw, ids, **variant)

    return {
        "moe_ops": bl.Baseline("moe_ops", moe_ops_quant, capturable=True),
        # every call allocates and writes the dense weights: eager only (a graph would hold a
        # second dense copy in its pool)
        "deq_moe_ops": bl.Baseline("deq_moe_ops", deq_moe_ops, capturable=False),
        "predequantized": bl.Baseline("predequantized", predequantized, capturable=True),
        "scaled_grouped_mm": bl.Baseline("scaled_grouped_mm", scaled_gmm, capturable=True),
    }


def quant_unavailable(fmt: qb.QuantFormat, device, s: Optional[Shape] = None) -> dict[str, str]:
    """impl -> why it cannot run for this format on this device (and shape)."""
    out = {}
    if fmt.fmt != "fp8":
        out["scaled_grouped_mm"] = "rowwise FP8: an FP8 peer, not an MXFP4 kernel"
    else:
        ok, why = qb.scaled_grouped_mm_status(device)
        if not ok:
            out["scaled_grouped_mm"] = why
    return out


def run_quant_cell(s: Shape, qw: QuantWeights, T: int, impls: list[str], unavailable: dict,
                   over_budget: dict, opts, device, dtype, timer: Timer, bw: float, rate: float,
                   log) -> Cell:
    """A cell on quantized experts: routing as run_cell, every implementation checked against
    float64 on the dequantized weights with unquantized activations (and moe_ops W8A8 against
    the W8A8 reference), then timed."""
    fmt = qw.fmt
    rt = route_cell(s, qw.dense, T, opts, device, dtype, timer, log)
    hidden, tw, ids = rt.hidden, rt.topk_weights, rt.topk_ids
    n_bytes, flops = quant_floor_terms(s, T, rt.hit, hidden.element_size(), fmt)
    floor_us = max(n_bytes / bw, flops / rate) * 1e6
    variant = qw.dense.expert_kwargs(s)
    # the references read the plain blocks (qw.w13, qw.w2): no mxfp4_layout for them
    qkw = {k: v for k, v in qw.quant_kwargs().items() if k != "mxfp4_layout"}

    ref = ref_w8a8 = None
    checked = flops <= opts.check_max_gflop * 1e9
    if checked:
        ref = quantized_dispatch_reference(hidden, qw.w13, qw.w2, tw, ids, **variant, **qkw,
                                           emulate_kernel=False)
        if fmt.w8a8_tol is not None:
            ref_w8a8 = quantized_dispatch_reference(hidden, qw.w13, qw.w2, tw, ids, **variant,
                                                    **qkw, emulate_kernel=True)
    tolerance = {"moe_ops": fmt.tol, "deq_moe_ops": TOLERANCE[dtype],
                 "predequantized": TOLERANCE[dtype], "scaled_grouped_mm": qb.SCALED_GROUPED_MM_TOL}
    all_impls = quant_implementations(qw, variant)
    results = {}
    for name in impls:
        if name in unavailable:
            results[name] = Result(s.name, T, name, status="n/a", note=unavailable[name])
            continue
        b = all_impls[name]
        r = run_impl(name, b, lambda _b: (hidden, tw, ids), ref, tolerance[name], timer,
                     rt.use_graph, opts, s, T, over_budget.get(name),
                     w8a8_ref=(ref_w8a8, fmt.w8a8_tol) if name == "moe_ops" else None)
        _after_impl(name, r, over_budget, device, T)
        results[name] = r
    return Cell(s.name, T, floor_us, n_bytes, flops, rt.hit, rt.max_load, rt.route_eager_us,
                rt.route_graph_us, checked, results, weights=fmt.name)


def run_quant_shape(s: Shape, fmt: qb.QuantFormat, tokens: list[int], impls: list[str], opts,
                    device, dtype, timer: Timer, bw: float, rate: float, log) -> list[Cell]:
    """Every T of one shape on one set of quantized weights (made here, freed on return)."""
    t0 = time.perf_counter()
    unavailable = quant_unavailable(fmt, device, s)
    qw = make_quant_weights(s, fmt, device, dtype, seed=opts.seed,
                            rowwise="scaled_grouped_mm" in impls and "scaled_grouped_mm"
                            not in unavailable)
    mib = (qw.w13.nbytes + qw.w2.nbytes + qw.w13_scale.nbytes + qw.w2_scale.nbytes) / 2**20
    log(f"\n== {s.name} {fmt.name}: H={s.H} I={s.I} E={s.E} K={s.K} {s.scoring}"
        f"{' zipf(%.1f)' % s.zipf if s.zipf else ''}  quantized weights {mib:.1f} MiB"
        f" ({time.perf_counter() - t0:.1f} s to make)")
    for n, why in unavailable.items():
        if n in impls:
            log(f"  {n}: n/a ({why})")
    over_budget: dict[str, str] = {}
    cells = []
    for T in tokens:
        cell = run_quant_cell(s, qw, T, impls, unavailable, over_budget, opts, device, dtype,
                              timer, bw, rate, log)
        cells.append(cell)
        log(format_progress(cell) + f"  [{time.perf_counter() - opts.t_start:.0f} s]")
    return cells


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
    ok = [r for n, r in cell.results.items()
          if n != "moe_ops" and n not in REFERENCE_POINTS and r.status == "ok" and r.best_us]
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
    if cell.weights != "bf16":
        row.append(_err(mo.rel_err if mo else None))
        if cell.weights == "fp8":
            row.append(_err(mo.w8a8_rel_err if mo else None))
    return row


def _err(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.1e}"


def summary_header(impl_names: list[str], weights: str = "bf16") -> list[str]:
    cols = ["shape", "T", "floor", "route e/g"]
    for n in impl_names:
        cols.append("moe_ops e/g" if n == "moe_ops" else SHORT[n])
    cols += ["best baseline", "speedup", "floor/moe_ops"]
    if weights != "bf16":
        cols.append("moe_ops err")
        if weights == "fp8":
            cols.append("err vs W8A8 ref")
    return cols


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
    if mo is not None and mo.w8a8_rel_err is not None:
        err += f" (vs W8A8 ref {mo.w8a8_rel_err:.1e})"
    return (f"  T={cell.T:<5} hit {cell.hit:>3} max/mean load {cell.max_load:4.1f} "
            f"floor {fmt_us(cell.floor_us)} us"
            f" route {fmt_us(cell.route_eager_us)}/{fmt_us(cell.route_graph_us)}{err} | " + ", ".join(parts))


def detail_rows(cells: list[Cell], impl_names: list[str]) -> list[list[str]]:
    rows = []
    for c in cells:
        for n in impl_names:
            r = c.results[n]
            rows.append([c.shape, c.weights, str(c.T), n, r.status, fmt_us(r.eager_us),
                         fmt_us(r.graph_us), _err(r.rel_err), _err(r.w8a8_rel_err),
                         f"{100 * c.floor_us / r.best_us:.0f}%" if r.best_us else "-", r.note])
    return rows


DETAIL_HEADER = ["shape", "weights", "T", "impl", "status", "eager us", "graph us", "rel err",
                 "W8A8-ref err", "floor/time", "note"]


def write_csv_rows(path: str, env, header: list[str], rows) -> None:
    """The CSV layout of the benchmarks: `# key, value` environment lines, a header, the rows."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        for k, v in env:
            w.writerow([f"# {k}", v])
        w.writerow(header)
        w.writerows(rows)


def write_csv(path: str, cells: list[Cell], impl_names: list[str], env) -> None:
    header = ["shape", "weights", "T", "impl", "status", "eager_us", "graph_us", "best_us",
              "best_how", "rel_err", "graph_rel_err", "w8a8_rel_err", "floor_us",
              "floor_fraction", "bytes", "flops", "experts_hit", "max_over_mean_load",
              "route_eager_us", "route_graph_us", "note"]
    rows = ([c.shape, c.weights, c.T, n, r.status, _num(r.eager_us), _num(r.graph_us),
             _num(r.best_us), r.best_how, _num(r.rel_err), _num(r.graph_rel_err),
             _num(r.w8a8_rel_err), _num(c.floor_us),
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


def write_plot(path: str, cells: list[Cell], impl_names: list[str], env, dtype: str,
               weights: str = "bf16") -> None:
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
            (h,) = ax.plot(xs, ys, marker="o", markersize=4, color=f"C{ALL_IMPLS.index(n)}",
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
    what = dtype if weights == "bf16" else f"{weights} weights, {dtype} activations"
    fig.suptitle(f"moe_ops forward, {what}: floor / time (better of eager and CUDA-graph replay)\n"
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
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES),
                   help="default: the --weights' shapes (bf16: all but gpt_oss_120b)")
    p.add_argument("--tokens", nargs="+", type=token_count,
                   help=f"default: {TOKENS} ({TINY_TOKENS} with --tiny)")
    p.add_argument("--impls", nargs="+", choices=ALL_IMPLS,
                   help=f"default: all of the weights' ({', '.join(IMPLS)} for bf16, "
                        f"{', '.join(QUANT_IMPLS)} for quantized weights)")
    p.add_argument("--weights", default="bf16", choices=WEIGHTS,
                   help="expert weights: bf16 (hidden's dtype, default), fp8 (block-scaled "
                        "[128, 128], W8A8), fp8-w8a16 (weight-only), mxfp4 (gpt-oss's MXFP4, "
                        "W4A16); default shapes per weights: "
                        + "; ".join(f"{w}: {' '.join(v)}" for w, v in DEFAULT_SHAPES.items()))
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
    allowed = IMPLS if opts.weights == "bf16" else QUANT_IMPLS
    wrong = [n for n in opts.impls or [] if n not in allowed]
    if wrong:
        p.error(f"--impls {' '.join(wrong)}: not an implementation of --weights {opts.weights} "
                f"(choose from {', '.join(allowed)})")
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
    shape_names = opts.shapes or DEFAULT_SHAPES[opts.weights]
    shapes = [SHAPES[n] for n in shape_names]
    quant = qb.FORMATS.get(opts.weights)
    if opts.tiny:
        shapes = [dataclasses.replace(s, H=TINY_HI[s.name][0], I=TINY_HI[s.name][1]) for s in shapes]
    if quant is not None and quant.fmt == "mxfp4":   # H and I multiples of 32 (mma: 64)
        m = 64 if quant.mxfp4_layout == "mma" else 32
        shapes = [dataclasses.replace(s, H=-(-s.H // m) * m, I=-(-s.I // m) * m)
                  for s in shapes]
    tokens = opts.tokens or (TINY_TOKENS if opts.tiny else TOKENS)
    all_names = IMPLS if quant is None else QUANT_IMPLS
    impl_names = [n for n in all_names if n in (opts.impls or all_names)]

    env, timer, bw, rate = start_run(
        device, opts, "no CUDA: timing with time.perf_counter, no CUDA-graph timing; moe_ops runs "
        "its CPU path (torch reference, or the Triton interpreter with TRITON_INTERPRET=1)")
    if quant is not None:
        cells = run_quant(quant, shapes, tokens, impl_names, opts, device, dtype, env, timer, bw,
                          rate)
        return report(cells, impl_names, opts, env)

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
    opts.elapsed = time.perf_counter() - t_start
    return report(cells, impl_names, opts, env)


def run_quant(fmt: qb.QuantFormat, shapes: list[Shape], tokens: list[int], impl_names: list[str],
              opts, device, dtype, env, timer: Timer, bw: float, bf16_rate: float) -> list[Cell]:
    """--weights fp8 | fp8-w8a16 | mxfp4: the FP8 ceiling (W8A8), then every shape."""
    rate = bf16_rate
    if fmt.fp8_mma:
        # CPU: torch._scaled_mm is emulated (~0.04 GFLOP/s), a token size keeps the run short
        n = (1024 if opts.tiny else 8192) if device.type == "cuda" else 64
        try:
            rate = qb.fp8_matmul_rate(device, timer, n)
            desc = f"fp8 torch._scaled_mm {n}^3: {rate / 1e12:.1f} TFLOP/s (the W8A8 flop floor)"
        except Exception as exc:  # noqa: BLE001 - no FP8 matmul here: say so, charge bf16
            desc = f"fp8 torch._scaled_mm unavailable ({_short_exc(exc)}): flop floor at bf16"
        env[-1] = ("ceilings", env[-1][1] + "; " + desc)
        log(f"{'fp8 ceiling':13s} {desc}")
    run_desc = (f"weights {fmt.name}, activations {opts.dtype}, tol moe_ops {fmt.tol:.0e}"
                + (f" (W8A8 reference {fmt.w8a8_tol:.0e})" if fmt.w8a8_tol else "")
                + f", bf16 moe_ops {TOLERANCE[dtype]:.0e}, scaled_grouped_mm "
                f"{qb.SCALED_GROUPED_MM_TOL:.0e}; do_bench warmup {opts.warmup_ms:g} ms rep "
                f"{opts.rep_ms:g} ms (median), graph replay "
                + ("off" if opts.no_graph or device.type != "cuda"
                   else ("every T" if opts.graph_all else "T <= 128"))
                + f", budget {opts.max_call_ms:g} ms/call{', tiny shapes' if opts.tiny else ''}")
    env.append(("run", run_desc))
    log(f"{'run':13s} {run_desc}")
    t_start = opts.t_start = time.perf_counter()
    cells: list[Cell] = []
    for s in shapes:
        cells += run_quant_shape(s, fmt, tokens, impl_names, opts, device, dtype, timer, bw, rate,
                                 log)
        free_memory(device)
    opts.elapsed = time.perf_counter() - t_start
    return cells


def report(cells: list[Cell], impl_names: list[str], opts, env) -> int:
    """The end of a run: notes, the summary table, the --csv / --md / --plot files."""
    elapsed = opts.elapsed
    header = summary_header(impl_names, opts.weights)
    rows = [summary_row(c, impl_names) for c in cells]
    unchecked = [f"{c.shape} T={c.T}" for c in cells if not c.checked]
    legend = ("times in us (median); 'e/g' = eager/CUDA-graph replay; a baseline shows its better "
              "figure, 'g' = graph; floor = max(bytes/bw, flops/rate); speedup = best baseline / "
              "moe_ops best; FAIL = rel err above tolerance; skip/n/a: see detail")
    if opts.weights != "bf16":
        legend += (f"; weights {opts.weights}: bytes = quantized weights of the experts hit + "
                   "scales + activations, rate = " + ("FP8 _scaled_mm" if opts.weights == "fp8"
                                                      else "bf16 matmul")
                   + "; predeq = bf16 moe_ops on weights dequantized ahead of time (a reference "
                   "point, not a baseline); deq+moe_ops = dequantize every call, then bf16 "
                   "moe_ops; err = moe_ops vs float64 on the dequantized weights, unquantized "
                   "activations")
    log_finish(cells, elapsed, log, "not checked against the float64 reference (over "
               "--check-max-gflop): " + ", ".join(unchecked) if unchecked else "")
    log("")
    log(legend)
    log(text_table(header, rows))

    if opts.csv:
        write_csv(opts.csv, cells, impl_names, env)
    if opts.md:
        title = "moe_ops forward benchmark" + (
            f", {opts.weights} weights" if opts.weights != "bf16" else "")
        write_md(opts.md, title, env, legend, md_table(header, rows),
                 md_table(DETAIL_HEADER, detail_rows(cells, impl_names)),
                 "Not checked against the float64 reference: " + ", ".join(unchecked)
                 if unchecked else "")
    if opts.plot:
        write_plot(opts.plot, cells, impl_names, env, opts.dtype, opts.weights)
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
