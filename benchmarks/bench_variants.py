"""The expert variants' cost (issue 36): moe.dispatch at the gpt-oss-20b expert shape (E=32, K=4,
H=I=2880) with gpt-oss's experts (biases, swiglu_oai, interleaved gate/up rows, weights read as
transposed views of the checkpoint's storage) against the same shape as Mixtral-style experts
(SwiGLU, no biases, [E, 2I, H] storage): the same bytes and flops, so the ratio is the variants'
overhead. CUDA-graph replay medians (triton.testing.do_bench), forward; also forward+backward.

--peers: moe.dispatch on gpt-oss's experts against implementations that compute gpt-oss's
experts exactly (moe_ops.tools.baselines.gpt_oss_baselines: a torch._grouped_mm pipeline, a
per-expert loop, transformers' GptOssExperts in its eager / grouped_mm / batched_mm experts
implementations), on the checkpoint's [E, H, 2I] / [E, I, H] weights. Each is checked against
the float64 reference first: a wrong output is reported as wrong and not timed. Timed as a
CUDA-graph replay where it can be captured, eagerly otherwise.

    python benchmarks/bench_variants.py [--tokens 1 8 128 2048 8192] [--backward] [--peers]
"""
from __future__ import annotations

import argparse
from typing import Callable

import torch
import triton

import moe_ops
from moe_ops.reference import dispatch_reference
from moe_ops.tools import baselines as bl
from moe_ops.tools._timing import capture_graph

PEER_TOL = 2e-2          # bf16 against float64 (moe-ops-bench's tolerance)
MAX_GATHER_GIB = 16.0    # transformers batched_mm gathers [T*K, 3*H*I] weights: skipped above


def inputs(T, H, I, E, K, gpt_oss, g):
    hidden = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
    logits = torch.randn(T, E, device="cuda", generator=g)
    tw, ids = torch.ops.moe.route(logits, K)
    if gpt_oss:   # checkpoint storage [E, H, 2I] and [E, I, H], read through transposed views
        gu = (torch.randn(E, H, 2 * I, device="cuda", generator=g) * 0.02).bfloat16()
        dn = (torch.randn(E, I, H, device="cuda", generator=g) * 0.02).bfloat16()
        kw = dict(w13_bias=(torch.randn(E, 2 * I, device="cuda", generator=g) * 0.02).bfloat16(),
                  w2_bias=(torch.randn(E, H, device="cuda", generator=g) * 0.02).bfloat16(),
                  activation="swiglu_oai", alpha=1.702, limit=7.0, gate_up_interleaved=True)
        return hidden, gu.transpose(1, 2), dn.transpose(1, 2), tw, ids, kw
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) * 0.02).bfloat16()
    w2 = (torch.randn(E, H, I, device="cuda", generator=g) * 0.02).bfloat16()
    return hidden, w13, w2, tw, ids, {}


def time_fwd(args):
    hidden, w13, w2, tw, ids, kw = args
    graph, _ = capture_graph(lambda: moe_ops.dispatch(hidden, w13, w2, tw, ids, **kw))
    return triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median") * 1e3


def time_train(args):
    hidden, w13, w2, tw, ids, kw = args
    leaves = [t.detach().requires_grad_() for t in (hidden, w13, w2, tw)]
    extra = {k: (v.detach().requires_grad_() if torch.is_tensor(v) else v) for k, v in kw.items()}
    go = torch.randn_like(hidden)

    def step():
        out = moe_ops.dispatch(*leaves, ids, **extra)
        out.backward(go)
    return triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median") * 1e3


def gpt_oss_peer_args(args, b: bl.Baseline):
    """A gpt-oss peer's call arguments from inputs(..., gpt_oss=True): the checkpoint's storage
    (the transposed views' bases) with the biases."""
    hidden, w13, w2, tw, ids, kw = args
    return (hidden, w13.transpose(1, 2), kw["w13_bias"], w2.transpose(1, 2), kw["w2_bias"], tw,
            ids.long() if b.int64_ids else ids)


def check_then_time(name: str, fn: Callable[[], torch.Tensor], ref: torch.Tensor, tol: float,
                    time_fn: Callable[[Callable], float]) -> tuple[str, float | None, float]:
    """(status, us, rel err): fn's output against the float64 `ref` first; a wrong output is
    "WRONG" and not timed, an exception "ERR"/"OOM"; else "ok" with time_fn(fn)."""
    try:
        out = fn()
    except torch.cuda.OutOfMemoryError:
        return "OOM", None, float("nan")
    except Exception as exc:  # noqa: BLE001 - a peer's failure is a result
        print(f"  {name}: {type(exc).__name__}: {str(exc).strip()[:120]}")
        return "ERR", None, float("nan")
    err = float((out.double() - ref).norm() / ref.norm())
    del out
    if not (err <= tol):
        return "WRONG", None, err
    return "ok", time_fn(fn), err


def time_any(fn, capturable: bool) -> float:
    """us: the CUDA-graph replay median where `fn` captures, the eager median otherwise."""
    if capturable:
        try:
            graph, _ = capture_graph(fn)
            return triton.testing.do_bench(graph.replay, warmup=25, rep=100,
                                           return_mode="median") * 1e3
        except Exception:  # noqa: BLE001 - a capture failure leaves the eager time
            torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def peers_row(T, args, peers: list[bl.Baseline], K: int, H: int, I: int) -> list[str]:
    """moe_ops and every peer at one T: 'us' (g = graph replay), WRONG / n/a / skip / ERR."""
    hidden, w13, w2, tw, ids, kw = args
    ref = dispatch_reference(hidden.double(), w13, w2, tw, ids, **kw)
    cells = []
    st, us, err = check_then_time("moe_ops", lambda: moe_ops.dispatch(hidden, w13, w2, tw, ids, **kw),
                                  ref, PEER_TOL, lambda f: time_any(f, True))
    mo = us
    cells.append(f"{us:.1f}g" if st == "ok" else f"{st} {err:.1e}")
    best = None
    for b in peers:
        ok, why = bl.availability(b, hidden.device, hidden.dtype)
        if not ok:
            cells.append("n/a")
            print(f"  {b.name}: n/a ({why})")
            continue
        if b.gathers_weights and T * K * 3 * H * I * hidden.element_size() > MAX_GATHER_GIB * 2**30:
            cells.append("skip")
            continue
        call = gpt_oss_peer_args(args, b)
        st, us, err = check_then_time(b.name, lambda b=b, call=call: b.fn(*call), ref, PEER_TOL,
                                      lambda f, b=b: time_any(f, b.capturable))
        if st == "ok":
            cells.append(f"{us:.1f}" + ("g" if b.capturable else ""))
            if best is None or us < best[1]:
                best = (b.name, us)
        else:
            cells.append(f"{st} {err:.1e}" if st == "WRONG" else st)
        torch.cuda.empty_cache()
    bl.clear_caches()
    cells.append(f"{best[0]} {best[1]:.1f}" if best else "-")
    cells.append(f"{best[1] / mo:.2f}x" if best and mo else "-")
    return cells


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 128, 2048, 8192])
    p.add_argument("--backward", action="store_true", help="also forward+backward (eager)")
    p.add_argument("--peers", action="store_true",
                   help="moe_ops on gpt-oss's experts against the gpt-oss peers (checked, then "
                        "timed)")
    opts = p.parse_args(argv)
    H, I, E, K = 2880, 2880, 32, 4
    g = torch.Generator(device="cuda").manual_seed(0)
    if opts.peers:
        peers = bl.gpt_oss_baselines()
        header = ["T", "moe_ops", *(b.name for b in peers), "best peer", "speedup"]
        print(f"transformers {bl.transformers_version() or 'not installed'}; us, g = CUDA-graph "
              f"replay; WRONG = rel err vs float64 above {PEER_TOL:.0e} (not timed); speedup = "
              "best peer / moe_ops")
        rows = []
        for T in opts.tokens:
            rows.append([str(T), *peers_row(T, inputs(T, H, I, E, K, True, g), peers, K, H, I)])
            print("  " + " | ".join(rows[-1]), flush=True)
            torch.cuda.empty_cache()
        from moe_ops.tools.bench import text_table
        print(text_table(header, rows))
        return 0
    print(f"{'T':>6s} {'plain us':>10s} {'gpt-oss us':>11s} {'plain/gpt-oss':>14s}"
          + (f" {'train plain':>12s} {'train gpt-oss':>14s} {'ratio':>6s}" if opts.backward else ""))
    for T in opts.tokens:
        plain, oss = inputs(T, H, I, E, K, False, g), inputs(T, H, I, E, K, True, g)
        a, b = time_fwd(plain), time_fwd(oss)
        line = f"{T:6d} {a:10.1f} {b:11.1f} {a / b:14.3f}"
        if opts.backward:
            c, d = time_train(plain), time_train(oss)
            line += f" {c:12.1f} {d:14.1f} {c / d:6.3f}"
        print(line, flush=True)
        del plain, oss
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
